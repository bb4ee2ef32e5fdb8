"""The grpo-run end-to-end half of tests/unit/models/test_mixed_precision.py: grpo-run as a subprocess."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_grpo


@pytest.mark.slow
def test_a_bf16_run_trains_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    # a reward that varies on the tiny random model (lipogram's answer): rows with a gradient are forwarded in bf16
    task = ["task=lipogram", "task.reward_weights.correctness=0", "task.reward_weights.answer=1"]
    result = run_grpo(["debug=smoke", *task, "model.mixed_precision=bf16", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "train/loss" in row]
    assert steps
    assert any(row["train/optimizer_steps"] for row in steps)
    for row in steps:  # finite numbers from bf16 forward passes, not NaN/inf
        if not row["train/optimizer_steps"]:
            continue  # an all-flat step (train/flat_steps): nothing forwarded
        assert all(abs(row[key]) < float("inf") for key in ("train/loss", "train/entropy", "train/grad_norm"))
        assert row["train/entropy"] > 0
