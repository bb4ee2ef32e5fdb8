"""Group-relative advantages: each response's reward compared with the other responses to the same prompt.

The rollout batch is laid out group by group: responses ``[k * G, (k + 1) * G)`` answer the k-th prompt.
``ADVANTAGE_NORMALIZATIONS`` names the estimators (``normalization.advantage``); :func:`compute_advantages`
computes any of them, :func:`normalize_group_rewards` is the handout's two (std / mean).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

RewardFn = Callable[[str, str], dict[str, float]]

_REWARD_KEYS = ("reward", "format_reward", "answer_reward")

# std: GRPO (DeepSeekMath) | mean: Dr. GRPO | rloo: leave-one-out baseline (Kool et al. 2019; Ahmadian et al.
# 2024) | batch_std: group mean, std over the whole batch (TRL's scale_rewards="batch", Hu et al. 2025's
# REINFORCE++ baseline idea).
ADVANTAGE_NORMALIZATIONS: tuple[str, ...] = ("std", "mean", "rloo", "batch_std")
# The normalizations with a statistic of the whole batch (the others' are each group's own): computed over the batch
# the update trains on, every rank's rows (rollout/batch_statistics.py), never over a piece of it.
BATCH_LEVEL_NORMALIZATIONS: tuple[str, ...] = ("batch_std",)


def _check_group_size(batch_size: int, group_size: int, normalize_by_std: bool) -> None:
    if group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {group_size}")
    if batch_size == 0:
        raise ValueError("got an empty rollout batch; pass at least one group of rewards")
    if batch_size % group_size != 0:
        raise ValueError(
            f"the rollout batch has {batch_size} rewards, not a multiple of group_size={group_size}; "
            "make rollout_batch_size a multiple of group_size"
        )
    if normalize_by_std and group_size < 2:
        raise ValueError(
            "normalize_by_std needs group_size >= 2 (the std of a single reward is undefined); "
            "raise group_size or set normalize_by_std=false"
        )


def normalize_group_rewards(
    raw_rewards: torch.Tensor,
    group_size: int,
    advantage_eps: float,
    normalize_by_std: bool,
) -> torch.Tensor:
    """Turn raw rewards into group-normalized advantages.

    Per group of G rewards r: ``A_i = (r_i - mean(r)) / (std(r) + advantage_eps)`` when ``normalize_by_std``
    (GRPO; std is Bessel-corrected ``torch.std``), else ``A_i = r_i - mean(r)`` (Dr. GRPO).

    Args:
        raw_rewards (torch.Tensor): shape (rollout_batch_size,), grouped contiguously by prompt.
        group_size (int): G, responses per prompt.
        advantage_eps (float): added to the std to avoid dividing by zero when a group's rewards are equal.
        normalize_by_std (bool): divide by the group std (True) or only subtract the group mean (False).

    Returns:
        torch.Tensor: advantages, shape (rollout_batch_size,), float (float32 for integer or bool rewards).

    Raises:
        ValueError: if ``raw_rewards`` is not 1-D or empty, its length is not a multiple of ``group_size``, or
            ``normalize_by_std`` is set with ``group_size < 2``.
    """
    if raw_rewards.dim() != 1:
        raise ValueError(f"raw_rewards must be (rollout_batch_size,), got shape {tuple(raw_rewards.shape)}")
    _check_group_size(raw_rewards.numel(), group_size, normalize_by_std)
    if not raw_rewards.is_floating_point():
        raw_rewards = raw_rewards.float()

    grouped = raw_rewards.reshape(-1, group_size)  # (n_prompts, G)
    # A group whose rewards are all equal gets exactly 0, not the rounding error of its mean: seven rewards of 0.7
    # average to 0.7 less one float32 ulp, which the std's eps (the std is 0) turned into advantages of +-0.056,
    # trained on as if they were signal (and never skipped as loss weight 0: batch/plan.py).
    flat = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)  # (n_prompts, 1)
    advantages = torch.where(flat, 0.0, grouped - grouped.mean(dim=1, keepdim=True))  # (n_prompts, G)
    if normalize_by_std:
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + advantage_eps)
    return advantages.reshape(-1)  # (rollout_batch_size,)


def compute_advantages(
    raw_rewards: torch.Tensor,
    group_size: int,
    mode: str,
    advantage_eps: float = 1e-6,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages of one rollout batch by any of ``ADVANTAGE_NORMALIZATIONS``.

    Per group of G rewards r (mean and std over the group, std Bessel-corrected as ``torch.std``):

    - "std":       ``A_i = (r_i - mean(r)) / (std(r) + eps)``
    - "mean":      ``A_i = r_i - mean(r)``
    - "rloo":      ``A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean(r))`` (the baseline leaves the
      response itself out, so it is independent of it: an unbiased REINFORCE estimator)
    - "batch_std": ``A_i = (r_i - mean(r)) / (std(R) + eps)`` with R every reward of the batch (one scale for
      all groups, so a group whose rewards barely differ is not blown up to unit variance)

    A group whose rewards are all equal gets advantages 0 under every mode.

    ``keep`` leaves responses out (an episode skipped under task.on_reward_error=skip has no reward): each group's
    statistics are those of its kept responses alone, as if the group held only them (G their number; a group with
    fewer than 2 kept has no comparison and gets 0), batch_std's std is over every kept reward, and a response left
    out gets advantage 0.

    Args:
        raw_rewards (torch.Tensor): (rollout_batch_size,), grouped contiguously by prompt.
        group_size (int): G.
        mode (str): one of ``ADVANTAGE_NORMALIZATIONS``.
        advantage_eps (float): added to the std of "std" and "batch_std".
        keep (torch.Tensor | None): (rollout_batch_size,) bool, the responses in the statistics; None: all.

    Returns:
        torch.Tensor: (rollout_batch_size,), float.

    Raises:
        ValueError: on an unknown mode, a bad shape, or G < 2 for "std" and "rloo".
    """
    if mode not in ADVANTAGE_NORMALIZATIONS:
        raise ValueError(f"unknown advantage normalization {mode!r}; choose one of {list(ADVANTAGE_NORMALIZATIONS)}")
    if keep is not None and not bool(keep.all()):
        return _kept_advantages(raw_rewards, group_size, mode, advantage_eps, keep)
    if mode in ("std", "mean"):
        return normalize_group_rewards(raw_rewards, group_size, advantage_eps, normalize_by_std=mode == "std")
    if raw_rewards.dim() != 1:
        raise ValueError(f"raw_rewards must be (rollout_batch_size,), got shape {tuple(raw_rewards.shape)}")
    _check_group_size(raw_rewards.numel(), group_size, normalize_by_std=False)
    if mode == "rloo" and group_size < 2:
        raise ValueError("rloo needs group_size >= 2 (a leave-one-out baseline needs another response)")
    if not raw_rewards.is_floating_point():
        raw_rewards = raw_rewards.float()
    centered = normalize_group_rewards(raw_rewards, group_size, advantage_eps, normalize_by_std=False)
    if mode == "rloo":
        return centered * (group_size / (group_size - 1))
    batch_std = raw_rewards.std() if raw_rewards.numel() > 1 else raw_rewards.new_zeros(())
    return centered / (batch_std + advantage_eps)


