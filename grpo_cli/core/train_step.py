"""One microbatch of a GRPO update: per-token loss (x importance weights) -> aggregation over the optimizer
step's tokens -> (+ KL) -> backward.

`microbatch_train_step` takes the loss's settings as one object (core.LossSettings, built once by the learner) and
hands it whole to the loss; `grpo_microbatch_train_step` is the same step with the handout's keyword arguments,
which become the settings by field name."""

from __future__ import annotations

import torch

from grpo_cli.core.aggregation import LENGTH_NORMALIZATIONS, aggregate_token_loss
from grpo_cli.core.importance import compute_importance_weights
from grpo_cli.core.kl import compute_kl
from grpo_cli.core.loss_settings import LossSettings, settings_from
from grpo_cli.core.losses import policy_gradient_loss
from grpo_cli.core.masking import masked_mean

__all__ = ["LENGTH_NORMALIZATIONS", "LossSettings", "grpo_microbatch_train_step", "microbatch_train_step"]


def _check_inputs(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    length_normalization: str,
    normalize_constant: float | None,
    tensors: dict[str, torch.Tensor | None],
    kl_beta: float,
    importance_correction: str,
) -> None:
    if policy_log_probs.dim() != 2:
        raise ValueError(f"policy_log_probs must be (batch, seq), got shape {tuple(policy_log_probs.shape)}")
    for name, tensor in {"response_mask": response_mask, **tensors}.items():
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
    if kl_beta > 0 and tensors["ref_log_probs"] is None:
        raise ValueError(f"kl_beta={kl_beta} needs ref_log_probs; pass them or set kl_beta=0")
    if importance_correction != "none" and tensors["sampler_log_probs"] is None:
        raise ValueError(
            f"importance_correction={importance_correction!r} needs sampler_log_probs; pass them or use 'none'"
        )


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
    cliprange_high: float | None = None,
    dual_clip: float | None = None,
    step_sequences: float | None = None,
    step_tokens: float | None = None,
    sampler_log_probs: torch.Tensor | None = None,
    importance_correction: str = "none",
    importance_level: str = "token",
    importance_threshold: float = 2.0,
    importance_threshold_low: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Compute the loss of one microbatch and backpropagate it.

    The documented keyword form, for outside callers (the handout's tests, the TRL and verl comparisons): it
    gathers the loss's arguments into a :class:`LossSettings` and calls :func:`microbatch_train_step`, the
    learner's path, which takes that object.

    ``loss = agg(w * policy loss) + kl_beta * mean_i masked_mean_i(KL)``, where ``w`` are the sampler/learner
    importance weights (1 without a correction) and ``agg`` is :func:`aggregate_token_loss` with
    ``length_normalization``:

    - "sequence_mean": masked mean over each response's tokens, then mean over responses (GRPO).
    - "constant": masked sum divided by ``normalize_constant``, then mean over responses (Dr. GRPO).
    - "token_mean": masked sum over every token divided by the number of tokens (DAPO).

    How the microbatch's loss relates to the optimizer step's: by default each microbatch is normalized by
    its own counts and the loss divided by ``gradient_accumulation_steps`` (exact when the microbatches are
    equal; the handout's rule). Given ``step_sequences`` (and, for "token_mean", ``step_tokens``): the
    microbatch's loss is its exact share of the whole step's loss (its sums divided by the step's totals, no
    division by ``gradient_accumulation_steps``), so microbatches of any sizes add up to the one-big-batch
    loss. Under data parallelism whose gradients are averaged over R ranks (DDP, FSDP), pass the totals over
    all ranks divided by R.

    With ``importance_correction="masked"`` a rejected token (outside the band) leaves the loss's sums and its
    response's and this microbatch's token counts: it does not count as a 0. An example whose response mask is
    empty, or all rejected, contributes 0 (not nan) and still counts among the responses.

    Args:
        policy_log_probs (torch.Tensor): log-probs of the sampled tokens under the policy, (batch, seq), with
            grad.
        response_mask (torch.Tensor): (batch, seq), bool or float, 1 on response tokens.
        gradient_accumulation_steps (int): microbatches per optimizer step (the divisor without step totals).
        loss_type (str): one of ``POLICY_GRADIENT_LOSS_TYPES``; see :func:`compute_policy_gradient_loss`.
        raw_rewards (torch.Tensor | None): (batch, 1), for "no_baseline".
        advantages (torch.Tensor | None): (batch, 1), for every other loss.
        old_log_probs (torch.Tensor | None): (batch, seq), for the ratio losses.
        cliprange (float | None): eps (eps_low), for "grpo_clip" and "gspo".
        length_normalization (str): one of ``LENGTH_NORMALIZATIONS``.
        normalize_constant (float | None): the divisor for "constant", e.g. the maximum generation length.
        ref_log_probs (torch.Tensor | None): (batch, seq) log-probs under the reference policy; when given the
            KL is measured (and logged) even with ``kl_beta == 0``.
        kl_beta (float): weight of the KL penalty; > 0 needs ``ref_log_probs``.
        kl_estimator (str): "k1" or "k3"; see :func:`compute_kl`.
        cliprange_high (float | None): eps_high (clip-higher; CISPO's cap); None: symmetric.
        dual_clip (float | None): dual-clip constant c > 1 for "grpo_clip"; None: off.
        step_sequences (float | None): responses in the whole optimizer step (see above).
        step_tokens (float | None): response tokens (of ``response_mask``) in the whole optimizer step; less
            the ones ``importance_correction="masked"`` rejects when the caller knows them before the step.
        sampler_log_probs (torch.Tensor | None): (batch, seq) the sampled tokens' log-probs under the rollout
            engine's sampling distribution; given, the sampler/learner mismatch is measured.
        importance_correction (str): one of ``IMPORTANCE_CORRECTIONS``; see
            :func:`compute_importance_weights` (the learner's side is ``old_log_probs`` when given, else the
            current log-probs, detached).
        importance_level (str): "token" or "sequence".
        importance_threshold (float): C, the cap / upper bound.
        importance_threshold_low (float | None): the lower bound of "masked"; None: 1 / C.

    Returns:
        tuple[torch.Tensor, dict[str, torch.Tensor]]:

        - loss: the microbatch's contribution to the step's loss (what was backpropagated), 0-d, detached.
        - metadata, 0-d detached tensors: "policy_loss" (this microbatch's own policy loss, normalized by its
          own counts, without KL); "kl" when ``ref_log_probs`` is given (mean over the examples with a non-empty
          mask of the per-response masked mean; nan when every mask is empty); for the ratio losses
          "clip_fraction" (+ "clip_fraction_low", "clip_fraction_high", "clip_fraction_dual" when dual-clip is
          on) and "ratio_mean" (masked means over the response tokens); with ``sampler_log_probs``
          "sampler_kl" (k3 estimate of KL(sampler || learner)), "importance_weight_mean",
          "importance_weight_max" (token ratios pi_learner / pi_sampler before any truncation),
          "importance_truncated_frac", "importance_masked_frac" (fractions of response tokens); decoupled with
          no correction "behaviour_capped_frac" (tokens whose weight ``behaviour_weight_cap`` zeroed).

    Raises:
        ValueError: on mismatched shapes, an unknown ``length_normalization``, a missing
            ``normalize_constant``, ``ref_log_probs`` or ``sampler_log_probs``, or a bad loss configuration.
    """
    # Every keyword named like a LossSettings field goes into the settings (a new field needs no edit here).
    settings = settings_from(loss_type, locals())
    return microbatch_train_step(
        policy_log_probs,
        response_mask,
        gradient_accumulation_steps,
        settings,
        raw_rewards=raw_rewards,
        advantages=advantages,
        old_log_probs=old_log_probs,
        ref_log_probs=ref_log_probs,
        sampler_log_probs=sampler_log_probs,
        step_sequences=step_sequences,
        step_tokens=step_tokens,
    )


def microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    settings: LossSettings,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    sampler_log_probs: torch.Tensor | None = None,
    step_sequences: float | None = None,
    step_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """grpo_microbatch_train_step with the loss's settings as one object (the learner's path): the tensors of
    one microbatch, the optimizer step's totals, and `settings` for everything the loss is configured by.
    Same arguments, returns and errors as grpo_microbatch_train_step."""
    _check_inputs(
        policy_log_probs,
        response_mask,
        gradient_accumulation_steps,
        settings.length_normalization,
        settings.normalize_constant,
        {"old_log_probs": old_log_probs, "ref_log_probs": ref_log_probs, "sampler_log_probs": sampler_log_probs},
        settings.kl_beta,
        settings.importance_correction,
    )
    per_token_loss, loss_metadata = policy_gradient_loss(
        settings, policy_log_probs, response_mask, raw_rewards, advantages, old_log_probs
    )  # (B, T)

    metadata: dict[str, torch.Tensor] = {}
    loss_mask = response_mask  # the tokens the policy loss's sums and counts run over
    if sampler_log_probs is not None:
        learner_log_probs = (old_log_probs if old_log_probs is not None else policy_log_probs).detach()
        weights, importance = compute_importance_weights(
            learner_log_probs,
            sampler_log_probs,
            response_mask,
            settings.importance_correction,
            settings.importance_level,
            settings.importance_threshold,
            settings.importance_threshold_low,
            decoupled=settings.decoupled,
            behaviour_cap=settings.behaviour_weight_cap,
        )
        per_token_loss = per_token_loss * weights
        if settings.importance_correction == "masked":
            # A rejected token leaves the loss's counts (its response's token count, this microbatch's own token
            # count) instead of adding 0 to them, as verl's and slime's rejection masks do. The step's totals are
            # the caller's: the learner leaves rejected tokens out of step_tokens when old log-probs fix the
            # rejection before the step (learner.accounting.optimizer_step_totals; docs/algorithm.md).
            loss_mask = response_mask.bool() & ~importance["masked"]
        token_ratio = torch.exp(learner_log_probs - sampler_log_probs)  # (B, T), the mismatch itself
        mask = response_mask.bool()
        metadata["sampler_kl"] = masked_mean(compute_kl(sampler_log_probs, learner_log_probs, "k3"), mask)
        metadata["importance_weight_mean"] = masked_mean(token_ratio, mask)
        metadata["importance_weight_max"] = token_ratio[mask].max() if mask.any() else token_ratio.new_ones(())
        metadata["importance_truncated_frac"] = masked_mean(importance["truncated"].float(), mask)
        metadata["importance_masked_frac"] = masked_mean(importance["masked"].float(), mask)
        if settings.decoupled and settings.importance_correction == "none":
            metadata["behaviour_capped_frac"] = masked_mean(importance["capped"].float(), mask)

    exact_share = step_sequences is not None or step_tokens is not None
    if exact_share and (step_sequences is None or step_tokens is None):
        raise ValueError(
            f"pass both step_sequences and step_tokens (the optimizer step's totals), got {step_sequences} and "
            f"{step_tokens}"
        )
    loss = aggregate_token_loss(
        per_token_loss,
        loss_mask,
        settings.length_normalization,
        settings.normalize_constant,
        total_sequences=step_sequences,
        total_tokens=step_tokens,
    )
    policy_loss = (
        aggregate_token_loss(per_token_loss, loss_mask, settings.length_normalization, settings.normalize_constant)
        if exact_share
        else loss
    )
    metadata["policy_loss"] = policy_loss.detach()
    if ref_log_probs is not None:
        # With beta == 0 the KL is only monitored: keep it out of the graph.
        with torch.set_grad_enabled(settings.kl_beta > 0 and torch.is_grad_enabled()):
            per_token_kl = compute_kl(policy_log_probs, ref_log_probs, settings.kl_estimator)  # (B, T)
            if settings.kl_beta > 0:
                kl_share = aggregate_token_loss(
                    per_token_kl, response_mask, "sequence_mean", total_sequences=step_sequences
                )
                loss = loss + settings.kl_beta * kl_share
        # The logged KL: the mean over the responses in the loss of each one's token mean. A response whose mask
        # is empty (left out by train.mask_truncated) has no KL in the loss and does not dilute it; nan when none
        # is left (the caller skips it).
        in_loss = response_mask.sum(dim=-1) > 0  # (B,)
        metadata["kl"] = masked_mean(per_token_kl.detach()[in_loss], response_mask[in_loss], dim=-1).mean()

    for key in ("clipped", "clipped_low", "clipped_high", "clipped_dual"):
        if key in loss_metadata:
            name = "clip_fraction" + key.removeprefix("clipped")
            metadata[name] = masked_mean(loss_metadata[key].float(), response_mask)
    if "ratio" in loss_metadata:
        metadata["ratio_mean"] = masked_mean(loss_metadata["ratio"], response_mask)

    scaled_loss = loss if exact_share else loss / gradient_accumulation_steps
    scaled_loss.backward()
    return scaled_loss.detach(), metadata
