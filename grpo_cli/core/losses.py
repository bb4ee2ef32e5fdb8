"""Per-token policy-gradient losses, one small function per loss type, and a dispatcher by name.

Each loss is per token, shape (batch, seq), unmasked; aggregation over tokens and examples happens in
:func:`grpo_cli.core.aggregate_token_loss` (called by :func:`grpo_cli.core.grpo_microbatch_train_step`).
Rewards and advantages are per example, (batch, 1), and broadcast over every token of the response.

The clipped losses return masks of the tokens each clip acted on, so the train step can log how often each
side bound: "clipped_low" (ratio below 1 - eps_low), "clipped_high" (ratio above 1 + eps_high) and
"clipped_dual" (dual-clip's bound on a negative advantage).
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


def _check_same_shape(tensor: torch.Tensor, policy_log_probs: torch.Tensor, name: str) -> None:
    if tensor.shape != policy_log_probs.shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} but policy_log_probs {tuple(policy_log_probs.shape)}; "
            "they must match"
        )


def _check_clip_ranges(cliprange: float, cliprange_high: float | None, dual_clip: float | None) -> float:
    """Validate the clip settings; returns eps_high (eps_low when cliprange_high is None: symmetric)."""
    if cliprange < 0:
        raise ValueError(f"cliprange must be >= 0, got {cliprange}")
    if cliprange_high is not None and cliprange_high < 0:
        raise ValueError(f"cliprange_high must be >= 0, got {cliprange_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 (the dual-clip paper uses 3), got {dual_clip}")
    return cliprange if cliprange_high is None else cliprange_high


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


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    cliprange: float,
    cliprange_high: float,
    dual_clip: float | None,
) -> LossOutput:
    """``-min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)``, optionally dual-clipped, with the masks of
    the tokens each bound acted on. ``ratio`` (B, T) carries the gradient, ``advantages`` is (B, 1)."""
    unclipped = ratio * advantages  # (B, T)
    clipped = torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange_high) * advantages  # (B, T)
    objective = torch.minimum(unclipped, clipped)
    # The clipped side is the minimum only beyond the bound on the side the advantage pushes towards.
    clipped_low = clipped < unclipped
    clipped_high = clipped_low & (advantages > 0)
    clipped_low = clipped_low & (advantages < 0)
    metadata = {"clipped": clipped_low | clipped_high, "clipped_low": clipped_low, "clipped_high": clipped_high}
    if dual_clip is not None:
        # Dual-clip (Ye et al. 2020): with A < 0 a huge ratio would make -rho * A unbounded; bound the
        # objective below by c * A (no gradient there, like any clipped token).
        bound = dual_clip * advantages  # (B, 1)
        dual = (advantages < 0) & (objective < bound)
        objective = torch.where(dual, bound.expand_as(objective), objective)
        metadata["clipped_dual"] = dual
    metadata["ratio"] = ratio.detach()
    return -objective, metadata


def compute_grpo_clip_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    cliprange: float,
    cliprange_high: float | None = None,
    dual_clip: float | None = None,
) -> LossOutput:
    """GRPO-Clip per-token loss ``-min(rho_t * A, clip(rho_t, 1 - eps_low, 1 + eps_high) * A)``.

    ``rho_t = pi_theta(o_t) / pi_old(o_t) = exp(log_probs - old_log_probs)``. Where the clipped side is the
    minimum, the loss is constant in the policy, so those tokens get no gradient. ``eps_low = cliprange``;
    ``eps_high = cliprange_high`` (DAPO's clip-higher, Yu et al. 2025), or ``cliprange`` when None
    (symmetric, the handout's loss). With ``dual_clip = c`` (Ye et al. 2020) a negative advantage's
    objective is further bounded below by ``c * A``: ``-max(min(rho A, clip(rho) A), c A)`` for ``A < 0``.

    Args:
        advantages (torch.Tensor): per-example advantage, shape (batch, 1) (or (batch,)).
        policy_log_probs (torch.Tensor): log-probs under the policy being trained, shape (batch, seq).
        old_log_probs (torch.Tensor): log-probs under the policy that sampled the rollouts, shape
            (batch, seq); treated as a constant (pass it detached).
        cliprange (float): eps_low (and eps_high unless ``cliprange_high`` is given), >= 0.
        cliprange_high (float | None): eps_high, >= 0; None: symmetric.
        dual_clip (float | None): the dual-clip constant c > 1; None: off.

    Returns:
        tuple[torch.Tensor, dict[str, torch.Tensor]]:

        - loss: per-token loss, shape (batch, seq).
        - metadata: "clipped" (batch, seq) bool, True where the clipped side was strictly smaller (chosen),
          split into "clipped_low" (A < 0, ratio below 1 - eps_low) and "clipped_high" (A > 0, ratio above
          1 + eps_high); "clipped_dual" (A < 0 and the dual-clip bound chosen) when ``dual_clip`` is set;
          "ratio" (batch, seq), rho_t, detached.
    """
    _check_same_shape(old_log_probs, policy_log_probs, "old_log_probs")
    cliprange_high = _check_clip_ranges(cliprange, cliprange_high, dual_clip)
    advantages = _as_column(advantages, policy_log_probs, "advantages")
    ratio = torch.exp(policy_log_probs - old_log_probs)  # (B, T)
    return _clipped_surrogate(ratio, advantages, cliprange, cliprange_high, dual_clip)


def compute_gspo_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float,
    cliprange_high: float | None = None,
) -> LossOutput:
    """GSPO per-token loss (Zheng et al. 2025, "Group Sequence Policy Optimization"): the clipped surrogate
    with one importance ratio per sequence, the geometric mean of its token ratios:

    ``s_i = exp(mean_t (log pi_theta(o_t) - log pi_old(o_t)))`` over the response tokens of sequence i, and
    ``-min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)`` broadcast over its tokens. Aggregated by
    a per-sequence mean (``sequence_mean``) this is the paper's objective; its gradient flows into every
    token of the sequence through ``s_i``. The paper clips in a far narrower range than GRPO
    (eps_low 3e-4, eps_high 4e-4: conf/loss/gspo.yaml) because ``s_i`` is length-normalized.

    Args:
        advantages (torch.Tensor): per-example advantage, shape (batch, 1) (or (batch,)).
        policy_log_probs (torch.Tensor): (batch, seq), with grad.
        old_log_probs (torch.Tensor): (batch, seq), constant.
        response_mask (torch.Tensor): (batch, seq), bool or float: the tokens whose ratios are averaged.
        cliprange (float): eps_low (and eps_high unless ``cliprange_high`` is given).
        cliprange_high (float | None): eps_high; None: symmetric.

    Returns:
        tuple[torch.Tensor, dict[str, torch.Tensor]]: the per-token loss (batch, seq) (one value per row) and
        the metadata of :func:`compute_grpo_clip_loss`, with "ratio" the sequence ratio broadcast over the
        row. An empty response has ratio 1.
    """
    _check_same_shape(old_log_probs, policy_log_probs, "old_log_probs")
    _check_same_shape(response_mask, policy_log_probs, "response_mask")
    cliprange_high = _check_clip_ranges(cliprange, cliprange_high, None)
    advantages = _as_column(advantages, policy_log_probs, "advantages")
    mask = response_mask.to(policy_log_probs.dtype)
    log_ratio = (policy_log_probs - old_log_probs) * mask  # (B, T); masked positions may hold anything
    sequence_log_ratio = log_ratio.sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp_min(1.0)
    ratio = torch.exp(sequence_log_ratio).expand_as(policy_log_probs)  # (B, 1) -> (B, T)
    return _clipped_surrogate(ratio, advantages, cliprange, cliprange_high, None)


def compute_cispo_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    cliprange_high: float,
) -> LossOutput:
    """CISPO per-token loss (MiniMax-M1, Chen et al. 2025): REINFORCE weighted by the clipped importance
    ratio, whose gradient is stopped:

    ``-sg(min(rho_t, 1 + eps_high)) * A * log pi_theta(o_t)``.

    Unlike GRPO-Clip no token loses its gradient: only the weight is capped. The paper sets no lower bound
    on the weight ("we did not impose a lower bound ... only tuned eps_high"), and neither does this.

    Args:
        advantages (torch.Tensor): per-example advantage, shape (batch, 1) (or (batch,)).
        policy_log_probs (torch.Tensor): (batch, seq), with grad.
        old_log_probs (torch.Tensor): (batch, seq), constant.
        cliprange_high (float): eps_high >= 0: the weight is capped at 1 + eps_high.

    Returns:
        tuple[torch.Tensor, dict[str, torch.Tensor]]: per-token loss (batch, seq); metadata "clipped" and
        "clipped_high" (tokens whose weight was capped), "ratio" (rho_t, detached).
    """
    _check_same_shape(old_log_probs, policy_log_probs, "old_log_probs")
    _check_clip_ranges(0.0, cliprange_high, None)
    advantages = _as_column(advantages, policy_log_probs, "advantages")
    ratio = torch.exp(policy_log_probs - old_log_probs).detach()  # (B, T)
    weight = torch.clamp(ratio, max=1.0 + cliprange_high)
    capped = ratio > 1.0 + cliprange_high
    loss = -weight * advantages * policy_log_probs
    metadata = {"clipped": capped, "clipped_high": capped, "clipped_low": torch.zeros_like(capped), "ratio": ratio}
    return loss, metadata


def _no_baseline(policy_log_probs: torch.Tensor, inputs: dict) -> LossOutput:
    return compute_naive_policy_gradient_loss(inputs["raw_rewards"], policy_log_probs), {}


def _reinforce_with_baseline(policy_log_probs: torch.Tensor, inputs: dict) -> LossOutput:
    return compute_naive_policy_gradient_loss(inputs["advantages"], policy_log_probs), {}


def _grpo_clip(policy_log_probs: torch.Tensor, inputs: dict) -> LossOutput:
    return compute_grpo_clip_loss(
        inputs["advantages"],
        policy_log_probs,
        inputs["old_log_probs"],
        inputs["cliprange"],
        cliprange_high=inputs["cliprange_high"],
        dual_clip=inputs["dual_clip"],
    )


def _gspo(policy_log_probs: torch.Tensor, inputs: dict) -> LossOutput:
    return compute_gspo_loss(
        inputs["advantages"],
        policy_log_probs,
        inputs["old_log_probs"],
        inputs["response_mask"],
        inputs["cliprange"],
        cliprange_high=inputs["cliprange_high"],
    )


def _cispo(policy_log_probs: torch.Tensor, inputs: dict) -> LossOutput:
    return compute_cispo_loss(inputs["advantages"], policy_log_probs, inputs["old_log_probs"], inputs["cliprange_high"])


# loss_type -> (loss function, the optional arguments it requires)
_LOSSES: dict[str, tuple[Callable[[torch.Tensor, dict], LossOutput], tuple[str, ...]]] = {
    "no_baseline": (_no_baseline, ("raw_rewards",)),
    "reinforce_with_baseline": (_reinforce_with_baseline, ("advantages",)),
    "grpo_clip": (_grpo_clip, ("advantages", "old_log_probs", "cliprange")),
    "gspo": (_gspo, ("advantages", "old_log_probs", "response_mask", "cliprange")),
    "cispo": (_cispo, ("advantages", "old_log_probs", "cliprange_high")),
}

POLICY_GRADIENT_LOSS_TYPES: tuple[str, ...] = tuple(_LOSSES)
# The losses that weigh tokens by an importance ratio against the old policy (they need old log-probs, and
# stay correct off-policy: several optimizer steps per batch, stale samples).
RATIO_LOSS_TYPES: tuple[str, ...] = ("grpo_clip", "gspo", "cispo")


def compute_policy_gradient_loss(
    policy_log_probs: torch.Tensor,
    loss_type: str,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
    cliprange_high: float | None = None,
    dual_clip: float | None = None,
    response_mask: torch.Tensor | None = None,
) -> LossOutput:
    """Per-token policy-gradient loss of the given type.

    Args:
        policy_log_probs (torch.Tensor): log-probs under the policy being trained, shape (batch, seq).
        loss_type (str): one of ``POLICY_GRADIENT_LOSS_TYPES``:

            - "no_baseline": ``-R * log pi``; needs ``raw_rewards``.
            - "reinforce_with_baseline": ``-A * log pi``; needs ``advantages``.
            - "grpo_clip": see :func:`compute_grpo_clip_loss`; needs ``advantages``, ``old_log_probs``,
              ``cliprange``; reads ``cliprange_high`` and ``dual_clip``.
            - "gspo": see :func:`compute_gspo_loss`; needs ``advantages``, ``old_log_probs``,
              ``response_mask``, ``cliprange``; reads ``cliprange_high``.
            - "cispo": see :func:`compute_cispo_loss`; needs ``advantages``, ``old_log_probs``,
              ``cliprange_high``.

        raw_rewards (torch.Tensor | None): shape (batch, 1).
        advantages (torch.Tensor | None): shape (batch, 1).
        old_log_probs (torch.Tensor | None): shape (batch, seq).
        cliprange (float | None): eps (eps_low with ``cliprange_high``).
        cliprange_high (float | None): eps_high (clip-higher); None: symmetric.
        dual_clip (float | None): dual-clip constant c > 1 for "grpo_clip"; None: off.
        response_mask (torch.Tensor | None): (batch, seq), for "gspo"'s per-sequence ratio.

    Returns:
        tuple[torch.Tensor, dict[str, torch.Tensor]]: per-token loss (batch, seq) and the loss's metadata
        (empty for the two REINFORCE losses; clip masks and "ratio" for the others).

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
        "cliprange_high": cliprange_high,
        "dual_clip": dual_clip,
        "response_mask": response_mask,
    }
    missing = [name for name in required if inputs[name] is None]
    if missing:
        raise ValueError(f"loss_type {loss_type!r} needs {', '.join(missing)}, which was not given (None)")
    return loss_fn(policy_log_probs, inputs)
