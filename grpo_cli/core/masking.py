"""Masked reductions: the two ways a per-token quantity is summarised over response tokens."""

from __future__ import annotations

import torch


def masked_mean(tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Average ``tensor`` over the positions where ``mask`` is set.

    Computes ``sum(tensor * mask, dim) / sum(mask, dim)``. Where the mask is empty along ``dim`` the result is
    nan (0 / 0), as the formula says; callers that can meet empty responses guard against it themselves.

    Args:
        tensor (torch.Tensor): values to average, any shape.
        mask (torch.Tensor): same shape as ``tensor`` (or broadcastable to it), bool or float; 1/True marks
            the positions to include.
        dim (int | None): dimension to reduce; ``None`` reduces over every element.

    Returns:
        torch.Tensor: the masked mean, a 0-d tensor when ``dim`` is None, otherwise ``tensor``'s shape
        without ``dim``.
    """
    mask = mask.to(tensor.dtype)
    if dim is None:
        return (tensor * mask).sum() / mask.sum()
    return (tensor * mask).sum(dim=dim) / mask.sum(dim=dim)


def masked_normalize(
    tensor: torch.Tensor,
    mask: torch.Tensor,
    normalize_constant: float,
    dim: int | None = None,
) -> torch.Tensor:
    """Sum ``tensor`` over the positions where ``mask`` is set and divide by a fixed constant.

    Computes ``sum(tensor * mask, dim) / normalize_constant``. Unlike :func:`masked_mean` the divisor does not
    depend on how many positions are set, so every token weighs the same whatever its response's length
    (Dr. GRPO's length normalization).

    Args:
        tensor (torch.Tensor): values to sum, any shape.
        mask (torch.Tensor): same shape as ``tensor`` (or broadcastable to it), bool or float.
        normalize_constant (float): the divisor, e.g. the maximum generation length.
        dim (int | None): dimension to reduce; ``None`` reduces over every element.

    Returns:
        torch.Tensor: the normalized sum, a 0-d tensor when ``dim`` is None, otherwise ``tensor``'s shape
        without ``dim``.
    """
    mask = mask.to(tensor.dtype)
    if dim is None:
        return (tensor * mask).sum() / normalize_constant
    return (tensor * mask).sum(dim=dim) / normalize_constant
