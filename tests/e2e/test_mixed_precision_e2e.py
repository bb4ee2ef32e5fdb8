"""The grpo-run end-to-end half of tests/unit/models/test_mixed_precision.py: grpo-run as a subprocess."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_grpo


@pytest.mark.slow
def test_a_bf16_run_trains_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    result = run_grpo(["debug=smoke", "model.mixed_precision=bf16", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "train/loss" in row]
    assert steps
    for row in steps:  # finite numbers from bf16 forward passes, not NaN/inf
        assert all(abs(row[key]) < float("inf") for key in ("train/loss", "train/entropy", "train/grad_norm"))
        assert row["train/entropy"] > 0
