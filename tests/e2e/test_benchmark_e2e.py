"""The grpo-run end-to-end half of tests/unit/jobs/test_benchmark.py: grpo-run as a subprocess."""

from __future__ import annotations

import json

import pytest
import torch

from grpo_cli.models.runtime import has_fast_bf16
from tests.conftest import run_grpo


@pytest.mark.slow
def test_benchmark_job_end_to_end_with_scaling_runs(tmp_path):
    """job.precisions=auto: both precisions where bf16 is fast, fp32 alone (said) where the CPU emulates bf16.

    bf16 by name on an AVX2-only CPU timed the emulation: its 2048x2048 matmul peak alone took minutes (the test
    took 367 s on an AVX2 AMD EPYC); the two-column table is tested without a run in tests/unit/jobs."""
    fast_bf16 = has_fast_bf16(torch.device("cpu"))
    run_dir = tmp_path / "bench"
    # One point on each axis: the batch axis at rollout.max_tokens (48), the length axis at the rollout batch (16).
    scaling = ["job.scaling=true", "job.scaling_batches=[4]", "job.scaling_max_tokens=[8]", "job.scaling_steps=1"]
    # A reward the random model's completions vary on (the share of words without an e), so that groups are not
    # flat and each step has rows to train: on keyword it scores 0, and a flat group has no gradient to time.
    varying = ["task=lipogram", "task.reward_weights.correctness=0", "task.reward_weights.answer=1"]
    result = run_grpo(
        [
            "job=benchmark",
            "model=tiny_random",
            *varying,
            "job.engines=[hf]",
            "job.steps=2",
            "job.precisions=[auto]",
            *scaling,
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "seconds per step, median" in result.stdout and "training GFLOP/s achieved" in result.stdout
    report = json.loads((run_dir / "benchmark.json").read_text())
    hf = report["engines"]["hf"]
    assert len(hf["steps"]) == 2  # every step of the fresh process (no warm-up left out by default)
    assert hf["step_s_min"] <= hf["step_s_median"]
    assert hf["training_gflops"] > 0 and hf["rollout_only_tokens"] == 16 * 48  # forced to max_tokens
    parts = sum(hf["breakdown_s"].values())
    assert 0 < parts <= hf["step_s_median"] * 1.5
    phases = hf["generation_phases"]  # the decode loop's own split of generation
    assert phases["decode_steps"] >= 1 and phases["forward_s"] > 0 and hf["decode_matmul_floor_ms"] > 0
    assert "decode step's matmuls alone (ms)" in result.stdout
    if fast_bf16:  # both precisions, each engine at each, phases and all: one column apiece
        assert "rollout=hf bf16" in result.stdout and "rollout=hf fp32" in result.stdout
        assert [report["precisions"][p]["compute_dtype"] for p in ("bf16", "no")] == ["bf16", "fp32"]
        assert report["precision_note"] is None
    else:  # fp32 alone, and the one line saying why and how to measure bf16 anyway
        assert list(report["precisions"]) == ["no"] and report["precisions"]["no"]["compute_dtype"] == "fp32"
        assert report["precision_note"].startswith("bf16 not measured: cpu has no fast bf16")
        assert report["precision_note"] in result.stdout and "rollout=hf bf16" not in result.stdout
    # `engines` is the configured precision's (model.mixed_precision=auto: bf16 exactly where it is fast).
    assert report["engines"] == report["precisions"]["bf16" if fast_bf16 else "no"]["engines"]
    for measured in report["precisions"].values():
        assert measured["engines"]["hf"]["generation_phases"]["forward_s"] > 0
        assert len(measured["engines"]["hf"]["steps"]) == 2

    assert "How a step's cost grows" in result.stdout
    rows = report["scaling"]["hf"]
    assert [(r["batch"], r["max_tokens"]) for r in rows] == [(4, 48), (16, 8)]
    assert all(r["step_s"] > 0 and r["generation_tokens_per_s"] > 0 for r in rows)
    assert (run_dir / "scaling.png").exists()
