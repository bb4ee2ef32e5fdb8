"""What the training loop asks of an executor: where a step's generation and learning run.

`InProcessExecutor` (drivers/local.py) takes turns on one model in this process (on_policy, multi_epoch);
`RayExecutor` (drivers/ray_executor.py) runs the generator and the learner as Ray actors that overlap
(one_behind, replay_buffer). The loop (drivers/loop.py) never knows which one it drives.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from grpo_cli.distributed import parallel
from grpo_cli.drivers.versions import overlap_fraction
from grpo_cli.errors import UserFacingError
from grpo_cli.tasks import Example


class Executor(Protocol):
    device_text: str  # where the policy lives, for the run's first line
    load_s: float  # seconds spent loading the policy (and starting Ray)
    # The last step's episode transcripts (multi-turn tasks; this rank's share under data parallelism; under
    # replay_buffer the batches that arrived during the step), for the run's logs; [] otherwise.
    last_transcripts: list[dict[str, Any]]

    @property
    def learner_version(self) -> int:
        """The step of the learner's current weights (what a checkpoint taken now would hold)."""
        ...

    def resume(self) -> tuple[int, dict[str, Any], list[str]]:
        """Load the newest usable checkpoint: (its step, the saved run state, messages for the console)."""
        ...

    def start(self, start_step: int) -> dict[str, float]:
        """The weights are final (fresh or resumed at start_step): make the generator sample from them. Returns
        the metrics of the weight sync this took (empty when none was needed)."""
        ...

    def step(self, step: int) -> tuple[dict[str, float], int]:
        """One GRPO step: (its metrics.jsonl line, consecutive non-finite updates so far)."""
        ...

    def evaluate(
        self, examples: list[Example], on_generated: Callable[[int], None] | None
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Held-out evaluation of the learner's current weights: (eval/* metrics, one record per example)."""
        ...

    def save_checkpoint(self, step: int) -> Path:
        """Weights, optimizer, RNG and the prompt sampler's position, as of `step`."""
        ...

    def close(self) -> None:
        """Release engines, actors and Ray; safe after any error, and more than once."""
        ...


def step_metrics(
    rollout: dict[str, float], learned: dict[str, float], timing: dict[str, float], sync: dict[str, float]
) -> dict[str, float]:
    """One metrics.jsonl line before `finish_step_metrics`: the rollout batch's statistics, the learner's, the
    time breakdown and the sync bookkeeping, with the generated token count `n_tokens` still in it (the rates are
    computed from it once the ranks' counts are summed). time/step_s is the step's wall time; the phases may
    overlap (disaggregated strategies)."""
    rollout = dict(rollout)
    produce_s = rollout.pop("time/produce_s", 0.0)
    weight_load_s = rollout.pop("time/weight_load_s", 0.0)
    # The rollout's and the learner's names differ (but the old log-probs' time, added below), so a shared name is
    # a reward function's log_metric taking one of the learner's.
    shared = sorted(set(rollout) & set(learned) - {"time/old_log_probs_s"})
    if shared:
        raise UserFacingError(
            f"a reward function called log_metric({shared[0].partition('/')[2]!r}, ...), which would overwrite the "
            f"learner's {shared[0]}: give the metric another name"
        )
    metrics = {**rollout, **learned, **timing, **sync}
    metrics.setdefault("n_tokens", 0.0)  # a replay step where no batch arrived generated nothing
    # Old log-probs come from the learner (in-process) or from the generator (disaggregated): one is 0.
    metrics["time/old_log_probs_s"] = rollout.get("time/old_log_probs_s", 0.0) + learned["time/old_log_probs_s"]
    # Weight sync: the learner publishing its weights plus the generator loading them (0 when they share them).
    metrics["time/sync_s"] = timing.get("time/sync_s", 0.0) + weight_load_s
    metrics["time/overlap_frac"] = overlap_fraction(produce_s, timing["time/waiting_s"])
    return metrics


def add_throughput(metrics: dict[str, float]) -> dict[str, float]:
    """The step's rates from its totals, `n_tokens` (generated tokens, removed here) over time/step_s and
    time/generation_s: throughput/tokens_per_s and throughput/generation_tokens_per_s. Computed after the ranks'
    metrics are combined (their token counts summed, the slowest rank's times), a rate is the whole step's, every
    rank's tokens; after several generation rounds (dynamic sampling, a replay step's batches) it is their tokens
    over their summed time."""
    metrics = dict(metrics)
    n_tokens = metrics.pop("n_tokens", 0.0)
    metrics["throughput/tokens_per_s"] = n_tokens / max(metrics["time/step_s"], 1e-9)
    if "time/generation_s" in metrics:
        metrics["throughput/generation_tokens_per_s"] = n_tokens / max(metrics["time/generation_s"], 1e-9)
    return metrics


def finish_step_metrics(metrics: dict[str, float], trained_rewards: torch.Tensor) -> dict[str, float]:
    """A step's metrics.jsonl line from `step_metrics`' line of this rank: with several data-parallel ranks
    combined over all of them (parallel.reduce_metrics: counts summed, times the slowest rank's, statistics the
    mean of equal shares; train/reward_std of the whole trained batch, `trained_rewards` being this rank's share),
    then the rates (`add_throughput`). Every rank calls it (collectives)."""
    if parallel.world().distributed:
        metrics = {**metrics, "train/reward_std": parallel.reduce_std(trained_rewards)}
        metrics = parallel.reduce_metrics(metrics)
    return add_throughput(metrics)
