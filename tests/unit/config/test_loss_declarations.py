"""Each loss's declaration (grpo_cli.core.losses.register_loss: what it needs and reads) is what the config checks and
prints: a loss registered here, and nowhere else, is accepted, refused and described by its declaration alone."""

from __future__ import annotations

import pytest

from grpo_cli.config import help_of, needs_old_log_probs, validate_config
from grpo_cli.config.declared import check_fields
from grpo_cli.config.schemas import LossConfig
from grpo_cli.core.losses import LOSSES, LossSpec, reinforce_loss
from grpo_cli.errors import UserFacingError
from tests.conftest import compose_config


@pytest.fixture
def declare(monkeypatch):
    """Register loss `name` with `needs` and `reads` for one test (the REINFORCE function stands in for its math)."""

    def register(name: str, needs: tuple[str, ...], reads: tuple[str, ...] = ()) -> None:
        monkeypatch.setitem(LOSSES, name, LossSpec(reinforce_loss, f"the {name} test loss", needs, reads))

    return register


def test_a_loss_declaring_old_log_probs_is_a_ratio_loss_and_one_without_is_refused_off_policy(declare):
    declare("with_ratio", needs=("advantages", "old_log_probs"))
    declare("without_ratio", needs=("advantages",))
    off_policy = ["sync=multi_epoch"]
    ratio_cfg = compose_config([*off_policy, "loss.type=with_ratio"])
    validate_config(ratio_cfg)
    assert needs_old_log_probs(ratio_cfg)  # computed once per rollout batch because the declaration says so
    with pytest.raises(UserFacingError, match=r"loss=without_ratio ignores: use loss=grpo_clip .*with_ratio"):
        validate_config(compose_config([*off_policy, "loss.type=without_ratio"]))
    # Where old log-probs cannot exist (sync.old_log_probs=false off-policy), the loss that needs them is refused.
    with pytest.raises(UserFacingError, match="loss=with_ratio with sync=multi_epoch needs the old policy's log-probs"):
        validate_config(compose_config([*off_policy, "loss.type=with_ratio", "sync.old_log_probs=false"]))


def test_loss_type_accepts_and_describes_exactly_the_declared_losses(declare):
    with pytest.raises(UserFacingError, match="loss.type=novel is not one of"):
        check_fields(compose_config(["loss.type=novel"]))
    declare("novel", needs=("advantages",))
    check_fields(compose_config(["loss.type=novel"]))
    assert "novel: the novel test loss" in help_of(LossConfig, "type")
    for name, spec in LOSSES.items():
        assert f"{name}: {spec.summary}" in help_of(LossConfig, "type")


def test_an_option_is_refused_for_a_loss_that_does_not_declare_reading_it(declare):
    declare("reads_dual_clip", needs=("advantages", "old_log_probs"), reads=("dual_clip",))
    declare("ignores_dual_clip", needs=("advantages", "old_log_probs"))
    validate_config(compose_config(["loss.type=reads_dual_clip", "loss.dual_clip=3"]))
    with pytest.raises(
        UserFacingError,
        match=r"loss.dual_clip=3.0 bounds grpo_clip's ratio, but loss=ignores_dual_clip: "
        r"use loss=grpo_clip or reads_dual_clip, or drop loss.dual_clip",
    ):
        validate_config(compose_config(["loss.type=ignores_dual_clip", "loss.dual_clip=3"]))
