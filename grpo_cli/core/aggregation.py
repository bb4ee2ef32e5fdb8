"""Loss aggregation: how a (batch, seq) per-token loss becomes the one number an optimizer step minimizes.

Three modes (``normalization.length``), each a weighting of the response tokens of the optimizer step:

- "sequence_mean" (GRPO, DeepSeekMath): each response's masked token mean, then the mean over responses.
  A token of a short response weighs more than a token of a long one.
- "constant" (Dr. GRPO, Liu et al. 2025): each response's masked token sum divided by a fixed constant
  (the maximum generation length), then the mean over responses: every token weighs the same.
- "token_mean" (DAPO, Yu et al. 2025; verl's "token-mean"): the masked sum over every response token of the
  step divided by their number: every token of the optimizer step counts once, whichever response and
  microbatch it is in.

An optimizer step usually spans several microbatches (gradient accumulation) and ranks (data parallel). The
step's loss is a sum of per-microbatch shares when each share is divided by the step's totals, not the
microbatch's own: pass ``total_sequences`` / ``total_tokens`` (the whole step's count of responses / response
tokens) and the shares of all microbatches add up to exactly the one-big-batch loss. Without them a microbatch
is normalized by its own counts (the loss of that microbatch alone).
"""

from __future__ import annotations

import torch

LENGTH_NORMALIZATIONS: tuple[str, ...] = ("sequence_mean", "constant", "token_mean")


def aggregate_token_loss(
    per_token_loss: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    normalize_constant: float | None = None,
    total_sequences: float | None = None,
    total_tokens: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar with one of ``LENGTH_NORMALIZATIONS``.

    With B rows, mask m, loss l:

    - "sequence_mean": ``sum_i (sum_t l_it m_it / max(1, sum_t m_it)) / N_seq``
    - "constant":      ``sum_i (sum_t l_it m_it / normalize_constant) / N_seq``
    - "token_mean":    ``sum_i sum_t l_it m_it / N_tok``

    where ``N_seq = total_sequences`` (default B) and ``N_tok = total_tokens`` (default ``sum(m)``, at least 1).
    An empty response adds 0, never nan.

    Args:
        per_token_loss (torch.Tensor): (batch, seq).
        response_mask (torch.Tensor): (batch, seq), bool or float; 1 on the tokens that count.
        mode (str): one of ``LENGTH_NORMALIZATIONS``.
        normalize_constant (float | None): the divisor of "constant" (> 0), e.g. the maximum generation length.
        total_sequences (float | None): responses in the whole optimizer step, for this batch's share of it.
        total_tokens (float | None): response tokens in the whole optimizer step, for "token_mean"'s share.

    Returns:
        torch.Tensor: 0-d, differentiable in ``per_token_loss``.

    Raises:
        ValueError: on mismatched shapes, an unknown mode, or a missing / non-positive constant or total.
    """
    if per_token_loss.shape != response_mask.shape:
        raise ValueError(
            f"response_mask has shape {tuple(response_mask.shape)} but per_token_loss "
            f"{tuple(per_token_loss.shape)}; they must match"
        )
    if mode not in LENGTH_NORMALIZATIONS:
        raise ValueError(f"unknown length_normalization {mode!r}; choose one of {list(LENGTH_NORMALIZATIONS)}")
    for name, total in (("total_sequences", total_sequences), ("total_tokens", total_tokens)):
        if total is not None and not total > 0:
            raise ValueError(f"{name} must be > 0 (the optimizer step's count), got {total}")
    mask = response_mask.to(per_token_loss.dtype)
    masked = per_token_loss * mask  # (B, T)
    if mode == "token_mean":
        divisor = total_tokens if total_tokens is not None else mask.sum().clamp_min(1.0)
        return masked.sum() / divisor
    if mode == "sequence_mean":
        per_sequence = masked.sum(dim=-1) / mask.sum(dim=-1).clamp_min(1.0)  # (B,)
    else:
        if normalize_constant is None or normalize_constant <= 0:
            raise ValueError(
                f"length_normalization 'constant' needs a positive normalize_constant (e.g. the maximum "
                f"generation length), got {normalize_constant}"
            )
        per_sequence = masked.sum(dim=-1) / normalize_constant  # (B,)
    sequences = total_sequences if total_sequences is not None else per_token_loss.shape[0]
    return per_sequence.sum() / sequences
