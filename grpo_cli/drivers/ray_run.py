"""A run's Ray, as the Ray executors share it: Ray started (or the cluster joined), the learner and the generator
actors placed and started, their results fetched, the learner's weights published, everything stopped at the end.

Both Ray executors hold one (composition): drivers/ray_executor.py (one_behind, replay_buffer: one
drivers/ray_actors.HostedGenerator) and drivers/async_executor.py (async: sync.generators HostedAsyncGenerators); each
keeps only its strategy's loop. The actors are called through their typed handles (drivers/ray_actors.py).

On one machine a local Ray starts for the run (`ray.init()`), watched by a sentinel process (drivers/ray_reaper.py)
that stops it even when the run is killed, and shuts down after it; `sync.ray_address` connects to an existing
cluster instead (every node needs grpo-cli and its dependencies installed): the actors ask for sync.actor_cpus
(required there), and for sync.learner_resources / generator_resources (Ray's custom resources: which nodes they may
run on); drivers/ray_cluster.py checks from each actor that its node shares the run directory and sees the task's
files, and an actor lost with its node ends the run in one line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from grpo_cli.drivers.ray_actors import AsyncGeneratorHandle, GeneratorHandle, Handle, LearnerHandle, Weights
from grpo_cli.drivers.ray_cluster import actor_lost, cannot_join, node_files, reply_problem, shipped_env
from grpo_cli.drivers.ray_reaper import start_sentinel, stop_sentinel
from grpo_cli.errors import RunStopped, UserFacingError
from grpo_cli.tasks import Example

if TYPE_CHECKING:
    from ray import ObjectRef

    from grpo_cli.config.schemas import GRPOConfig

# The generators' handle: one_behind / replay_buffer's, or async's.
G = TypeVar("G", bound=GeneratorHandle | AsyncGeneratorHandle)
R = TypeVar("R")


def import_ray(strategy: str) -> ModuleType:
    try:
        import ray
    except ImportError:
        raise UserFacingError(f'sync={strategy} needs Ray: pip install -e ".[ray]"') from None
    return ray


def actor_resources(cfg: GRPOConfig, local_cpus: int, has_cuda: bool) -> tuple[int, float]:
    """(CPUs, GPUs) for each actor: sync.actor_cpus / actor_gpus, or half the cores and a GPU each when CUDA is
    there. Joining a cluster, the CPUs must be said: this machine's cores say nothing of the nodes'."""
    if cfg.sync.actor_cpus is None and cfg.sync.ray_address is not None:
        raise UserFacingError(
            f"sync.actor_cpus: set it when joining a Ray cluster (sync.ray_address={cfg.sync.ray_address}): the CPUs "
            "each actor takes on its node, e.g. sync.actor_cpus=2"
        )
    cpus = cfg.sync.actor_cpus or max(1, local_cpus // 2)
    gpus = cfg.sync.actor_gpus
    if gpus is None:
        gpus = 1.0 if has_cuda and cfg.model.device != "cpu" else 0.0
    return cpus, gpus


def actor_options(cfg: GRPOConfig, role: str, cpus: int, gpus: float) -> dict[str, Any]:
    """Ray's options for the learner or a generator: its CPUs, GPUs and custom resources (the nodes it may run on:
    sync.learner_resources / generator_resources)."""
    resources = dict(cfg.sync.learner_resources if role == "learner" else cfg.sync.generator_resources)
    options: dict[str, Any] = {"num_cpus": cpus, "num_gpus": gpus, "max_restarts": 0}
    if resources:
        options["resources"] = {name: float(amount) for name, amount in resources.items()}
    return options


class RayRun(Generic[G]):
    """The learner and generator actors of a run, and the Ray they run on (module docstring). `start` starts them;
    the constructor takes handles that exist already."""

    def __init__(
        self,
        ray: ModuleType,
        output_dir: Path,
        learner: LearnerHandle,
        generators: list[G],
        started_ray: bool = False,
        sentinel: subprocess.Popen[bytes] | None = None,
    ) -> None:
        self.ray = ray
        self.output_dir = output_dir
        self.learner = learner
        self.generators: list[G] = generators
        self.started_ray = started_ray  # this run started the local Ray: close shuts it down
        self.sentinel = sentinel
        self.loads: list[ObjectRef[Any]] = []  # calls on the generators not checked yet (weight loads, hand-outs)
        self.closed = False
        self.device_text = ""  # the learner's device and the actors', for the run's first line
        self.load_s = 0.0  # seconds the actors took to load their policy copies

    @classmethod
    def start(
        cls,
        cfg: GRPOConfig,
        output_dir: Path,
        examples: list[Example],
        generator: type[G],
        count: int,
        actors_text: str,
    ) -> RayRun[G]:
        """Start Ray (unless it runs already in this process) and the learner and `count` generators, each loading
        its policy copy, and check on a generator that the training prompts fit its context. `actors_text` names
        the actors in the run's first line. On any error what was started is stopped before it propagates."""
        cpus, gpus = actor_resources(cfg, os.cpu_count() or 1, torch.cuda.is_available())
        ray = import_ray(cfg.sync.strategy)
        run: RayRun[G] = cls(ray, output_dir, LearnerHandle(None), [])  # no actor yet: close() kills none
        try:
            t0 = time.perf_counter()
            run.start_ray(cfg, actors=count + 1, cpus=cpus)
            ray_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            run.learner = LearnerHandle(run.new_actor(LearnerHandle, actor_options(cfg, "learner", cpus, gpus)))
            options = actor_options(cfg, "generator", cpus, gpus)
            run.generators = [generator(run.new_actor(generator, options)) for _ in range(count)]
            roles: dict[str, Handle[Any]] = {"learner": run.learner}
            roles.update({generator.role(i): g for i, g in enumerate(run.generators)})
            run.check_nodes(cfg, roles)
            # Every actor loads its policy copy at the same time.
            device_text, *_ = run.get_all(
                [run.learner.start(cfg, output_dir, cpus), *[g.start(cfg, cpus) for g in run.generators]]
            )
            run.load_s = time.perf_counter() - t0
            run.get(run.generators[0].check_prompts_fit(examples))
        except BaseException:
            # The caller gets no executor to close: stop what was started (the local Ray, the actors, the sentinel)
            # here, or it outlives the error in this process, where the next run (a sweep's next job under
            # hydra/launcher=basic) would find Ray up and the actors still holding their CPUs.
            run.close()
            raise
        where = "local" if cfg.sync.ray_address is None else cfg.sync.ray_address
        run.device_text = (
            f"{device_text} (ray: {where}, ready in {ray_s:.1f}s; {actors_text} with {cpus} CPU(s)"
            f"{f' and {gpus:g} GPU(s)' if gpus else ''} each)"
        )
        return run

    def start_ray(self, cfg: GRPOConfig, actors: int, cpus: int) -> None:
        """A local Ray for the run (unless Ray runs already in this process), or the cluster at sync.ray_address."""
        if self.ray.is_initialized():
            return
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.ERROR}
        if cfg.sync.ray_address is None:
            # Room for every actor even when actor_cpus asks for more than this machine has (oversubscribed).
            kwargs["num_cpus"] = max(os.cpu_count() or 1, actors * cpus)
            self.sentinel = start_sentinel()  # stops this local Ray even if the run is killed outright
        else:
            # The actors start from their node's environment: the driver's hub and logging settings go with them.
            kwargs["runtime_env"] = {"env_vars": shipped_env(os.environ)}
        try:
            self.ray.init(address=cfg.sync.ray_address, **kwargs)
        except ConnectionError as error:
            if cfg.sync.ray_address is None:
                raise
            raise UserFacingError(cannot_join(cfg.sync.ray_address, error)) from None
        self.started_ray = True

    def new_actor(self, handle: type[Handle[Any]], options: dict[str, Any]) -> Any:  # Any: a ray ActorHandle
        """An actor of the handle's hosted class, with Ray's `options` (placement) and the handle's concurrency."""
        if handle.concurrency > 1:
            options = {**options, "max_concurrency": handle.concurrency}
        return self.ray.remote(handle.hosted).options(**options).remote()

    def check_nodes(self, cfg: GRPOConfig, actors: dict[str, Handle[Any]]) -> None:
        """On a cluster, before the actors load anything: each one's node shares the run directory with this
        machine (a marker written here, read there; a reply written there, read here) and sees every file the
        config names (drivers/ray_cluster.py). One machine needs no check."""
        if cfg.sync.ray_address is None:
            return
        token = uuid.uuid4().hex
        self.output_dir.mkdir(parents=True, exist_ok=True)
        marker = self.output_dir / f".ray_storage_{token[:8]}"
        marker.write_text(token)
        try:
            files = node_files(cfg)
            roles = list(actors)
            problems = self.get_all([actors[r].check_node(str(marker), token, files, r) for r in roles])
            problems += [
                reply_problem(marker, token, r) for r, problem in zip(roles, problems, strict=True) if problem is None
            ]
        finally:
            marker.unlink(missing_ok=True)
        for problem in problems:
            if problem is not None:
                raise UserFacingError(problem)

    # --- results ------------------------------------------------------------------------------------------------
    def get(self, ref: ObjectRef[R], timeout: float | None = None) -> R:
        """ray.get, re-raising a user-facing error from an actor as itself (one line, not a remote traceback)."""
        exceptions = self.ray.exceptions
        try:
            return self.ray.get(ref, timeout=timeout)
        except exceptions.RayTaskError as error:
            if isinstance(error.cause, UserFacingError | RunStopped):
                raise error.cause from None
            if isinstance(error.cause, exceptions.RayActorError | exceptions.ObjectLostError):
                raise UserFacingError(actor_lost(error.cause, self.output_dir)) from None
            raise
        except (exceptions.RayActorError, exceptions.ObjectLostError) as error:
            # An actor died under the run (its node lost, its process killed): one line, the checkpoints named.
            raise UserFacingError(actor_lost(error, self.output_dir)) from None

    def get_all(self, refs: list[ObjectRef[Any]]) -> list[Any]:  # Any: what each actor method returned
        """Every result, after all have finished: when two actors fail to start, the second error is retrieved too
        (an error nobody retrieves is printed by Ray as a traceback when its reference is dropped)."""
        self.ray.wait(refs, num_returns=len(refs))
        results, errors = [], []
        for ref in refs:
            try:
                results.append(self.get(ref))
            except Exception as error:  # noqa: BLE001 - re-raised below, the first one
                errors.append(error)
        if errors:
            raise errors[0]
        return results

    def check_loads(self) -> None:
        """Surface a failed call on a generator (a WeightSyncError, a refused hand-out) now, rather than as a lag
        error later."""
        if not self.loads:
            return
        done, self.loads = self.ray.wait(self.loads, num_returns=len(self.loads), timeout=0, fetch_local=False)
        for ref in done:
            self.get(ref)

    # --- the learner's weights ----------------------------------------------------------------------------------
    def weights(self) -> tuple[ObjectRef[Weights], float]:
        """The learner's trainable weights put into the object store, and the seconds the learner spent on it. The
        driver never fetches the tensors themselves: a generator's call receives the reference."""
        t0 = time.perf_counter()
        weights = self.learner.trainable_weights()
        self.ray.wait([weights], fetch_local=False)
        return weights, time.perf_counter() - t0

    # --- shutdown -----------------------------------------------------------------------------------------------
    def close(self, generators_close_s: float | None = None) -> None:
        """Stop every actor and the local Ray: no process may outlive the run, whatever ended it. With
        `generators_close_s` the generators first release what they hold (their engines, the tools' and the
        reward's worker processes), each waited for that long; killing an actor releases everything anyway.
        Safe after any error, and more than once."""
        if self.closed:
            return
        self.closed = True
        ray = self.ray
        if generators_close_s is not None:
            for generator in self.generators:
                with contextlib.suppress(Exception):  # a dead actor has nothing left to close
                    ray.get(generator.close(), timeout=generators_close_s)
        handles: list[Handle[Any]] = [*self.generators, self.learner]
        for handle in handles:
            if handle.actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(handle.actor)
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False
        stop_sentinel(self.sentinel)
        self.sentinel = None