def _kept_advantages(
    raw_rewards: torch.Tensor, group_size: int, mode: str, advantage_eps: float, keep: torch.Tensor
) -> torch.Tensor:
    """compute_advantages over the kept responses only (its docstring): each group as a group of its kept ones."""
    if raw_rewards.dim() != 1 or keep.shape != raw_rewards.shape:
        raise ValueError(
            f"raw_rewards and keep must both be (rollout_batch_size,), got {tuple(raw_rewards.shape)} "
            f"and {tuple(keep.shape)}"
        )
    _check_group_size(raw_rewards.numel(), group_size, normalize_by_std=False)
    rewards = raw_rewards.float() if not raw_rewards.is_floating_point() else raw_rewards
    keep = keep.bool()
    advantages = torch.zeros_like(rewards)
    per_group_mode = "mean" if mode == "batch_std" else mode
    for start in range(0, rewards.numel(), group_size):
        kept = torch.nonzero(keep[start : start + group_size]).flatten() + start  # (m,)
        if kept.numel() >= 2:
            advantages[kept] = compute_advantages(rewards[kept], kept.numel(), per_group_mode, advantage_eps)
    if mode == "batch_std":
        kept_rewards = rewards[keep]
        scale = kept_rewards.std() if kept_rewards.numel() > 1 else kept_rewards.new_zeros(())
        advantages = advantages / (scale + advantage_eps)
    return advantages


