"""The parts of sync=async's generator (rollout/async_generation.py) that the driver and the loop exchange: the
batches handed out (BatchOrder), the scored groups shipped back (FinishedGroup), the offered weights (Update), the
generator's counters, and the engine as a whole-batch run calls it (UpdatingEngine)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from grpo_cli.batch.rollout_data import RolloutData
from grpo_cli.engines.stream import StreamCounters
from grpo_cli.tasks import Example

if TYPE_CHECKING:
    from grpo_cli.engines.base import RolloutBatch, RolloutEngine, SamplingSettings
    from grpo_cli.rollout.worker import RolloutWorker


@dataclass
class BatchOrder:
    """A rollout batch to sample: its number (its sampling seed; under on_stale=wait the step that trains it), its
    prompts, the epoch reward functions read, and the prompt indices not to sample (trained before a resume)."""

    batch_number: int
    examples: list[Example]
    epoch: float = 0.0
    skip: frozenset[int] = frozenset()


@dataclass
class FinishedGroup:
    """One scored group: its batch, its prompt's index there, its G completions (metrics: the batch's statistics
    for a group of a whole batch; the driver takes the generator's times from its counters)."""

    batch_number: int
    prompt_indices: list[int]  # [the prompt's index in its batch]
    data: RolloutData


@dataclass
class GeneratorCounters:
    """The generator's time and work since the driver last collected (the step's sync metrics)."""

    generation_s: float = 0.0  # decode steps, prefills and whole-batch sampling
    scoring_s: float = 0.0  # rewards, advantages (and old log-probs with sync.proximal=behaviour)
    paced_s: float = 0.0  # waiting for the staleness bound (on_stale=wait) with prompts in hand
    idle_s: float = 0.0  # nothing to sample: no prompts submitted, or an update waiting for its version
    update_s: float = 0.0  # applying weights (copy into the policy, the engine's load)
    recompute_s: float = 0.0  # prefilling running rows again after an update (kv_after_update=recompute)
    row_steps: int = 0
    wasted_row_steps: int = 0  # decode steps spent on rows already ended
    sampled_tokens: int = 0  # tokens sampled (a whole-batch run's: the model's tokens of its samples)
    updates_mid_generation: int = 0  # updates applied while rows were running
    groups: int = 0

    def add_stream(self, stream: StreamCounters) -> None:
        self.generation_s += stream.decode_s + stream.prefill_s
        self.recompute_s += stream.recompute_s
        self.row_steps += stream.row_steps
        self.wasted_row_steps += stream.wasted_row_steps
        self.sampled_tokens += stream.row_steps - stream.wasted_row_steps


@dataclass
class Update:
    tensors: dict[str, torch.Tensor]
    version: int


class UpdatingGenerator(Protocol):
    """What UpdatingEngine calls of its generator (AsyncGeneration)."""

    worker: RolloutWorker

    def between_calls(self) -> None: ...

    def engine_call(self, what: str) -> AbstractContextManager[None]: ...


class UpdatingEngine:
    """The engine as a whole-batch run (episodes, agents) calls it: before each call the generator applies a
    waiting update if it may (partial rollouts), and `policy_version` says which version sampled the call's
    tokens (rollout.runs.sampling_version reads it)."""

    def __init__(self, engine: RolloutEngine, generation: UpdatingGenerator) -> None:
        self._engine = engine
        self._generation = generation

    @property
    def policy_version(self) -> int:
        return self._generation.worker.version

    @property
    def context_length(self) -> int | None:
        return self._engine.context_length

    def generate(self, prompt_ids: list[list[int]], settings: SamplingSettings) -> RolloutBatch:
        self._generation.between_calls()
        with self._generation.engine_call("a whole-batch run's engine call"):
            return self._engine.generate(prompt_ids, settings)

    def sync_weights(self, version: int | None = None) -> dict[str, float]:
        return self._engine.sync_weights(version)

    def close(self) -> None:
        self._engine.close()

    def __getattr__(self, name: str) -> Any:  # the engine's own attributes (model, openai_server, ...)
        return getattr(self._engine, name)


def counter_difference(after: StreamCounters, before: StreamCounters) -> StreamCounters:
    """What the stream counted between two copies of its counters."""
    return StreamCounters(**{k: getattr(after, k) - getattr(before, k) for k in vars(after)})
