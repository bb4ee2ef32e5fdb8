"""sync=one_behind and sync=replay_buffer: the generator and the learner run as Ray actors, concurrently.

The training loop (drivers/loop.py) owns what a run owns everywhere: the prompt sampler, the metrics, evaluation
scheduling, checkpoints, signals. This executor drives two actors, each with its own copy of the policy:

    generator  RolloutWorker: prompts -> generate -> score -> advantages -> behaviour log-probs
    learner    Learner: (reference log-probs) -> updates -> publishes its weights after every step

Weights travel through Ray's object store: the learner puts CPU copies of its trainable tensors there (only the
adapters with LoRA) and the executor hands that reference to the generator, whose `load_weights` call queues
behind the batch it is sampling. Actor calls run in the order they were made, which is what bounds the lag:

    one_behind     step k: take batch k (sampled by version k-2 or k-1), ask for batch k+1 (sampled by the
                   version published at the end of step k-1), train on batch k -> version k, publish it.
    replay_buffer  the generator always has one batch in flight; finished batches go into a bounded buffer of
                   trajectories; each step trains on a uniform sample of it, dropping trajectories more than
                   sync.max_staleness versions old.

On one machine a local Ray starts for the run (`ray.init()`) and shuts down after it; `sync.ray_address`
connects to an existing cluster instead (every node needs grpo-cli and its dependencies installed): the actors ask
for sync.actor_cpus (required there), and for sync.learner_resources / generator_resources (Ray's custom
resources: which nodes they may run on); drivers/ray_cluster.py checks from each actor that its node shares the
run directory and sees the task's files, and an actor lost with its node ends the run in one line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from grpo_cli.config import BatchShape, needs_old_log_probs
from grpo_cli.drivers.dynamic_sampling import (
    SignalBatch,
    combine_rollout_metrics,
    groups_with_signal,
    trained_reward_metrics,
)
from grpo_cli.drivers.executor import finish_step_metrics, step_metrics
from grpo_cli.drivers.prompts import PromptSampler
from grpo_cli.drivers.ray_cluster import actor_lost, cannot_join, node_files, node_problem, reply_problem, shipped_env
from grpo_cli.drivers.ray_reaper import start_sentinel, stop_sentinel
from grpo_cli.drivers.versions import ONE_BEHIND_MAX_LAG, ReplayBuffer, check_lag, staleness_stats
from grpo_cli.errors import RunStopped, UserFacingError
from grpo_cli.learner.learner import Learner
from grpo_cli.rollout.worker import RolloutWorker
from grpo_cli.scoring.batch import RolloutData
from grpo_cli.tasks import Example

if TYPE_CHECKING:
    from grpo_cli.config.schemas import GRPOConfig

# One completion of a rollout batch, as the replay buffer holds it: prompt ids, completion ids, reward, advantage,
# old log-probs, loss-mask weight (1.0: counts in the loss), the sampler's log-probs, the token mask (an episode's
# holes; None: single-turn).
Trajectory = tuple[
    list[int], list[int], float, float, torch.Tensor | None, float, torch.Tensor | None, torch.Tensor | None
]


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


def split_trajectories(data: RolloutData) -> list[Trajectory]:
    """One scored rollout batch as per-completion tuples, for the replay buffer."""
    n = len(data.completion_ids)
    old: Sequence[torch.Tensor | None] = data.old_log_probs or [None] * n
    sampler: Sequence[torch.Tensor | None] = data.sampler_log_probs or [None] * n
    keep = data.loss_mask.tolist() if data.loss_mask is not None else [1.0] * n
    token_masks: Sequence[torch.Tensor | None] = data.token_masks or [None] * n  # an episode's holes
    columns = (
        data.prompt_ids,
        data.completion_ids,
        data.raw_rewards.tolist(),
        data.advantages.tolist(),
        old,
        keep,
        sampler,
        token_masks,
    )
    return list(zip(*columns, strict=True))


def join_trajectories(items: list[Trajectory], versions: list[int]) -> RolloutData:
    """A train batch assembled from replay-buffer trajectories (advantages as computed in their own group)."""
    columns = (list(column) for column in zip(*items, strict=True))
    prompt_ids, completion_ids, rewards, advantages, old, keep, sampler, token_masks = columns
    return RolloutData(
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
        raw_rewards=torch.tensor(rewards, dtype=torch.float32),
        advantages=torch.tensor(advantages, dtype=torch.float32),
        old_log_probs=None if any(o is None for o in old) else old,
        sampler_log_probs=None if any(s is None for s in sampler) else sampler,
        loss_mask=None if all(k == 1.0 for k in keep) else torch.tensor(keep, dtype=torch.float32),
        # Episodes' holes; a single-turn trajectory beside them has every token the model's.
        token_masks=None
        if all(m is None for m in token_masks)
        else [torch.ones(len(c)) if m is None else m for m, c in zip(token_masks, completion_ids, strict=True)],
        policy_version=min(versions),
    )


class Hosted:
    """A Ray actor that builds its object in `start`, not in its constructor: an error raised while loading (a
    bad model path) then reaches the driver as itself, where a failed actor constructor reports only text.
    Every later call names the object's method: `actor.call.remote("learn", data, step)`."""

    def start(self, factory: Callable[..., Learner | RolloutWorker], *args: object) -> str:
        self.target = factory(*args)
        return self.target.describe()

    def call(self, method: str, *args: object) -> object:
        return getattr(self.target, method)(*args)

    def check_node(self, marker: str, token: str, files: list[tuple[str, str]], role: str) -> str | None:
        """Before `start`, on a cluster: does this actor's node see the run directory and the task's files?"""
        return node_problem(marker, token, files, role)


