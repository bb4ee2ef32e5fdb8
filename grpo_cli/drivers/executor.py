"""What the training loop asks of an executor: where a step's generation and learning run.

`InProcessExecutor` (drivers/local.py) takes turns on one model in this process (on_policy, multi_epoch);
`RayExecutor` (drivers/ray_executor.py) runs the generator and the learner as Ray actors that overlap
(one_behind, replay_buffer). The loop (drivers/loop.py) never knows which one it drives.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from grpo_cli.drivers.versions import overlap_fraction
from grpo_cli.errors import UserFacingError
from grpo_cli.tasks import Example


class Executor(Protocol):
    device_text: str  # where the policy lives, for the run's first line
    load_s: float  # seconds spent loading the policy (and starting Ray)

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
    """One metrics.jsonl line: the rollout batch's statistics, the learner's, the time breakdown and the
    sync bookkeeping. time/step_s is the step's wall time; the phases may overlap (disaggregated strategies)."""
    rollout = dict(rollout)
    n_tokens = rollout.pop("n_tokens", 0.0)
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
    # Old log-probs come from the learner (in-process) or from the generator (disaggregated): one is 0.
    metrics["time/old_log_probs_s"] = rollout.get("time/old_log_probs_s", 0.0) + learned["time/old_log_probs_s"]
    # Weight sync: the learner publishing its weights plus the generator loading them (0 when they share them).
    metrics["time/sync_s"] = timing.get("time/sync_s", 0.0) + weight_load_s
    metrics["time/overlap_frac"] = overlap_fraction(produce_s, timing["time/waiting_s"])
    metrics["throughput/tokens_per_s"] = n_tokens / max(timing["time/step_s"], 1e-9)
    return metrics
