"""The grpo-run end-to-end half of tests/unit/drivers/test_algorithms.py: grpo-run as a subprocess."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_grpo


@pytest.mark.slow
def test_dapo_with_no_signal_samples_its_extra_rounds_and_says_it_trained_on_fewer(tmp_path):
    # The tiny random model never writes the keywords: every group's rewards are equal (all 0) in every round.
    run_dir = tmp_path / "run"
    result = run_grpo(
        ["debug=smoke", "algorithm=dapo", "train.dynamic_sampling_max_extra_rounds=2", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/loss" in r]
    assert len(train) == 2
    for row in train:
        # 2 groups per round, 3 rounds, none with signal; the step trains on the first round (zero advantages)
        assert (row["train/groups_dropped"], row["train/extra_rounds"]) == (6, 2)
        assert (row["train/groups_trained"], row["train/groups_short"]) == (0, 2)
        assert row["train/grad_norm"] == 0.0


@pytest.mark.slow
def test_dynamic_sampling_one_behind_keeps_the_lag_bound(tmp_path, ray_installed):
    run_dir = tmp_path / "run"
    moving_task = ["task=lipogram", "task.reward_weights.correctness=0", "task.reward_weights.answer=1"]
    args = ["debug=smoke", "sync=one_behind", "loss=grpo_clip", *moving_task, "train.eval_every=0", "train.steps=3"]
    result = run_grpo([*args, "train.dynamic_sampling=true", f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/loss" in r]
    assert len(train) == 3
    for row in train:
        assert row["sync/lag"] <= 1
        assert row["train/groups_trained"] + row["train/groups_short"] == 2