def fraction_of_zero_std_groups(raw_rewards: torch.Tensor, group_size: int, keep: torch.Tensor | None = None) -> float:
    """Fraction of groups whose rewards are all equal (their advantages are all 0: no learning signal).

    Args:
        raw_rewards (torch.Tensor): shape (rollout_batch_size,), grouped contiguously by prompt.
        group_size (int): G, responses per prompt; must divide the batch size.
        keep (torch.Tensor | None): (rollout_batch_size,) bool, the responses compared (compute_advantages'
            keep); a group with fewer than 2 kept has no signal. None: all.

    Returns:
        float: in [0, 1].
    """
    _check_group_size(raw_rewards.numel(), group_size, normalize_by_std=False)
    grouped = raw_rewards.reshape(-1, group_size)  # (n_prompts, G)
    if keep is None:
        all_equal = grouped.amax(dim=1) == grouped.amin(dim=1)  # (n_prompts,)
    else:
        kept = keep.bool().reshape(-1, group_size)  # (n_prompts, G)
        highest = grouped.float().masked_fill(~kept, float("-inf")).amax(dim=1)
        lowest = grouped.float().masked_fill(~kept, float("inf")).amin(dim=1)
        all_equal = (kept.sum(dim=1) < 2) | (highest == lowest)
    return all_equal.float().mean().item()


def compute_group_normalized_rewards(
    reward_fn: RewardFn,
    rollout_responses: Sequence[str],
    repeated_ground_truths: Sequence[str],
    group_size: int,
    advantage_eps: float,
    normalize_by_std: bool,
    advantage_normalization: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Score every response and normalize its reward within its group.

    Args:
        reward_fn (Callable[[str, str], dict[str, float]]): ``reward_fn(response, ground_truth)`` returning a
            dict with "reward", "format_reward" and "answer_reward".
        rollout_responses (Sequence[str]): the policy's responses, length rollout_batch_size, grouped
            contiguously by prompt (G responses per prompt).
        repeated_ground_truths (Sequence[str]): the ground truth of each response's prompt, each repeated G
            times, same length as ``rollout_responses``.
        group_size (int): G, responses per prompt.
        advantage_eps (float): added to the group std to avoid dividing by zero.
        normalize_by_std (bool): divide by the group std (GRPO) or only subtract the group mean (Dr. GRPO).
        advantage_normalization (str | None): any of ``ADVANTAGE_NORMALIZATIONS`` (see
            :func:`compute_advantages`); given, it decides instead of ``normalize_by_std``.

    Returns:
        tuple[torch.Tensor, torch.Tensor, dict[str, float]]:

        - advantages: (rollout_batch_size,) float32, see :func:`compute_advantages`.
        - raw_rewards: (rollout_batch_size,) float32, the "reward" of each response.
        - metadata: "reward_mean", "reward_std" (Bessel-corrected over the batch, 0 for a single response),
          "reward_max", "reward_min", "format_reward_mean", "answer_reward_mean", "frac_zero_std_groups".

    Raises:
        ValueError: if the two sequences differ in length, the length is not a multiple of ``group_size``,
            ``normalize_by_std`` is set with ``group_size < 2``, or ``reward_fn`` omits one of its keys.
    """
    if len(rollout_responses) != len(repeated_ground_truths):
        raise ValueError(
            f"got {len(rollout_responses)} responses but {len(repeated_ground_truths)} ground truths; "
            "repeat each prompt's ground truth group_size times"
        )
    mode = advantage_normalization or ("std" if normalize_by_std else "mean")
    _check_group_size(len(rollout_responses), group_size, mode == "std")

    scores = []
    for response, ground_truth in zip(rollout_responses, repeated_ground_truths, strict=True):
        score = reward_fn(response, ground_truth)
        missing = [key for key in _REWARD_KEYS if key not in score]
        if missing:
            raise ValueError(
                f"reward_fn returned keys {sorted(score)}, missing {missing}; it must return a dict with "
                f"{list(_REWARD_KEYS)}"
            )
        scores.append([float(score[key]) for key in _REWARD_KEYS])
    # (N, 3) -> (3, N), made contiguous so each row below is a plain (N,) tensor
    rewards, format_rewards, answer_rewards = torch.tensor(scores, dtype=torch.float32).T.contiguous()

    advantages = compute_advantages(rewards, group_size, mode, advantage_eps)
    metadata = {
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
        "reward_max": rewards.max().item(),
        "reward_min": rewards.min().item(),
        "format_reward_mean": format_rewards.mean().item(),
        "answer_reward_mean": answer_rewards.mean().item(),
        "frac_zero_std_groups": fraction_of_zero_std_groups(rewards, group_size),
    }
    return advantages, rewards, metadata
