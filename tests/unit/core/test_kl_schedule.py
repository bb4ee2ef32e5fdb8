"""The KL coefficient's schedule (kl.beta_schedule): core.kl.scheduled_kl_beta against values worked out by hand,
and LossSettings' view of it."""

from __future__ import annotations

import pytest

from grpo_cli.core import LossSettings
from grpo_cli.core.kl import scheduled_kl_beta


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ("constant", [0.1, 0.1, 0.1, 0.1, 0.1]),
        ("linear", [0.1, 0.075, 0.05, 0.025, 0.0]),
        # 0.1 * (1 + cos(pi t)) / 2 at t = 0, 1/4, 1/2, 3/4, 1: (1 + 0.70710678) / 2 = 0.85355339
        ("cosine", [0.1, 0.085355339, 0.05, 0.014644661, 0.0]),
    ],
)
def test_scheduled_kl_beta_by_hand(schedule: str, expected: list[float]) -> None:
    got = [scheduled_kl_beta(step, 5, 0.1, 0.0, schedule) for step in range(1, 6)]
    assert got == pytest.approx(expected, abs=1e-9)


def test_an_increasing_schedule_and_the_edges() -> None:
    assert scheduled_kl_beta(2, 3, 0.0, 0.04, "linear") == pytest.approx(0.02)
    assert scheduled_kl_beta(1, 1, 0.1, 0.0, "cosine") == 0.1  # a one-step run stays at its start
    assert scheduled_kl_beta(9, 5, 0.1, 0.0, "linear") == 0.0  # past the last step: clamped
    with pytest.raises(ValueError, match="unknown KL schedule 'step'"):
        scheduled_kl_beta(1, 5, 0.1, 0.0, "step")


def test_loss_settings_at_step_holds_that_steps_coefficient() -> None:
    settings = LossSettings("grpo_clip", kl_beta=0.1, kl_beta_schedule="linear", kl_beta_final=0.0, total_steps=5)
    step_3 = settings.at_step(3)
    assert step_3.kl_beta == pytest.approx(0.05) and step_3.kl_beta_schedule == "constant"
    assert step_3.at_step(5).kl_beta == pytest.approx(0.05)  # held: a step's settings do not move again
    assert settings.kl_penalty and LossSettings("grpo_clip", kl_beta_schedule="linear", kl_beta_final=0.1).kl_penalty
    assert not LossSettings("grpo_clip").kl_penalty
    assert LossSettings("grpo_clip", kl_beta=0.1).at_step(7).kl_beta == 0.1  # constant
