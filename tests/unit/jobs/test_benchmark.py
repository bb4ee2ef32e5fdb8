"""job=benchmark: FLOP accounting, engine selection, and one real (tiny) run through grpo-run."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from rich.console import Console

from grpo_cli.errors import UserFacingError
from grpo_cli.jobs.benchmark import (
    BREAKDOWN,
    _scaling_config,
    _scaling_runs,
    benchmark_table,
    decode_matmul_floor_s,
    matmul_peak_gflops,
    parameter_counts,
    plot_scaling,
    resolve_engines,
    resolve_precisions,
    scaling_points,
    training_flops,
)
from grpo_cli.models import TINY_RANDOM, load_policy
from tests.conftest import compose_config


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


def test_precisions_are_both_where_bf16_is_fast_and_fp32_alone_where_it_is_emulated(monkeypatch):
    import grpo_cli.jobs.benchmark as benchmark

    cpu = torch.device("cpu")
    monkeypatch.setattr(benchmark, "has_fast_bf16", lambda device: True)
    assert resolve_precisions(["auto"], cpu) == (["bf16", "no"], None)
    assert resolve_precisions(["no", "auto"], cpu) == (["no", "bf16"], None)
    monkeypatch.setattr(benchmark, "has_fast_bf16", lambda device: False)
    precisions, note = resolve_precisions(["auto"], cpu)
    assert precisions == ["no"]
    assert note is not None and note.startswith("bf16 not measured: cpu has no fast bf16")
    assert "job.precisions=[bf16,no]" in note  # how to measure it anyway
    assert resolve_precisions(["bf16", "no"], cpu) == (["bf16", "no"], None)  # asked for by name: measured


def _engine_figures(step_s: float) -> dict:
    """One engine's figures as _measure_engine returns them (the ones the table reads), its step taking step_s."""
    phases = {"prefill_s": 0.01, "forward_s": 0.2, "sampling_s": 0.1, "decode_steps": 9, "decode_step_ms": 25.0}
    return {
        "startup_s": 1.0,
        "step_s_median": step_s,
        "step_s_min": step_s,
        "breakdown_s": {label: 0.0 for label, _key in BREAKDOWN},
        "generation_phases": phases,
        "decode_matmul_floor_ms": 3.0,
        "rollout_only_tokens_per_s": 100.0,
        "generation_tokens_per_s": 100.0,
        "training_tokens_per_s": 100.0,
        "training_gflops": 1.0,
        "matmul_peak_gflops": 10.0,
    }


def test_the_table_has_one_column_per_engine_and_precision_named_only_where_several_were_measured():
    # The end-to-end run measures bf16 only where it is fast (tests/e2e/test_benchmark_e2e.py); the columns of two
    # precisions are read here, each precision's figures under its own header.
    cfg = compose_config(["job=benchmark", "model=tiny_random"])
    both = {
        "bf16": {"compute_dtype": "bf16", "engines": {"hf": _engine_figures(1.25), "vllm": _engine_figures(2.5)}},
        "no": {"compute_dtype": "fp32", "engines": {"hf": _engine_figures(3.75), "vllm": _engine_figures(5.5)}},
    }
    console = Console(width=300, record=True)
    console.print(benchmark_table({"precisions": both}, cfg))
    lines = console.export_text().splitlines()
    header = next(line for line in lines if "rollout=" in line)
    names = ["rollout=hf bf16", "rollout=vllm bf16", "rollout=hf fp32", "rollout=vllm fp32"]
    assert [header.index(name) for name in names] == sorted(header.index(name) for name in names)
    median = next(line for line in lines if "seconds per step, median" in line)
    assert [cell.strip() for cell in median.split("│")[2:6]] == ["1.25", "2.50", "3.75", "5.50"]
    console = Console(width=300, record=True)
    console.print(benchmark_table({"precisions": {"no": both["no"]}}, cfg))  # one precision: no dtype in the header
    text = console.export_text()
    assert "rollout=hf " in text and "fp32" not in text and "bf16" not in text


def test_matmul_peak_is_a_measurement():
    assert matmul_peak_gflops(torch.device("cpu"), torch.float32, size=256, seconds=0.05) > 0.1


def test_decode_floor_times_every_linear_layer():
    model, _ = load_policy(TINY_RANDOM, torch.device("cpu"), torch.float32, seed=0)
    assert 0 < decode_matmul_floor_s(model, rows=4, device=torch.device("cpu"), repeats=1) < 5


def test_scaling_points_and_their_configs():
    cfg = compose_config(["job=benchmark", "job.scaling=true"])
    points = scaling_points(cfg)
    assert points[:4] == [("batch", b, 48) for b in (8, 16, 32, 64)]
    assert points[4:] == [("max_tokens", 16, t) for t in (32, 64, 128, 256)]
    run_cfg = _scaling_config(cfg, "hf", batch=64, max_tokens=256)
    # one optimizer step per batch, microbatches no larger than the base setting's (16), lengths forced
    assert (run_cfg.train.rollout_batch_size, run_cfg.train.train_batch_size) == (64, 64)
    assert run_cfg.train.gradient_accumulation_steps == 4
    assert run_cfg.rollout.max_tokens == run_cfg.rollout.min_tokens == 256 and run_cfg.rollout.stop == []
    assert _scaling_config(cfg, "hf", batch=8, max_tokens=32).train.gradient_accumulation_steps == 1
    assert cfg.train.rollout_batch_size == 16  # the base config is left alone


def _killed_point(run_cfg, axis, run_dir):
    """A scaling point whose process the system kills (as the OOM killer did at 24 GB)."""
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_scaling_point_killed_by_the_system_is_one_line_and_spares_the_job(tmp_path):
    # Before: every point ran in the job's own process, so memory piled up point after point and the OOM killer
    # took the whole job; each point now has its own process.
    cfg = compose_config(["job=benchmark", "model=tiny_random", "job.scaling_batches=[4]", "job.scaling_max_tokens=[]"])
    with pytest.raises(UserFacingError, match=r"hf batch 4 x 48 tokens died .*out of memory.*done: none"):
        _scaling_runs(cfg, "hf", tmp_path, console=None, point=_killed_point)


def test_scaling_plot_is_one_png(tmp_path):
    cfg = compose_config(["job=benchmark"])
    rows = [
        {
            "axis": axis,
            "batch": b,
            "max_tokens": t,
            "step_s": 1.0 + b / 8,
            "generation_s": 0.5,
            "generation_tokens_per_s": 100.0 * b,
            "training_tokens_per_s": 50.0,
        }
        for axis, b, t in [("batch", 8, 48), ("batch", 16, 48), ("max_tokens", 16, 32), ("max_tokens", 16, 64)]
    ]
    plot_scaling({"hf": rows, "vllm": rows}, cfg, tmp_path / "scaling.png")
    assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"
