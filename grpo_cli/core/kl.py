"""Per-token estimators of KL(pi_theta || pi_ref) from the log-probs of sampled tokens (Schulman, 2020)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return -log_ratio


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_ratio) - log_ratio - 1.0


# estimator -> function of log_ratio = log pi_ref - log pi_theta
_KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": _k1, "k3": _k3}

KL_ESTIMATORS: tuple[str, ...] = tuple(_KL_ESTIMATORS)


def compute_kl(
    policy_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    estimator: str = "k3",
) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) on tokens sampled from pi_theta.

    - "k1": ``log pi_theta - log pi_ref``; unbiased, but negative on some tokens.
    - "k3": ``exp(log pi_ref - log pi_theta) - (log pi_ref - log pi_theta) - 1``; unbiased, always >= 0, and
      0 exactly where the two log-probs are equal.

    Args:
        policy_log_probs (torch.Tensor): log-probs under the policy, shape (batch, seq).
        ref_log_probs (torch.Tensor): log-probs under the reference policy, same shape.
        estimator (str): one of ``KL_ESTIMATORS``.

    Returns:
        torch.Tensor: per-token KL estimate, shape (batch, seq); nothing masked.

    Raises:
        ValueError: on an unknown estimator or mismatched shapes.
    """
    if estimator not in _KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {list(KL_ESTIMATORS)}")
    if ref_log_probs.shape != policy_log_probs.shape:
        raise ValueError(
            f"ref_log_probs has shape {tuple(ref_log_probs.shape)} but policy_log_probs "
            f"{tuple(policy_log_probs.shape)}; they must match"
        )
    return _KL_ESTIMATORS[estimator](ref_log_probs - policy_log_probs)  # (B, T)


# How the KL coefficient moves over a run (kl.beta_schedule): held at its start, or from its start at the first
# step to its end at the last along a straight line or a half cosine (slow at both ends).
KL_BETA_SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine")


def scheduled_kl_beta(step: int, total_steps: int, start: float, final: float, schedule: str) -> float:
    """The KL coefficient at step `step` (1: the first) of a run of `total_steps` steps: `start` at the first step
    and `final` at the last, t = (step - 1) / (total_steps - 1) of the way between them (clamped to [0, 1]; a
    one-step run is at its start).

    - "constant": ``start`` at every step.
    - "linear": ``start + (final - start) * t``.
    - "cosine": ``final + (start - final) * (1 + cos(pi * t)) / 2``.

    Raises:
        ValueError: on an unknown schedule or total_steps < 1.
    """
    if schedule not in KL_BETA_SCHEDULES:
        raise ValueError(f"unknown KL schedule {schedule!r}; choose one of {list(KL_BETA_SCHEDULES)}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if schedule == "constant":
        return start
    t = min(max((step - 1) / max(total_steps - 1, 1), 0.0), 1.0)
    if schedule == "linear":
        return start + (final - start) * t
    return final + (start - final) * (1.0 + math.cos(math.pi * t)) / 2.0
