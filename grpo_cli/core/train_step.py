"""One microbatch of a GRPO update: per-token loss -> per-example aggregation -> batch mean -> backward."""

from __future__ import annotations

import torch

from grpo_cli.core.kl import compute_kl
from grpo_cli.core.losses import compute_policy_gradient_loss
from grpo_cli.core.masking import masked_mean, masked_normalize

LENGTH_NORMALIZATIONS: tuple[str, ...] = ("sequence_mean", "constant")


def _per_example_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean over each row's tokens, (B, T) -> (B,); an empty row gives 0 rather than nan.

    Same as ``masked_mean(values, mask, dim=-1)`` on non-empty rows. An empty response (a row of zeros in the
    mask) would otherwise make 0 / 0 and turn every gradient of the microbatch into nan.
    """
    mask = mask.to(values.dtype)
    return (values * mask).sum(dim=-1) / mask.sum(dim=-1).clamp_min(1.0)


def _check_inputs(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    length_normalization: str,
    normalize_constant: float | None,
    old_log_probs: torch.Tensor | None,
    ref_log_probs: torch.Tensor | None,
    kl_beta: float,
) -> None:
    if policy_log_probs.dim() != 2:
        raise ValueError(f"policy_log_probs must be (batch, seq), got shape {tuple(policy_log_probs.shape)}")
    for name, tensor in (
        ("response_mask", response_mask),
        ("old_log_probs", old_log_probs),
        ("ref_log_probs", ref_log_probs),
    ):
        if tensor is not None and tensor.shape != policy_log_probs.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but policy_log_probs "
                f"{tuple(policy_log_probs.shape)}; they must match"
            )
    if gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")
    if length_normalization not in LENGTH_NORMALIZATIONS:
        raise ValueError(
            f"unknown length_normalization {length_normalization!r}; choose one of {list(LENGTH_NORMALIZATIONS)}"
        )
    if length_normalization == "constant" and (normalize_constant is None or normalize_constant <= 0):
        raise ValueError(
            f"length_normalization 'constant' needs a positive normalize_constant (e.g. the maximum "
            f"generation length), got {normalize_constant}"
        )
    if kl_beta < 0:
        raise ValueError(f"kl_beta must be >= 0, got {kl_beta}")
    if kl_beta > 0 and ref_log_probs is None:
        raise ValueError(f"kl_beta={kl_beta} needs ref_log_probs; pass them or set kl_beta=0")


def grpo_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    loss_type: str,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
    length_normalization: str = "sequence_mean",
    normalize_constant: float | None = None,
    ref_log_probs: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    kl_estimator: str = "k3",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Compute the loss of one microbatch and backpropagate it.

    ``loss = (mean_i agg_i(policy loss) + kl_beta * mean_i masked_mean_i(KL)) / gradient_accumulation_steps``,
    where ``agg_i`` aggregates example i's response tokens:

    - "sequence_mean": masked mean over the response's tokens (GRPO).
    - "constant": masked sum divided by ``normalize_constant`` (Dr. GRPO).

    An example whose response mask is empty contributes 0 (not nan).

    Args:
        policy_log_probs (torch.Tensor): log-probs of the sampled tokens under the policy, (batch, seq), with
            grad.
        response_mask (torch.Tensor): (batch, seq), bool or float, 1 on response tokens.
        gradient_accumulation_steps (int): microbatches per optimizer step; the loss is divided by it so the
            accumulated gradient is the mean over the train batch.
        loss_type (str): "no_baseline", "reinforce_with_baseline" or "grpo_clip"; see
            :func:`compute_policy_gradient_loss`.
        raw_rewards (torch.Tensor | None): (batch, 1), for "no_baseline".
        advantages (torch.Tensor | None): (batch, 1), for "reinforce_with_baseline" and "grpo_clip".
        old_log_probs (torch.Tensor | None): (batch, seq), for "grpo_clip".
        cliprange (float | None): eps, for "grpo_clip".
        length_normalization (str): one of ``LENGTH_NORMALIZATIONS``.
        normalize_constant (float | None): the divisor for "constant", e.g. the maximum generation length.
        ref_log_probs (torch.Tensor | None): (batch, seq) log-probs under the reference policy; when given the
            KL is measured (and logged) even with ``kl_beta == 0``.
        kl_beta (float): weight of the KL penalty; > 0 needs ``ref_log_probs``.
        kl_estimator (str): "k1" or "k3"; see :func:`compute_kl`.

    Returns:
        tuple[torch.Tensor, dict[str, torch.Tensor]]:

        - loss: the scaled microbatch loss (divided by ``gradient_accumulation_steps``), 0-d, detached.
        - metadata, 0-d detached tensors: "policy_loss" (unscaled, without KL); "kl" when ``ref_log_probs``
          is given (mean over examples of the per-response masked mean); "clip_fraction" and "ratio_mean"
          for "grpo_clip" (masked means over all response tokens of the microbatch).

    Raises:
        ValueError: on mismatched shapes, an unknown ``length_normalization``, a missing
            ``normalize_constant`` or ``ref_log_probs``, or a bad loss configuration.
    """
    _check_inputs(
        policy_log_probs,
        response_mask,
        gradient_accumulation_steps,
        length_normalization,
        normalize_constant,
        old_log_probs,
        ref_log_probs,
        kl_beta,
    )
    per_token_loss, loss_metadata = compute_policy_gradient_loss(
        policy_log_probs,
        loss_type,
        raw_rewards=raw_rewards,
        advantages=advantages,
        old_log_probs=old_log_probs,
        cliprange=cliprange,
    )  # (B, T)

    if length_normalization == "sequence_mean":
        per_example_loss = _per_example_mean(per_token_loss, response_mask)  # (B,)
    else:
        per_example_loss = masked_normalize(per_token_loss, response_mask, normalize_constant, dim=-1)  # (B,)
    policy_loss = per_example_loss.mean()
    loss = policy_loss

    metadata: dict[str, torch.Tensor] = {"policy_loss": policy_loss.detach()}
    if ref_log_probs is not None:
        # With beta == 0 the KL is only monitored: keep it out of the graph.
        with torch.set_grad_enabled(kl_beta > 0 and torch.is_grad_enabled()):
            per_token_kl = compute_kl(policy_log_probs, ref_log_probs, kl_estimator)  # (B, T)
            kl = _per_example_mean(per_token_kl, response_mask).mean()
        if kl_beta > 0:
            loss = loss + kl_beta * kl
        metadata["kl"] = kl.detach()

    if "clipped" in loss_metadata:
        metadata["clip_fraction"] = masked_mean(loss_metadata["clipped"].float(), response_mask)
    if "ratio" in loss_metadata:
        metadata["ratio_mean"] = masked_mean(loss_metadata["ratio"], response_mask)

    scaled_loss = loss / gradient_accumulation_steps
    scaled_loss.backward()
    return scaled_loss.detach(), metadata
