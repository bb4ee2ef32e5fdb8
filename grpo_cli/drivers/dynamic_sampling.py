"""DAPO's dynamic sampling (Yu et al. 2025): keep only groups with a learning signal, sample more until the step's
batch is full of them.

A group whose G rewards are all equal has advantages 0 under every normalization: it adds nothing to the policy
gradient, but it still dilutes the batch (and its tokens the token_mean denominator). With
`train.dynamic_sampling=true` such groups are dropped and the executor samples another batch of prompts, at most
`train.dynamic_sampling_max_extra_rounds` times; the step then trains on the groups with signal it has (fewer
than a full batch only when the rounds ran out), and says so in its metrics:

    train/groups_dropped   groups with all-equal rewards dropped this step (every round)
    train/extra_rounds     generation rounds beyond the first
    train/groups_trained   groups the update trained on
    train/groups_short     groups missing from a full batch (0 when the rounds filled it)
    train/reward           the mean reward of the batch the update trains on (train/reward_std its spread)
    train/reward_all_sampled  the mean over every completion sampled this step, dropped groups included

Advantages are recomputed over the assembled batch, every rank's share of it (rollout/batch_statistics.py: only
batch_std depends on more than the group itself).
Pure bookkeeping on RolloutData: the executors (drivers/local.py, drivers/ray_executor.py) do the sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpo_cli.batch.rollout_data import RolloutData, concat_rollouts, select_completions

# combine_rollout_metrics: the executors import it from here (rollout/batch_statistics.py defines it).
from grpo_cli.rollout.batch_statistics import combine_rollout_metrics, kept_rewards, trained_batch_advantages

# Extra round r of step k samples with batch number k + r * EXTRA_ROUND_OFFSET: a sampling seed no regular step
# (1..train.steps) and no other extra round of the run uses.
EXTRA_ROUND_OFFSET = 1_000_000


def extra_round_batch_number(step: int, extra_round: int) -> int:
    return step + extra_round * EXTRA_ROUND_OFFSET


def groups_with_signal(raw_rewards: torch.Tensor, group_size: int, scored: torch.Tensor | None = None) -> list[int]:
    """Indices of the groups whose rewards are not all equal (contiguous groups of group_size), among the
    completions `scored` (RolloutData.scored: a skipped episode has no reward; None: all)."""
    grouped = raw_rewards.float().reshape(-1, group_size)  # (n_groups, G)
    if scored is None:
        return [int(g) for g in torch.nonzero(grouped.amax(dim=1) > grouped.amin(dim=1)).flatten()]
    kept = scored.bool().reshape(-1, group_size)  # (n_groups, G)
    highest = grouped.masked_fill(~kept, float("-inf")).amax(dim=1)
    lowest = grouped.masked_fill(~kept, float("inf")).amin(dim=1)
    return [int(g) for g in torch.nonzero((kept.sum(dim=1) >= 2) & (highest > lowest)).flatten()]


def trained_reward_metrics(sampled: dict[str, float], trained_rewards: torch.Tensor) -> dict[str, float]:
    """The step's rollout metrics with train/reward and train/reward_std of the batch the update trains on
    (`trained_rewards`); the mean over every sampled completion, dropped groups included, moves to
    train/reward_all_sampled. The other statistics (reward components, lengths) stay those of every round."""
    metrics = dict(sampled)
    if "train/reward" in metrics:
        metrics["train/reward_all_sampled"] = metrics["train/reward"]
    metrics["train/reward"] = trained_rewards.mean().item()
    metrics["train/reward_std"] = trained_rewards.std().item() if len(trained_rewards) > 1 else 0.0
    return metrics


@dataclass
class SignalBatch:
    """The groups with signal collected so far for one step, round by round."""

    group_size: int
    target_groups: int  # groups in a full batch (this rank's share)
    advantage: str  # normalization.advantage, to recompute advantages over the assembled batch
    advantage_eps: float
    kept: list[RolloutData] = field(default_factory=list)
    rounds: list[RolloutData] = field(default_factory=list)
    dropped: int = 0

    def add(self, data: RolloutData) -> None:
        """One round's batch: keep its groups with signal."""
        self.rounds.append(data)
        groups = groups_with_signal(data.raw_rewards, self.group_size, data.scored)
        self.dropped += len(data.raw_rewards) // self.group_size - len(groups)
        if groups:
            g = self.group_size
            self.kept.append(select_completions(data, [i for k in groups for i in range(k * g, (k + 1) * g)]))

    @property
    def kept_groups(self) -> int:
        return sum(len(part.raw_rewards) for part in self.kept) // self.group_size

    @property
    def full(self) -> bool:
        return self.kept_groups >= self.target_groups

    def batch(self, groups: int | None = None) -> RolloutData:
        """The batch to train on: the first `groups` (default: a full batch's worth) groups with signal, with
        advantages recomputed over it and the metrics of every round. With no group with signal at all it is the
        first round's batch, as training without dynamic sampling would have it (its policy gradient is 0)."""
        groups = min(self.target_groups if groups is None else groups, self.kept_groups)
        if groups == 0:
            data = self.rounds[0]
        else:
            data = select_completions(concat_rollouts(self.kept), list(range(groups * self.group_size)))
        # On either branch (under data parallelism every rank takes the same one: `groups` is the ranks' minimum),
        # so the ranks' collective under batch_std pairs up.
        data.advantages = trained_batch_advantages(data, self.group_size, self.advantage, self.advantage_eps)
        data.metrics = {
            **trained_reward_metrics(combine_rollout_metrics(self.rounds), kept_rewards(data)),
            "train/groups_dropped": float(self.dropped),
            "train/extra_rounds": float(len(self.rounds) - 1),
            "train/groups_trained": float(groups),
            "train/groups_short": float(self.target_groups - groups),
        }
        return data
