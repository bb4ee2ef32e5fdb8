"""Statistics of the batch the update trains on, whichever way it was assembled (docs/algorithm.md, "Batch-level
statistics").

A batch is scored in pieces on most paths: sync=async's stream scores one group as it ends, a data-parallel rank
its share, dynamic sampling round by round, and on_stale=drop trains groups of several batches together. A
group's statistics (std, mean, rloo) are the same in any piece that holds the group; a batch-level one is not, so
it is taken here, once the trained batch is assembled, over every rank's rows of it (an all_gather over
torch.distributed). The executors call `trained_batch_advantages` where they assemble the batch they train.
"""

from __future__ import annotations

import torch

from grpo_cli.core import compute_advantages
from grpo_cli.core.advantages import BATCH_LEVEL_NORMALIZATIONS
from grpo_cli.distributed import parallel
from grpo_cli.scoring.batch import RolloutData


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
