"""Statistics of the batch the update trains on, whichever way it was assembled (docs/algorithm.md, "Batch-level
statistics").

A batch is scored in pieces on most paths: sync=async's stream scores one group as it ends, a data-parallel rank
its share, dynamic sampling round by round, and on_stale=drop trains groups of several batches together. A
group's statistics (std, mean, rloo) are the same in any piece that holds the group; a batch-level one is not, so
it is taken here, once the trained batch is assembled, over every rank's rows of it (an all_gather over
torch.distributed). The executors call `trained_batch_advantages` where they assemble the batch they train.
The step's rollout metrics are the one batch's the same way: `combine_rollout_metrics` gives pieces' metrics as
their concatenation's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from grpo_cli.batch.rollout_data import RolloutData
from grpo_cli.core import compute_advantages
from grpo_cli.core.advantages import BATCH_LEVEL_NORMALIZATIONS
from grpo_cli.distributed import parallel
from grpo_cli.tasks import REWARD_KEYS


def trained_batch_advantages(data: RolloutData, group_size: int, advantage: str, advantage_eps: float) -> torch.Tensor:
    """This rank's rows' advantages as `compute_advantages` gives them over the whole trained batch: every rank's
    rows in rank order (each rank holds whole groups; `data` is this rank's share, or the batch itself outside a
    process group). Only a batch-level normalization (batch_std) needs the other ranks' rewards; a group's own
    statistics need nothing else, so no collective runs for them. Every rank calls it (a collective under
    batch_std).

    Args:
        data (RolloutData): this rank's rows of the trained batch, whole groups of group_size, prompt-major;
            `data.scored` leaves skipped episodes out of the statistics (compute_advantages' keep).
        group_size (int): G.
        advantage (str): normalization.advantage.
        advantage_eps (float): normalization.advantage_eps.

    Returns:
        torch.Tensor: (len(data.raw_rewards),) float32.
    """
    if advantage not in BATCH_LEVEL_NORMALIZATIONS:
        return compute_advantages(data.raw_rewards, group_size, advantage, advantage_eps, keep=data.scored)
    scored = data.scored if data.scored is not None else torch.ones(len(data.raw_rewards), dtype=torch.bool)
    rewards = parallel.all_gather_tensors(data.raw_rewards)
    kept = torch.cat(parallel.all_gather_tensors(scored.float())) > 0.5
    whole = compute_advantages(torch.cat(rewards), group_size, advantage, advantage_eps, keep=kept)
    start = sum(len(r) for r in rewards[: parallel.world().rank])
    return whole[start : start + len(data.raw_rewards)]


def kept_rewards(data: RolloutData) -> torch.Tensor:
    """The rewards of the rows that have one (a skipped episode has none): what train/reward and train/reward_std
    describe."""
    return data.raw_rewards if data.scored is None else data.raw_rewards[data.scored.bool()]


# Rollout metrics that are means over the rows with a reward (a skipped episode has none: rollout/rewards.py's
# Scores.mean); every other mean is over all rows (or groups, episodes: the same weights, groups being whole).
_MEANS_OVER_SCORED = tuple(f"train/{key}" for key in (*REWARD_KEYS, "unparseable_rate"))


def is_count(key: str) -> bool:
    """Whether a rollout metric is a total (times, tokens, reward errors) that pieces add up to."""
    return key.startswith("time/") or key == "n_tokens" or key.endswith(("reward_errors", "reward_timeouts"))


def split_whole_batch_metrics(metrics: dict[str, float], groups: int) -> list[dict[str, float]]:
    """The metrics of a batch scored whole, for each of its `groups` shipped one at a time (sync.lockstep): its
    statistics on every group, its totals on the first only, so that the groups combine to the batch's metrics."""
    uncounted = {key: 0.0 if is_count(key) else value for key, value in metrics.items()}
    return [dict(metrics)] + [dict(uncounted) for _ in range(groups - 1)]


def combine_rollout_metrics(parts: Sequence[RolloutData]) -> dict[str, float]:
    """The rollout metrics of several scored pieces (a step's dynamic-sampling rounds, sync=async's groups, the
    batches a replay step received) as those of their concatenation, one batch: times, token and error counts add
    up, *_max / *_min are the largest / smallest, means are weighted by the rows they are over, and
    train/reward_std is the std of every piece's rewards together (not a mean of the pieces' spreads). A mean a
    reward function logs (log_metric) or a reward component only some rows have is weighted by rows too: exact
    where each row logs one value."""
    if not parts:
        return {}
    rows = [float(len(p.raw_rewards)) for p in parts]
    with_reward = [float(len(kept_rewards(p))) for p in parts]
    combined = {}
    for key in dict.fromkeys(key for p in parts for key in p.metrics):  # a key some pieces lack: over those with it
        present = [(p.metrics[key], n, m) for p, n, m in zip(parts, rows, with_reward, strict=True) if key in p.metrics]
        values = [value for value, _, _ in present]
        if is_count(key):
            combined[key] = sum(values)
        elif key.endswith("_max"):
            combined[key] = max(values)
        elif key.endswith("_min"):
            combined[key] = min(values)
        else:
            weights = [m if key in _MEANS_OVER_SCORED else n for _, n, m in present]
            total = sum(weights)
            combined[key] = sum(v * w for v, w in zip(values, weights, strict=True)) / total if total else 0.0
    if "train/reward_std" in combined:
        rewards = torch.cat([kept_rewards(p) for p in parts])
        combined["train/reward_std"] = rewards.std().item() if len(rewards) > 1 else 0.0
    return combined