@dataclass
class Request:
    """A rollout batch asked of the generator and not received yet."""

    ref: Any  # a ray.ObjectRef of a RolloutData (ray is imported at run time only: import_ray)
    sampler_state: dict[str, Any]  # the prompt sampler before this batch's prompts were drawn


class RayExecutor:
    """The executor of a one_behind or replay_buffer run (see the module docstring)."""

    def __init__(self, cfg: GRPOConfig, output_dir: Path, sampler: PromptSampler) -> None:
        self.cfg = cfg
        self.output_dir = output_dir
        self.sampler = sampler
        self.shape = BatchShape.from_config(cfg)
        self.with_old_log_probs = needs_old_log_probs(cfg)
        self.ray = import_ray(cfg.sync.strategy)
        self.started_ray = False
        self.sentinel: subprocess.Popen[bytes] | None = None
        self.requests: list[Request] = []
        self.last_transcripts: list[dict[str, Any]] = []
        self.loads: list[Any] = []  # load_weights calls not checked yet (ray.ObjectRefs)
        # Ray ActorHandles of Hosted (ray is imported at run time only: import_ray); None once closed.
        self.learner_actor: Any = None
        self.generator_actor: Any = None
        self.version = 0  # the learner's policy version
        self.batch_counter = 0  # rollout batches asked for (their sampling seeds)
        self.buffer: ReplayBuffer[Trajectory] = ReplayBuffer(cfg.sync.buffer_size, cfg.sync.max_staleness)
        # train.dynamic_sampling with the replay buffer: groups kept out of it, and the batches waited for this step
        self.groups_dropped = 0
        self.extra_rounds = 0
        cpus, gpus = actor_resources(cfg, os.cpu_count() or 1, torch.cuda.is_available())
        try:
            device_text, ray_s = self._start_actors(cfg, output_dir, cpus, gpus)
        except BaseException:
            # The caller gets no executor to close: stop what was started (the local Ray, both actors, the
            # sentinel) here, or it outlives the error in this process, where the next run (a sweep's next job
            # under hydra/launcher=basic) would find Ray up and the actors still holding their CPUs.
            self.close()
            raise
        where = "local" if cfg.sync.ray_address is None else cfg.sync.ray_address
        self.device_text = (
            f"{device_text} (ray: {where}, ready in {ray_s:.1f}s; {self.actors_text()} with {cpus} CPU(s)"
            f"{f' and {gpus:g} GPU(s)' if gpus else ''} each)"
        )

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

    def actors_text(self) -> str:
        """The actors, for the run's first line."""
        return "generator and learner actors"

    def actor_options(self, role: str, cpus: int, gpus: float) -> dict[str, Any]:
        """Ray's options for the learner or a generator: its CPUs, GPUs and custom resources (the nodes it may
        run on: sync.learner_resources / generator_resources)."""
        resources = dict(self.cfg.sync.learner_resources if role == "learner" else self.cfg.sync.generator_resources)
        options: dict[str, Any] = {"num_cpus": cpus, "num_gpus": gpus, "max_restarts": 0}
        if resources:
            options["resources"] = {name: float(amount) for name, amount in resources.items()}
        return options

    def check_nodes(self, actors: dict[str, Any]) -> None:
        """On a cluster, before the actors load anything: each one's node shares the run directory with this
        machine (a marker written here, read there; a reply written there, read here) and sees every file the
        config names (drivers/ray_cluster.py). One machine needs no check."""
        if self.cfg.sync.ray_address is None:
            return
        token = uuid.uuid4().hex
        self.output_dir.mkdir(parents=True, exist_ok=True)
        marker = self.output_dir / f".ray_storage_{token[:8]}"
        marker.write_text(token)
        try:
            files = node_files(self.cfg)
            roles = list(actors)
            problems = self.get_all([actors[r].check_node.remote(str(marker), token, files, r) for r in roles])
            problems += [
                reply_problem(marker, token, r) for r, problem in zip(roles, problems, strict=True) if problem is None
            ]
        finally:
            marker.unlink(missing_ok=True)
        for problem in problems:
            if problem is not None:
                raise UserFacingError(problem)

    def _start_actors(self, cfg: GRPOConfig, output_dir: Path, cpus: int, gpus: float) -> tuple[str, float]:
        """Start Ray (unless it runs already) and both actors with their policy copies; returns the learner's
        device description and the seconds Ray took to start (self.load_s: the actors')."""
        ray = self.ray
        t0 = time.perf_counter()
        self.start_ray(cfg, actors=2, cpus=cpus)
        ray_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.learner_actor = ray.remote(Hosted).options(**self.actor_options("learner", cpus, gpus)).remote()
        self.generator_actor = ray.remote(Hosted).options(**self.actor_options("generator", cpus, gpus)).remote()
        self.check_nodes({"learner": self.learner_actor, "generator": self.generator_actor})
        # Both load their policy copy at the same time.
        device_text, _ = self.get_all(
            [
                self.learner_actor.start.remote(Learner, cfg, output_dir, cpus),
                self.generator_actor.start.remote(RolloutWorker, cfg, None, None, cpus),
            ]
        )
        self.load_s = time.perf_counter() - t0
        self.get(self.generator_actor.call.remote("check_prompts_fit", self.sampler.examples))
        return device_text, ray_s

    @property
    def learner_version(self) -> int:
        return self.version

    def start(self, start_step: int) -> dict[str, float]:
        # The generator's copy starts from the learner's weights (fresh, or the resumed checkpoint's).
        self.version = start_step
        self.batch_counter = start_step
        return {"time/sync_s": self.publish(self.version)}

    def close(self) -> None:
        """Stop both actors and the local Ray: no process may outlive the run, whatever ended it."""
        ray = self.ray
        if self.generator_actor is not None and not self.requests:
            # Let the engine release what it holds; with a batch in flight the call would wait for it, and
            # killing the actor releases everything anyway.
            with contextlib.suppress(Exception):  # a dead actor has nothing left to close
                ray.get(self.generator_actor.call.remote("close"), timeout=10)
        for actor in (self.generator_actor, self.learner_actor):
            if actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
        self.generator_actor = self.learner_actor = None
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False
        stop_sentinel(self.sentinel)
        self.sentinel = None

    def get(self, refs: Any, timeout: float | None = None) -> Any:  # Any: what the actor method returned
        """ray.get, re-raising a user-facing error from an actor as itself (one line, not a remote traceback)."""
        exceptions = self.ray.exceptions
        try:
            return self.ray.get(refs, timeout=timeout)
        except exceptions.RayTaskError as error:
            if isinstance(error.cause, UserFacingError | RunStopped):
                raise error.cause from None
            if isinstance(error.cause, exceptions.RayActorError | exceptions.ObjectLostError):
                raise UserFacingError(actor_lost(error.cause, self.output_dir)) from None
            raise
        except (exceptions.RayActorError, exceptions.ObjectLostError) as error:
            # An actor died under the run (its node lost, its process killed): one line, the checkpoints named.
            raise UserFacingError(actor_lost(error, self.output_dir)) from None

    def get_all(self, refs: list[Any]) -> list[Any]:  # Any: ray.ObjectRefs in, what the actors returned out
        """Every result, after all have finished: when both actors fail to start, the second error is retrieved
        too (an error nobody retrieves is printed by Ray as a traceback when its reference is dropped)."""
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

    # --- checkpoints --------------------------------------------------------------------------------------
    def resume(self) -> tuple[int, dict[str, Any], list[str]]:
        return self.get(self.learner_actor.call.remote("resume"))

    def save_checkpoint(self, step: int) -> Path:
        # Prompts of batches still in flight are not trained on yet: a resumed run draws them again. (The
        # replay buffer's contents are not saved: a resumed run starts with an empty buffer.)
        state = self.requests[0].sampler_state if self.requests else self.sampler.state()
        return self.get(self.learner_actor.call.remote("save_checkpoint", step, {"sampler": state}))

    # --- moving batches and weights -----------------------------------------------------------------------
    def request(self) -> None:
        """Ask the generator for the next rollout batch (it starts when its earlier calls are done)."""
        state, epoch = self.sampler.state(), self.sampler.epoch
        examples = self.sampler.next_batch(self.shape.prompts_per_rollout_batch)
        self.batch_counter += 1
        ref = self.generator_actor.call.remote(
            "produce", examples, self.batch_counter, self.with_old_log_probs, 0, epoch
        )
        self.requests.append(Request(ref, state))

    def receive(self) -> tuple[RolloutData, float]:
        """The oldest requested batch, and how long the driver waited for it."""
        t0 = time.perf_counter()
        data = self.get(self.requests[0].ref)
        waited = time.perf_counter() - t0
        self.requests.pop(0)
        self.check_loads()
        return data, waited

    def check_loads(self) -> None:
        """Surface a failed weight load (a WeightSyncError) now, rather than as a lag error later."""
        if not self.loads:
            return
        done, self.loads = self.ray.wait(self.loads, num_returns=len(self.loads), timeout=0, fetch_local=False)
        self.get(done)

    def publish(self, version: int) -> float:
        """Put the learner's weights into the object store and queue their load on the generator; returns the
        seconds the learner spent on it (the generator's load time comes back with its next batch)."""
        t0 = time.perf_counter()
        weights = self.learner_actor.call.remote("trainable_weights")
        self.ray.wait([weights], fetch_local=False)  # the driver never needs the tensors themselves
        seconds = time.perf_counter() - t0
        self.loads.append(self.generator_actor.call.remote("load_weights", weights, version))
        return seconds

    # --- the steps ----------------------------------------------------------------------------------------
    def step(self, step: int) -> tuple[dict[str, float], int]:
        if self.cfg.sync.strategy == "one_behind":
            return self.one_behind_step(step)
        return self.replay_step(step)

    def one_behind_step(self, step: int) -> tuple[dict[str, float], int]:
        step_start = time.perf_counter()
        if not self.requests:  # the first step, or the first after a resume: nothing was prefetched
            self.request()
        data, waiting_s = self.receive()
        if self.cfg.train.dynamic_sampling:
            # Extra rounds are asked for and awaited before batch k+1, so they queue behind nothing and are
            # sampled by the same weights as batch k (or the next version): the lag bound holds.
            data, waited = self.fill_with_signal(data)
            waiting_s += waited
        lag = check_lag(self.version, data.policy_version, ONE_BEHIND_MAX_LAG)
        self.last_transcripts = data.transcripts or []
        if step < self.cfg.train.steps:
            self.request()  # batch k+1 is sampled while the learner trains on batch k
        learned, nonfinite_streak = self.get(self.learner_actor.call.remote("learn", data, step))
        self.version = step
        sync_s = self.publish(step)
        timing = {"time/step_s": time.perf_counter() - step_start, "time/waiting_s": waiting_s, "time/sync_s": sync_s}
        versions: dict[str, float] = {"sync/policy_version": data.policy_version, "sync/lag": lag}
        metrics = step_metrics(data.metrics, learned, timing, versions)
        return finish_step_metrics(metrics, data.raw_rewards), nonfinite_streak

    def fill_with_signal(self, data: RolloutData) -> tuple[RolloutData, float]:
        """train.dynamic_sampling (one_behind): drop groups with all-equal rewards and ask for more batches until
        the step's batch is full or the extra rounds run out (drivers/dynamic_sampling.py). Returns the batch and
        the time spent waiting for the extra rounds."""
        cfg = self.cfg
        signal = SignalBatch(
            self.shape.group_size,
            self.shape.prompts_per_rollout_batch,
            cfg.normalization.advantage,
            cfg.normalization.advantage_eps,
        )
        signal.add(data)
        waiting_s = 0.0
        for _ in range(cfg.train.dynamic_sampling_max_extra_rounds):
            if signal.full:
                break
            self.request()
            extra, waited = self.receive()
            waiting_s += waited
            signal.add(extra)
        return signal.batch(), waiting_s

    def replay_step(self, step: int) -> tuple[dict[str, float], int]:
        step_start = time.perf_counter()
        n = self.shape.completions_per_rollout_batch
        arrived: list[RolloutData] = []
        waiting_s = 0.0
        self.extra_rounds = 0
        arrived += self.harvest()
        while not self.buffer.can_sample(n, self.version):
            data, waited = self.receive()
            waiting_s += waited
            self.store(data)
            arrived.append(data)
            self.keep_generating()
            self.extra_rounds += 1
        entries = self.buffer.sample(n, self.version, random.Random(self.cfg.seed * 104_729 + step))
        versions = [e.version for e in entries]
        batch = join_trajectories([e.item for e in entries], versions)
        learn_ref = self.learner_actor.call.remote("learn", batch, step)
        # While the learner trains, keep the generator busy and its batches flowing into the buffer.
        while True:
            ready, _ = self.ray.wait([learn_ref, *(r.ref for r in self.requests)], num_returns=1, fetch_local=False)
            if learn_ref in ready:
                break
            arrived += self.harvest()
        learned, nonfinite_streak = self.get(learn_ref)
        self.version = step
        sync_s = self.publish(step)
        self.keep_generating()
        stats = staleness_stats(step - 1, versions)
        sync = {
            "sync/policy_version": min(versions),
            "sync/lag": stats["max"],
            "sync/lag_mean": stats["mean"],
            "sync/buffer_trajectories": len(self.buffer),
            "sync/reuse_mean": sum(e.uses for e in entries) / len(entries),
            "sync/new_batches": len(arrived),
            "sync/dropped_stale": self.buffer.dropped_stale,
            "sync/dropped_full": self.buffer.dropped_full,
        }
        timing = {"time/step_s": time.perf_counter() - step_start, "time/waiting_s": waiting_s, "time/sync_s": sync_s}
        rollout = combine_rollout_metrics(arrived)  # as one batch of every batch that arrived
        self.last_transcripts = [t for d in arrived for t in d.transcripts or []]
        if self.cfg.train.dynamic_sampling:
            rollout = trained_reward_metrics(rollout, batch.raw_rewards)
            rollout["train/groups_dropped"] = float(self.groups_dropped)
            rollout["train/extra_rounds"] = float(max(0, self.extra_rounds - 1))
            self.groups_dropped = 0
        metrics = step_metrics(rollout, learned, timing, sync)
        if not arrived:  # no generator work finished during this step: overlap is undefined, not 0
            metrics.pop("time/overlap_frac")
        return finish_step_metrics(metrics, batch.raw_rewards), nonfinite_streak

    def keep_generating(self) -> None:
        """replay_buffer: exactly one batch in flight, so the generator never idles and never runs far ahead
        of the weights it was last sent."""
        if not self.requests:
            self.request()

    def harvest(self) -> list[RolloutData]:
        """Finished batches, without waiting: into the buffer, and the next one asked for."""
        arrived = []
        while self.requests:
            ready, _ = self.ray.wait([self.requests[0].ref], timeout=0, fetch_local=False)
            if not ready:
                break
            data, _ = self.receive()
            self.store(data)
            arrived.append(data)
        self.keep_generating()
        return arrived

    def store(self, data: RolloutData) -> None:
        """Into the replay buffer; with train.dynamic_sampling only the groups with signal, until a step has waited
        more than train.dynamic_sampling_max_extra_rounds extra batches for a full sample (then every group goes
        in, so the buffer fills)."""
        trajectories = split_trajectories(data)
        if self.cfg.train.dynamic_sampling and self.extra_rounds <= self.cfg.train.dynamic_sampling_max_extra_rounds:
            g = self.shape.group_size
            groups = groups_with_signal(data.raw_rewards, g)
            self.groups_dropped += len(trajectories) // g - len(groups)
            trajectories = [trajectories[i] for k in groups for i in range(k * g, (k + 1) * g)]
        self.buffer.add(trajectories, data.policy_version)

    # --- evaluation ---------------------------------------------------------------------------------------
    def evaluate(
        self, examples: list[Example], on_generated: Callable[[int], None] | None
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        # Queued behind the load of this step's weights, so it evaluates exactly the learner's current policy.
        metrics, records, version = self.get(
            self.generator_actor.call.remote("evaluate", examples, None, self.sampler.epoch)
        )
        if version != self.version:
            raise RuntimeError(f"evaluation ran on policy version {version}, not the learner's {self.version}")
        if on_generated is not None:
            on_generated(len(records))  # the actor cannot call back: the bar completes when the result arrives
        return metrics, records
