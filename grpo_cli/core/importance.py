"""Sampler/learner mismatch correction: importance weights between the policy the learner scores and the
distribution the rollout engine actually sampled from.

The engine (vLLM's kernels, a bf16 decode loop, a generator running behind the learner) samples from
``pi_sampler``, which is not exactly the learner's ``pi_learner`` (its old policy, or the current one when no
old log-probs are computed). The token-level ratio ``w_t = pi_learner(o_t) / pi_sampler(o_t)`` corrects the
policy gradient for the difference (``rollout.importance_correction``):

- "none": no correction (the mismatch is still measured).
- "truncated" (TIS; Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
  training"): every token's loss is weighted by ``min(w_t, C)``; with level "sequence" by
  ``min(prod_t w_t, C)`` for the whole response.
- "masked" (MIS, Liu et al. 2025, "When speed kills stability"; IcePop; verl's ``rollout_is_threshold="low_C"``):
  a token whose ``w_t`` lies inside ``[C_low, C]`` keeps ``w_t`` as its weight; one outside is rejected (weight 0);
  with level "sequence" the whole response is weighted ``prod_t w_t`` inside the band and rejected outside.

The weights are constants (no gradient) and 0 off the response mask, as verl's
(``verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_weights``; equal on the same tensors,
tests/unit/core/test_core_importance.py). The rejection is returned apart from the weights ("masked"), like verl's and
slime's rejection masks, so a caller can take rejected tokens out of the loss's counts instead of adding 0 to
them (core.train_step does, docs/algorithm.md says where).
"""

from __future__ import annotations

import math

import torch

IMPORTANCE_CORRECTIONS: tuple[str, ...] = ("none", "truncated", "masked")
IMPORTANCE_LEVELS: tuple[str, ...] = ("token", "sequence")


def compute_importance_weights(
    learner_log_probs: torch.Tensor,
    sampler_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    level: str = "token",
    threshold: float = 2.0,
    threshold_low: float | None = None,
    decoupled: bool = False,
    behaviour_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss weights that correct for sampling from ``pi_sampler`` instead of ``pi_learner``.

    Args:
        learner_log_probs (torch.Tensor): (batch, seq) log-probs of the sampled tokens under the learner's
            policy (its old policy, or the current one detached); treated as constants.
        sampler_log_probs (torch.Tensor): (batch, seq) the same tokens' log-probs under the distribution the
            engine sampled from.
        response_mask (torch.Tensor): (batch, seq), bool or float.
        mode (str): one of ``IMPORTANCE_CORRECTIONS``.
        level (str): one of ``IMPORTANCE_LEVELS``: one ratio per token, or one per response (the product of
            its token ratios).
        threshold (float): C > 0: the cap of "truncated", the upper bound of "masked".
        threshold_low (float | None): the lower bound of "masked"; None: 1 / C.
        decoupled (bool): decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization";
            AReaL's ``use_decoupled_loss``): the learner's side is a proximal policy recomputed after sampling,
            so the weight pi_prox / pi_behav is part of the objective and applies with mode "none" too (the
            ratio itself, capped by ``behaviour_cap``); "truncated" and "masked" cap or band it as usual.
        behaviour_cap (float | None): with ``decoupled`` and mode "none", a token (level "sequence": a response)
            whose weight exceeds it gets weight 0 but stays in the loss's counts, as AReaL's
            ``behav_imp_weight_cap`` masks it (``areal/utils/functional.py``: ``ppo_actor_loss_fn``); the
            comparison is in log space, so the weight stays finite whatever the length. None: uncapped.

    Returns:
        tuple[torch.Tensor, dict[str, torch.Tensor]]:

        - weights: (batch, seq), detached, 0 off the response mask; on it 1 where ``mode`` is "none" (the ratio
          with ``decoupled``).
        - metadata, (batch, seq) detached: "ratio" (w_t, or the response's product broadcast over it at level
          "sequence"; outside the mask 1; may be inf there), "truncated" (bool, the cap acted), "masked" (bool,
          the token was rejected: outside the band of "masked"), "capped" (bool, ``behaviour_cap`` zeroed it).

    Raises:
        ValueError: on mismatched shapes, an unknown mode or level, or thresholds that are not 0 < low <= C.
    """
    for name, tensor in (("sampler_log_probs", sampler_log_probs), ("response_mask", response_mask)):
        if tensor.shape != learner_log_probs.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but learner_log_probs {tuple(learner_log_probs.shape)}; "
                "they must match"
            )
    if mode not in IMPORTANCE_CORRECTIONS:
        raise ValueError(f"unknown importance correction {mode!r}; choose one of {list(IMPORTANCE_CORRECTIONS)}")
    if level not in IMPORTANCE_LEVELS:
        raise ValueError(f"unknown importance level {level!r}; choose one of {list(IMPORTANCE_LEVELS)}")
    low = 1.0 / threshold if threshold_low is None and threshold > 0 else threshold_low
    if not (threshold > 0 and low is not None and 0 < low <= threshold):
        raise ValueError(f"importance thresholds must satisfy 0 < low <= C, got low={low}, C={threshold}")

    mask = response_mask.bool()
    log_ratio = (learner_log_probs.detach() - sampler_log_probs.detach()).masked_fill(~mask, 0.0)  # (B, T)
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio).masked_fill(~mask, 0.0)
    ratio = torch.exp(log_ratio)  # may be inf at the sequence level; the comparisons below stay right
    truncated = torch.zeros_like(mask)
    masked = torch.zeros_like(mask)
    capped = torch.zeros_like(mask)
    weights = ratio.clone() if decoupled else torch.ones_like(ratio)
    if decoupled and mode == "none" and behaviour_cap is not None:
        if behaviour_cap <= 0:
            raise ValueError(f"behaviour_cap must be > 0, got {behaviour_cap}")
        capped = mask & (log_ratio > math.log(behaviour_cap))
        weights = torch.exp(log_ratio.masked_fill(capped, 0.0)).masked_fill(capped, 0.0)  # finite: exp(<= log C)
    # The bounds are compared in log space: a subtraction and a comparison, the same on every device, so the
    # learner's count of rejected tokens before the step (learner.optimizer_step_totals) is the train step's.
    if mode == "truncated":
        truncated = mask & (log_ratio > torch.log(torch.tensor(threshold)))
        weights = torch.clamp(ratio, max=threshold)
    elif mode == "masked":
        outside = (log_ratio > torch.log(torch.tensor(threshold))) | (log_ratio < torch.log(torch.tensor(low)))
        masked = mask & outside
        weights = ratio.masked_fill(outside, 0.0)  # inside the band the ratio itself: MIS corrects, never caps
    metadata = {"ratio": ratio, "truncated": truncated, "masked": masked, "capped": capped}
    return weights.masked_fill(~mask, 0.0), metadata
