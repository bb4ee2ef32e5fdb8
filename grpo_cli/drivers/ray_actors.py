"""The Ray actors of sync=one_behind | replay_buffer | async, and the typed handles the executors call them through.

Each actor hosts one object, built in `start`, not in the actor's constructor: an error raised while loading (a bad
model path) then reaches the driver as itself, where a failed actor constructor reports only text.

    HostedLearner         learner/learner.Learner: (reference log-probs) -> updates -> its trainable weights
    HostedGenerator       rollout/worker.RolloutWorker (one_behind, replay_buffer): one rollout batch per call
    HostedAsyncGenerator  rollout/async_generation.AsyncGeneration (async): batches handed out ahead, groups
                          collected as they end, weights offered

A handle (LearnerHandle, GeneratorHandle, AsyncGeneratorHandle) wraps a Ray actor handle: one method per actor
method, each calling it with `.remote` and returning the ray.ObjectRef of its result (drivers/ray_run.RayRun.get
fetches it). A handle's method names the actor's method itself (`self._call(HostedLearner.learn, data, step)`), never
its name in a string, so mypy checks that the method exists, its arguments and its result: a renamed or changed actor
method fails type checking (and tests/unit/drivers/test_ray_actors.py).

No Ray import here: drivers/ray_run.py makes the classes actors (ray.remote) and imports Ray at run time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Concatenate, Generic, ParamSpec, TypeVar, cast

import torch

from grpo_cli.batch.rollout_data import RolloutData
from grpo_cli.drivers.ray_cluster import node_problem
from grpo_cli.learner.checkpoint import State, init_from_checkpoint, load_weights
from grpo_cli.learner.learner import Learner
from grpo_cli.rollout.async_generation import AsyncGeneration, BatchOrder, FinishedGroup
from grpo_cli.rollout.worker import RolloutWorker
from grpo_cli.tasks import Example

if TYPE_CHECKING:
    from ray import ObjectRef

    from grpo_cli.config.schemas import GRPOConfig

Weights = dict[str, torch.Tensor]  # a policy's trainable tensors by parameter name (only the adapters with LoRA)
Evaluation = tuple[dict[str, float], list[dict[str, Any]], int]  # eval/* metrics, one record per example, version


def load_init_from(init_from: str, model: torch.nn.Module) -> None:
    """init_from's weights into a generator's policy copy (rollout/ does not import learner/)."""
    load_weights(init_from_checkpoint(init_from), model)


def initial_weights(cfg: GRPOConfig) -> Callable[[torch.nn.Module], None] | None:
    """What loads the run's initial weights into an async generator's copy: init_from's, or None (model.*'s)."""
    return functools.partial(load_init_from, cfg.init_from) if cfg.init_from else None


# --- the actors (each runs in its own process) ---------------------------------------------------------------------


class Hosted:
    """What every actor answers before `start`."""

    def check_node(self, marker: str, token: str, files: list[tuple[str, str]], role: str) -> str | None:
        """On a cluster: does this actor's node see the run directory and the task's files (drivers/ray_cluster.py)?"""
        return node_problem(marker, token, files, role)


class HostedLearner(Hosted):
    """The learner actor: the policy, its optimizer and its checkpoints."""

    learner: Learner

    def start(self, cfg: GRPOConfig, output_dir: Path, threads: int) -> str:
        self.learner = Learner(cfg, output_dir, threads)
        return self.learner.describe()

    def resume(self) -> tuple[int, State, list[str]]:
        return self.learner.resume()

    def save_checkpoint(self, step: int, state: State) -> Path:
        return self.learner.save_checkpoint(step, state)

    def learn(self, data: RolloutData, step: int) -> tuple[dict[str, float], int]:
        return self.learner.learn(data, step)

    def trainable_weights(self) -> Weights:
        return self.learner.trainable_weights()


class HostedGenerator(Hosted):
    """A one_behind / replay_buffer generator: its own policy copy, one rollout batch per call."""

    worker: RolloutWorker

    def start(self, cfg: GRPOConfig, threads: int) -> str:
        self.worker = RolloutWorker(cfg, None, None, threads)
        return self.worker.describe()

    def check_prompts_fit(self, examples: list[Example]) -> None:
        self.worker.check_prompts_fit(examples)

    def produce(
        self,
        examples: list[Example],
        batch_number: int,
        with_old_log_probs: bool,
        first_prompt_index: int,
        epoch: float,
    ) -> RolloutData:
        return self.worker.produce(examples, batch_number, with_old_log_probs, first_prompt_index, epoch)

    def load_weights(self, tensors: Weights, version: int) -> float:
        return self.worker.load_weights(tensors, version)

    def evaluate(self, examples: list[Example], epoch: float) -> Evaluation:
        # No progress callback: an actor cannot call back into the driver.
        return self.worker.evaluate(examples, None, epoch)

    def close(self) -> None:
        self.worker.close()


class HostedAsyncGenerator(Hosted):
    """An async generator: its own policy copy, sampling on its own thread (rollout/async_generation.py)."""

    generation: AsyncGeneration

    def start(self, cfg: GRPOConfig, threads: int) -> str:
        self.generation = AsyncGeneration(cfg, threads, initial_weights(cfg))
        return self.generation.describe()

    def check_prompts_fit(self, examples: list[Example]) -> None:
        self.generation.check_prompts_fit(examples)

    def submit(self, order: BatchOrder) -> None:
        self.generation.submit(order)

    def offer_weights(self, tensors: Weights, version: int) -> None:
        self.generation.offer_weights(tensors, version)

    def collect(self, timeout: float) -> tuple[list[FinishedGroup], dict[str, float], int, float]:
        return self.generation.collect(timeout)

    def evaluate(self, examples: list[Example], epoch: float, version: int) -> Evaluation:
        return self.generation.evaluate(examples, epoch, version)

    def close(self) -> None:
        self.generation.close()


# --- the handles (in the driver) -----------------------------------------------------------------------------------

A = TypeVar("A", bound=Hosted)
P = ParamSpec("P")
R = TypeVar("R")


class Handle(Generic[A]):
    """A Ray actor hosting an `A`, called through its methods."""

    hosted: ClassVar[type[Hosted]]  # the class Ray makes the actor of
    concurrency: ClassVar[int] = 1  # calls the actor runs at once (Ray's max_concurrency)

    def __init__(self, actor: Any) -> None:  # Any: a ray.actor.ActorHandle (Ray is imported at run time only)
        self.actor = actor

    def _call(self, method: Callable[Concatenate[A, P], R], *args: P.args, **kwargs: P.kwargs) -> ObjectRef[R]:
        # Ray finds an actor's methods by name; the method itself, passed here, is what mypy checks.
        return getattr(self.actor, method.__name__).remote(*args, **kwargs)

    def check_node(self, marker: str, token: str, files: list[tuple[str, str]], role: str) -> ObjectRef[str | None]:
        return self._call(Hosted.check_node, marker, token, files, role)


class LearnerHandle(Handle[HostedLearner]):
    hosted = HostedLearner

    def start(self, cfg: GRPOConfig, output_dir: Path, threads: int) -> ObjectRef[str]:
        return self._call(HostedLearner.start, cfg, output_dir, threads)

    def resume(self) -> ObjectRef[tuple[int, State, list[str]]]:
        return self._call(HostedLearner.resume)

    def save_checkpoint(self, step: int, state: State) -> ObjectRef[Path]:
        return self._call(HostedLearner.save_checkpoint, step, state)

    def learn(self, data: RolloutData, step: int) -> ObjectRef[tuple[dict[str, float], int]]:
        return self._call(HostedLearner.learn, data, step)

    def trainable_weights(self) -> ObjectRef[Weights]:
        return self._call(HostedLearner.trainable_weights)


class GeneratorHandle(Handle[HostedGenerator]):
    hosted = HostedGenerator

    @staticmethod
    def role(index: int) -> str:
        """The actor's name in a cluster check's line (one_behind and replay_buffer have one generator)."""
        return "generator"

    def start(self, cfg: GRPOConfig, threads: int) -> ObjectRef[str]:
        return self._call(HostedGenerator.start, cfg, threads)

    def check_prompts_fit(self, examples: list[Example]) -> ObjectRef[None]:
        return self._call(HostedGenerator.check_prompts_fit, examples)

    def produce(
        self,
        examples: list[Example],
        batch_number: int,
        with_old_log_probs: bool,
        first_prompt_index: int,
        epoch: float,
    ) -> ObjectRef[RolloutData]:
        return self._call(
            HostedGenerator.produce, examples, batch_number, with_old_log_probs, first_prompt_index, epoch
        )

    def load_weights(self, tensors: ObjectRef[Weights], version: int) -> ObjectRef[float]:
        # Ray hands the actor the value of a reference passed as an argument: the tensors, not the reference.
        return self._call(HostedGenerator.load_weights, cast("Weights", tensors), version)

    def evaluate(self, examples: list[Example], epoch: float) -> ObjectRef[Evaluation]:
        return self._call(HostedGenerator.evaluate, examples, epoch)

    def close(self) -> ObjectRef[None]:
        return self._call(HostedGenerator.close)


class AsyncGeneratorHandle(Handle[HostedAsyncGenerator]):
    hosted = HostedAsyncGenerator
    # Several calls at once: collect waits for groups while offer_weights and evaluate arrive.
    concurrency = 4

    @staticmethod
    def role(index: int) -> str:
        """The actor's name in a cluster check's line (sync.generators of them)."""
        return f"generator {index}"

    def start(self, cfg: GRPOConfig, threads: int) -> ObjectRef[str]:
        return self._call(HostedAsyncGenerator.start, cfg, threads)

    def check_prompts_fit(self, examples: list[Example]) -> ObjectRef[None]:
        return self._call(HostedAsyncGenerator.check_prompts_fit, examples)

    def submit(self, order: BatchOrder) -> ObjectRef[None]:
        return self._call(HostedAsyncGenerator.submit, order)

    def offer_weights(self, tensors: ObjectRef[Weights], version: int) -> ObjectRef[None]:
        # Ray hands the actor the value of a reference passed as an argument: the tensors, not the reference.
        return self._call(HostedAsyncGenerator.offer_weights, cast("Weights", tensors), version)

    def collect(self, timeout: float) -> ObjectRef[tuple[list[FinishedGroup], dict[str, float], int, float]]:
        return self._call(HostedAsyncGenerator.collect, timeout)

    def evaluate(self, examples: list[Example], epoch: float, version: int) -> ObjectRef[Evaluation]:
        return self._call(HostedAsyncGenerator.evaluate, examples, epoch, version)

    def close(self) -> ObjectRef[None]:
        return self._call(HostedAsyncGenerator.close)
