"""Decoupled PPO (sync=async, core.importance `decoupled`): the ratio is clipped against the proximal policy and
each token weighed by pi_prox / pi_behav, whatever rollout.importance_correction is.

- with the proximal policy equal to the behaviour policy the loss and its gradient are grpo_clip's on the same
  tensors;
- otherwise they are AReaL's decoupled objective written out here independently,
  -(pi_prox / pi_behav) * min(r * A, clip(r, 1 - eps, 1 + eps) * A) with r = pi / pi_prox, token-mean per response;
- without `decoupled` (every other strategy) importance_correction=none still weighs 1.
"""

from __future__ import annotations

import torch

from grpo_cli.core.loss_settings import LossSettings
from grpo_cli.core.train_step import microbatch_train_step

EPS = 0.2


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (3, 6)
    mask = torch.ones(shape)
    mask[0, 4:] = 0
    mask[2, 2:] = 0
    return {
        "policy": (torch.randn(shape, generator=g) * 0.3 - 2.0),
        "prox": (torch.randn(shape, generator=g) * 0.3 - 2.0),
        "behav": (torch.randn(shape, generator=g) * 0.3 - 2.0),
        "mask": mask,
        "advantages": torch.tensor([[1.0], [-0.5], [2.0]]),
    }


def loss_and_grad(t: dict[str, torch.Tensor], old: torch.Tensor, decoupled: bool, correction: str = "none"):
    policy = t["policy"].clone().requires_grad_(True)
    settings = LossSettings(loss_type="grpo_clip", cliprange=EPS, importance_correction=correction, decoupled=decoupled)
    loss, _ = microbatch_train_step(
        policy, t["mask"], 1, settings, advantages=t["advantages"], old_log_probs=old, sampler_log_probs=t["behav"]
    )
    return loss, policy.grad


def areal_decoupled_loss(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    policy = t["policy"].clone().requires_grad_(True)
    ratio = torch.exp(policy - t["prox"])
    clipped = torch.clamp(ratio, 1 - EPS, 1 + EPS)
    objective = torch.min(ratio * t["advantages"], clipped * t["advantages"])
    behaviour_weight = torch.exp(t["prox"] - t["behav"])
    per_token = -behaviour_weight * objective
    per_response = (per_token * t["mask"]).sum(-1) / t["mask"].sum(-1)
    loss = per_response.mean()
    loss.backward()
    return loss.detach(), policy.grad


def test_with_the_proximal_policy_equal_to_the_behaviour_policy_it_is_grpo_clip():
    t = tensors()
    decoupled, grad = loss_and_grad(t, t["behav"], decoupled=True)
    plain, plain_grad = loss_and_grad(t, t["behav"], decoupled=False)
    torch.testing.assert_close(decoupled, plain)
    torch.testing.assert_close(grad, plain_grad)


def test_it_is_the_decoupled_objective_written_out():
    t = tensors(1)
    loss, grad = loss_and_grad(t, t["prox"], decoupled=True)
    expected, expected_grad = areal_decoupled_loss(t)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, expected_grad)


def test_without_decoupled_importance_correction_none_still_weighs_one():
    t = tensors(2)
    loss, _ = loss_and_grad(t, t["prox"], decoupled=False)
    weighted, _ = loss_and_grad(t, t["prox"], decoupled=True)
    assert not torch.allclose(loss, weighted)  # the weight acts only when decoupled
    behaviour_is_proximal = dict(t, behav=t["prox"])
    unweighted, _ = loss_and_grad(behaviour_is_proximal, t["prox"], decoupled=True)
    torch.testing.assert_close(unweighted, loss)


def test_truncated_caps_the_decoupled_weight():
    t = tensors(3)
    t["behav"] = t["prox"] - 3.0  # pi_prox / pi_behav = e^3, capped at 2
    capped, _ = loss_and_grad(t, t["prox"], decoupled=True, correction="truncated")
    t2 = dict(t, behav=t["prox"] - torch.log(torch.tensor(2.0)))  # a weight of exactly 2 everywhere
    at_two, _ = loss_and_grad(t2, t["prox"], decoupled=True)
    torch.testing.assert_close(capped, at_two)
