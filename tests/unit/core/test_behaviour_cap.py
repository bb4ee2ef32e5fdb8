"""sync=async's cap on the off-policy weight pi_prox / pi_behav (sync.behaviour_weight_cap, core.importance) and GSPO
under the decoupled weight (issue 57, items 4 and 7).

- a token whose weight exceeds the cap weighs 0 but stays in the loss's counts, as AReaL's ppo_actor_loss_fn masks
  it (written out here independently), and train/behaviour_capped_frac counts it;
- at rollout.importance_level=sequence the weight stays finite for any length (the product's log is compared);
- GSPO: the per-token weight on its sequence-level loss gives each sequence the arithmetic mean of its token
  weights (AReaL does the same), checked against that formula, value and gradient;
- the config: the cap acts only where the weight does, and null with level=sequence is refused in one line.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_cli.config import validate_config
from grpo_cli.core.importance import compute_importance_weights
from grpo_cli.core.loss_settings import LossSettings
from grpo_cli.core.train_step import microbatch_train_step
from grpo_cli.errors import UserFacingError
from grpo_cli.learner.settings import loss_settings
from tests.conftest import compose_config

EPS = 0.2
CAP = 5.0


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (3, 5)
    mask = torch.ones(shape)
    mask[1, 3:] = 0
    behav = torch.randn(shape, generator=g) * 0.3 - 2.0
    prox = behav + torch.randn(shape, generator=g) * 0.3
    prox[0, 1] = behav[0, 1] + math.log(900.0)  # pi_behav 1e-3, pi_prox 0.9: weight 900, far past the cap
    prox[2, 4] = behav[2, 4] + math.log(6.0)
    return {
        "policy": prox + torch.randn(shape, generator=g) * 0.05,
        "prox": prox,
        "behav": behav,
        "mask": mask,
        "advantages": torch.tensor([[1.0], [-0.5], [2.0]]),
    }


def areal_weights(prox: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """AReaL's ppo_actor_loss_fn: behav_imp_weight = exp(prox - behav); behav_mask = (w <= cap) & loss_mask;
    w = where(behav_mask, w, 0)."""
    weight = torch.exp(prox - behav)
    keep = (weight <= cap) & mask.bool()
    return torch.where(keep, weight, torch.zeros_like(weight))


def test_a_weight_past_the_cap_weighs_zero_as_areal_masks_it_and_is_counted():
    t = tensors()
    weights, meta = compute_importance_weights(
        t["prox"], t["behav"], t["mask"], "none", decoupled=True, behaviour_cap=CAP
    )
    torch.testing.assert_close(weights, areal_weights(t["prox"], t["behav"], t["mask"], CAP))
    assert weights[0, 1] == 0 and weights[2, 4] == 0
    assert meta["capped"].sum() == 2 and bool(meta["capped"][0, 1]) and bool(meta["capped"][2, 4])
    uncapped, _ = compute_importance_weights(t["prox"], t["behav"], t["mask"], "none", decoupled=True)
    assert uncapped[0, 1] == pytest.approx(900.0, rel=1e-4)  # what the cap removes


def test_the_capped_loss_is_areals_decoupled_objective_with_the_token_kept_in_the_counts():
    t = tensors()
    settings = LossSettings(loss_type="grpo_clip", cliprange=EPS, decoupled=True, behaviour_weight_cap=CAP)
    policy = t["policy"].clone().requires_grad_(True)
    loss, meta = microbatch_train_step(
        policy,
        t["mask"],
        1,
        settings,
        advantages=t["advantages"],
        old_log_probs=t["prox"],
        sampler_log_probs=t["behav"],
    )
    # Independently: -w * min(r A, clip(r) A), the token mean over each response's mask (capped tokens included
    # in the count, as AReaL divides by the loss mask), then the mean over responses.
    expected_policy = t["policy"].clone().requires_grad_(True)
    ratio = torch.exp(expected_policy - t["prox"])
    surrogate = torch.minimum(ratio * t["advantages"], ratio.clamp(1 - EPS, 1 + EPS) * t["advantages"])
    per_token = -areal_weights(t["prox"], t["behav"], t["mask"], CAP) * surrogate
    expected = ((per_token * t["mask"]).sum(-1) / t["mask"].sum(-1)).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    torch.testing.assert_close(policy.grad, expected_policy.grad)
    assert meta["behaviour_capped_frac"].item() == pytest.approx(2 / t["mask"].sum().item())


def test_sequence_level_weights_stay_finite_for_any_length():
    n = 20_000  # 0.05 per token: the product exp(1000) overflows fp32
    prox = torch.full((2, n), -1.0)
    behav = prox - 0.05
    behav[1] = prox[1] + 0.05  # the other way: exp(-1000) underflows to 0, finite
    mask = torch.ones(2, n)
    assert torch.isinf(torch.exp((prox - behav).sum(-1))).any()  # what an uncapped product gives
    weights, meta = compute_importance_weights(
        prox, behav, mask, "none", level="sequence", decoupled=True, behaviour_cap=CAP
    )
    assert torch.isfinite(weights).all() and (weights == 0).all()
    assert bool(meta["capped"][0].all()) and not bool(meta["capped"][1].any())
    settings = LossSettings(
        loss_type="grpo_clip", cliprange=EPS, decoupled=True, behaviour_weight_cap=CAP, importance_level="sequence"
    )
    policy = prox.clone().requires_grad_(True)
    loss, _ = microbatch_train_step(
        policy, mask, 1, settings, advantages=torch.ones(2, 1), old_log_probs=prox, sampler_log_probs=behav
    )
    assert torch.isfinite(loss) and torch.isfinite(policy.grad).all()
    short, _ = compute_importance_weights(
        prox[:, :4], behav[:, :4], mask[:, :4], "none", level="sequence", decoupled=True, behaviour_cap=CAP
    )
    torch.testing.assert_close(short[0], torch.full((4,), math.exp(0.2)))  # under the cap: the product itself


def test_gspo_under_the_decoupled_weight_gives_each_sequence_the_mean_of_its_token_weights():
    t = tensors()
    eps = 0.05
    settings = LossSettings(loss_type="gspo", cliprange=eps, decoupled=True, behaviour_weight_cap=CAP)
    policy = t["policy"].clone().requires_grad_(True)
    loss, _ = microbatch_train_step(
        policy,
        t["mask"],
        1,
        settings,
        advantages=t["advantages"],
        old_log_probs=t["prox"],
        sampler_log_probs=t["behav"],
    )
    expected_policy = t["policy"].clone().requires_grad_(True)
    mask, adv = t["mask"], t["advantages"].squeeze(-1)
    s = torch.exp(((expected_policy - t["prox"]) * mask).sum(-1) / mask.sum(-1))  # GSPO's sequence ratio
    sequence_loss = -torch.minimum(s * adv, s.clamp(1 - eps, 1 + eps) * adv)
    mean_weight = (areal_weights(t["prox"], t["behav"], mask, CAP) * mask).sum(-1) / mask.sum(-1)
    expected = (mean_weight * sequence_loss).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    torch.testing.assert_close(policy.grad, expected_policy.grad)


ASYNC = ["debug=smoke", "sync=async", "loss=grpo_clip"]


def test_the_cap_is_async_recomputes_by_default_and_nowhere_else():
    assert loss_settings(compose_config(ASYNC)).behaviour_weight_cap == CAP
    assert loss_settings(compose_config(["debug=smoke", "loss=grpo_clip"])).behaviour_weight_cap is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [*ASYNC, "sync.behaviour_weight_cap=null", "rollout.importance_level=sequence"],
            "sync.behaviour_weight_cap=null with rollout.importance_level=sequence",
        ),
        (
            [*ASYNC, "sync.behaviour_weight_cap=3.0", "sync.proximal=behaviour"],
            "sync.behaviour_weight_cap=3.0 caps decoupled PPO's pi_prox / pi_behav, which sync.proximal=behaviour",
        ),
        (
            [*ASYNC, "sync.behaviour_weight_cap=3.0", "rollout.importance_correction=truncated"],
            "rollout.importance_correction=truncated does not weigh by",
        ),
        (
            [*ASYNC, "sync.behaviour_weight_cap=null", "rollout.importance_correction=truncated"],
            "sync.behaviour_weight_cap=null caps decoupled PPO's",
        ),
        (
            ["debug=smoke", "loss=grpo_clip", "sync=one_behind", "sync.behaviour_weight_cap=3.0"],
            "sync.behaviour_weight_cap=3.0 acts only under sync=async",
        ),
    ],
)
def test_the_config_refuses_a_cap_where_it_cannot_act_in_one_line(overrides, message):
    with pytest.raises(UserFacingError, match=message.replace("(", r"\(").replace(")", r"\)")) as raised:
        validate_config(compose_config(overrides))
    assert "\n" not in str(raised.value)
    validate_config(compose_config([*ASYNC, "rollout.importance_level=sequence"]))  # the default cap: accepted
