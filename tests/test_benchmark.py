"""job=benchmark: FLOP accounting, engine selection, and one real (tiny) run through grpo-run."""

from __future__ import annotations

import json

import pytest
import torch

from grpo_cli.errors import UserFacingError
from grpo_cli.jobs.benchmark import matmul_peak_gflops, parameter_counts, resolve_engines, training_flops
from grpo_cli.models import TINY_RANDOM, load_policy
from tests.conftest import run_grpo


def test_parameter_counts_leave_out_the_tied_embedding_once():
    model, tokenizer = load_policy(TINY_RANDOM, torch.device("cpu"), torch.float32, seed=0)
    non_embedding, vocab, hidden = parameter_counts(model)
    total = sum(p.numel() for p in model.parameters())  # parameters() lists a tied weight once
    assert (vocab, hidden) == (len(tokenizer), 64)
    assert non_embedding == total - vocab * hidden


def test_training_flops_are_six_per_weight_per_token_plus_the_head_on_responses():
    assert (
        training_flops(non_embedding=10, vocab=100, hidden=4, tokens=7, response_tokens=3) == 6 * 10 * 7 + 6 * 400 * 3
    )


def test_engine_selection():
    assert resolve_engines(["hf"]) == ["hf"]
    assert resolve_engines(["hf", "hf"]) == ["hf"]
    assert resolve_engines(["auto"])[0] == "hf"
    with pytest.raises(UserFacingError, match="job.engines contains 'sglang'"):
        resolve_engines(["sglang"])


def test_matmul_peak_is_a_measurement():
    assert matmul_peak_gflops(torch.device("cpu"), torch.float32, size=256, seconds=0.05) > 0.1


@pytest.mark.slow
def test_benchmark_job_end_to_end(tmp_path):
    run_dir = tmp_path / "bench"
    result = run_grpo(
        ["job=benchmark", "model=tiny_random", "job.engines=[hf]", "job.steps=2", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "seconds per step, median" in result.stdout and "training GFLOP/s achieved" in result.stdout
    report = json.loads((run_dir / "benchmark.json").read_text())
    hf = report["engines"]["hf"]
    assert len(hf["steps"]) == 2  # measured steps, the warm-up left out
    assert hf["step_s_min"] <= hf["step_s_median"]
    assert hf["training_gflops"] > 0 and hf["rollout_only_tokens"] == 16 * 48  # forced to max_tokens
    parts = sum(hf["breakdown_s"].values())
    assert 0 < parts <= hf["step_s_median"] * 1.5
