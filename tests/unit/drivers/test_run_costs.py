"""The loop's words about cost and about a zero loss: the on-policy ratio-loss note and the GPU-sized preset."""

import pytest

from grpo_cli.config import BatchShape
from grpo_cli.drivers.loop import gpu_experiment_for, zero_loss_note
from tests.conftest import compose_config


@pytest.mark.parametrize("loss", ["grpo_clip", "gspo"])
def test_an_on_policy_ratio_loss_at_zero_with_a_gradient_is_explained(loss):
    cfg = compose_config(["debug=smoke", f"loss={loss}"])
    note = zero_loss_note(cfg, BatchShape.from_config(cfg), {"train/loss": 0.0, "train/grad_norm": 1.7})
    assert note is not None and f"loss={loss} on-policy" in note and "ratio is exactly 1" in note


def test_no_note_where_the_zero_has_another_cause_or_the_loss_is_not_zero():
    on_policy = compose_config(["debug=smoke", "loss=grpo_clip"])
    shape = BatchShape.from_config(on_policy)
    assert zero_loss_note(on_policy, shape, {"train/loss": 0.0, "train/grad_norm": 0.0}) is None  # flat groups
    assert zero_loss_note(on_policy, shape, {"train/loss": 0.0123, "train/grad_norm": 1.0}) is None
    # a loss without a ratio at 0 is not this case
    plain = compose_config(["debug=smoke", "loss=reinforce_with_baseline"])
    assert zero_loss_note(plain, BatchShape.from_config(plain), {"train/loss": 0.0, "train/grad_norm": 1.0}) is None
    # two epochs per batch: the second runs off-policy, the ratio moves, the value is not 0 by construction
    off = compose_config(["debug=smoke", "loss=grpo_clip", "sync=multi_epoch"])
    assert zero_loss_note(off, BatchShape.from_config(off), {"train/loss": 0.0, "train/grad_norm": 1.0}) is None


def test_the_gpu_sized_alternative_is_the_preset_that_sets_the_task():
    assert gpu_experiment_for("math") == "cs336_math"
    assert gpu_experiment_for("medcalc") == "trl_medcalc"
    assert gpu_experiment_for("addition") == "hw4_qlora"
    assert gpu_experiment_for("keyword") is None  # keyword_ablation keeps the CPU task and model
