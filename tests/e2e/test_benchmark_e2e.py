"""The grpo-run end-to-end half of tests/unit/jobs/test_benchmark.py: grpo-run as a subprocess."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_grpo


@pytest.mark.slow
def test_benchmark_job_end_to_end_with_scaling_runs(tmp_path):
    run_dir = tmp_path / "bench"
    scaling = ["job.scaling=true", "job.scaling_batches=[4,8]", "job.scaling_max_tokens=[8]", "job.scaling_steps=1"]
    result = run_grpo(
        [
            "job=benchmark",
            "model=tiny_random",
            "job.engines=[hf]",
            "job.steps=2",
            "job.precisions=[bf16,no]",
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
    # Both precisions, each engine at each, phases and all: one column apiece; `engines` is the configured one's.
    assert "rollout=hf bf16" in result.stdout and "rollout=hf fp32" in result.stdout
    assert [report["precisions"][p]["compute_dtype"] for p in ("bf16", "no")] == ["bf16", "fp32"]
    for measured in report["precisions"].values():
        assert measured["engines"]["hf"]["generation_phases"]["forward_s"] > 0
        assert len(measured["engines"]["hf"]["steps"]) == 2

    assert "How a step's cost grows" in result.stdout
    rows = report["scaling"]["hf"]
    assert [(r["batch"], r["max_tokens"]) for r in rows] == [(4, 48), (8, 48), (16, 8)]
    assert all(r["step_s"] > 0 and r["generation_tokens_per_s"] > 0 for r in rows)
    assert (run_dir / "scaling.png").exists()
