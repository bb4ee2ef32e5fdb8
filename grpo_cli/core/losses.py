"""Per-token policy-gradient losses, one small function per loss type, and a dispatcher by name.

Each loss is per token, shape (batch, seq), unmasked; aggregation over tokens and examples happens in
:func:`grpo_cli.core.grpo_microbatch_train_step`. Rewards and advantages are per example, (batch, 1), and
broadcast over every token of the response.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LossOutput = tuple[torch.Tensor, dict[str, torch.Tensor]]


def _as_column(values: torch.Tensor, policy_log_probs: torch.Tensor, name: str) -> torch.Tensor:
    """Return per-example ``values`` as (batch, 1), accepting (batch,) too.

    A (batch,) tensor would silently broadcast along the wrong axis against (batch, seq), hence the reshape.
    """
    batch_size = policy_log_probs.shape[0]
    if values.dim() == 1:
        values = values.unsqueeze(-1)
    if values.shape != (batch_size, 1):
        raise ValueError(
            f"{name} has shape {tuple(values.shape)} but policy_log_probs {tuple(policy_log_probs.shape)}; "
            f"pass one value per example, shape ({batch_size}, 1)"
        )
    return values


def compute_naive_policy_gradient_loss(
    raw_rewards_or_advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
) -> torch.Tensor:
    """REINFORCE per-token loss ``-A * log pi_theta(o_t)``.

    With raw rewards as ``A`` this is the "no_baseline" loss, with group-normalized advantages the
    "reinforce_with_baseline" loss.

    Args:
        raw_rewards_or_advantages (torch.Tensor): per-example reward or advantage, shape (batch, 1) (or
            (batch,)).
        policy_log_probs (torch.Tensor): log-probs of the sampled tokens under the policy, shape (batch, seq).

    Returns:
        torch.Tensor: per-token loss, shape (batch, seq).
    """
    advantages = _as_column(raw_rewards_or_advantages, policy_log_probs, "raw_rewards_or_advantages")
    return -advantages * policy_log_probs  # (B, 1) * (B, T) -> (B, T)


def compute_grpo_clip_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    cliprange: float,
) -> LossOutput:
    """GRPO-Clip per-token loss ``-min(rho_t * A, clip(rho_t, 1 - eps, 1 + eps) * A)``.

    ``rho_t = pi_theta(o_t) / pi_old(o_t) = exp(log_probs - old_log_probs)``. Where the clipped side is the
    minimum, the loss is constant in the policy, so those tokens get no gradient.

    Args:
        advantages (torch.Tensor): per-example advantage, shape (batch, 1) (or (batch,)).
        policy_log_probs (torch.Tensor): log-probs under the policy being trained, shape (batch, seq).
        old_log_probs (torch.Tensor): log-probs under the policy that sampled the rollouts, shape
            (batch, seq); treated as a constant (pass it detached).
        cliprange (float): eps, >= 0.

    Returns:
        tuple[torch.Tensor, dict[str, torch.Tensor]]:

        - loss: per-token loss, shape (batch, seq).
        - metadata: "clipped" (batch, seq) bool, True where the clipped side was strictly smaller (chosen);
          "ratio" (batch, seq), rho_t, detached.
    """
    if old_log_probs.shape != policy_log_probs.shape:
        raise ValueError(
            f"old_log_probs has shape {tuple(old_log_probs.shape)} but policy_log_probs "
            f"{tuple(policy_log_probs.shape)}; they must match"
        )
    if cliprange < 0:
        raise ValueError(f"cliprange must be >= 0, got {cliprange}")
    advantages = _as_column(advantages, policy_log_probs, "advantages")

    ratio = torch.exp(policy_log_probs - old_log_probs)  # (B, T)
    unclipped = ratio * advantages  # (B, T)
    clipped = torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange) * advantages  # (B, T)
    loss = -torch.minimum(unclipped, clipped)
    return loss, {"clipped": clipped < unclipped, "ratio": ratio.detach()}


def _no_baseline(policy_log_probs: torch.Tensor, inputs: dict) -> LossOutput:
    return compute_naive_policy_gradient_loss(inputs["raw_rewards"], policy_log_probs), {}


def _reinforce_with_baseline(policy_log_probs: torch.Tensor, inputs: dict) -> LossOutput:
    return compute_naive_policy_gradient_loss(inputs["advantages"], policy_log_probs), {}


def _grpo_clip(policy_log_probs: torch.Tensor, inputs: dict) -> LossOutput:
    return compute_grpo_clip_loss(inputs["advantages"], policy_log_probs, inputs["old_log_probs"], inputs["cliprange"])


# loss_type -> (loss function, the optional arguments it requires)
_LOSSES: dict[str, tuple[Callable[[torch.Tensor, dict], LossOutput], tuple[str, ...]]] = {
    "no_baseline": (_no_baseline, ("raw_rewards",)),
    "reinforce_with_baseline": (_reinforce_with_baseline, ("advantages",)),
    "grpo_clip": (_grpo_clip, ("advantages", "old_log_probs", "cliprange")),
}

POLICY_GRADIENT_LOSS_TYPES: tuple[str, ...] = tuple(_LOSSES)


def compute_policy_gradient_loss(
    policy_log_probs: torch.Tensor,
    loss_type: str,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
) -> LossOutput:
    """Per-token policy-gradient loss of the given type.

    Args:
        policy_log_probs (torch.Tensor): log-probs under the policy being trained, shape (batch, seq).
        loss_type (str): one of ``POLICY_GRADIENT_LOSS_TYPES``:

            - "no_baseline": ``-R * log pi``; needs ``raw_rewards``.
            - "reinforce_with_baseline": ``-A * log pi``; needs ``advantages``.
            - "grpo_clip": see :func:`compute_grpo_clip_loss`; needs ``advantages``, ``old_log_probs``,
              ``cliprange``.

        raw_rewards (torch.Tensor | None): shape (batch, 1).
        advantages (torch.Tensor | None): shape (batch, 1).
        old_log_probs (torch.Tensor | None): shape (batch, seq).
        cliprange (float | None): eps for "grpo_clip".

    Returns:
        tuple[torch.Tensor, dict[str, torch.Tensor]]: per-token loss (batch, seq) and the loss's metadata
        (empty except for "grpo_clip").

    Raises:
        ValueError: on an unknown ``loss_type``, or when an argument the loss type needs is None.
    """
    if loss_type not in _LOSSES:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {list(POLICY_GRADIENT_LOSS_TYPES)}")
    loss_fn, required = _LOSSES[loss_type]
    inputs = {
        "raw_rewards": raw_rewards,
        "advantages": advantages,
        "old_log_probs": old_log_probs,
        "cliprange": cliprange,
    }
    missing = [name for name in required if inputs[name] is None]
    if missing:
        raise ValueError(f"loss_type {loss_type!r} needs {', '.join(missing)}, which was not given (None)")
    return loss_fn(policy_log_probs, inputs)
