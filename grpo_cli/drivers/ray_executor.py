"""sync=one_behind and sync=replay_buffer: the generator and the learner run as Ray actors, concurrently.

The training loop (drivers/loop.py) owns what a run owns everywhere: the prompt sampler, the metrics, evaluation
scheduling, checkpoints, signals. This executor drives two actors, each with its own copy of the policy, through
their typed handles (drivers/ray_actors.py):

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

Starting Ray (or joining sync.ray_address's cluster), placing and starting the actors, fetching their results and
stopping everything are drivers/ray_run.RayRun's, which this executor holds, as the async executor does: here is only
the two strategies' loop.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from grpo_cli.batch.rollout_data import RolloutData
from grpo_cli.config import BatchShape, needs_old_log_probs
from grpo_cli.drivers.dynamic_sampling import (
    SignalBatch,
    combine_rollout_metrics,
    groups_with_signal,
    trained_reward_metrics,
)
from grpo_cli.drivers.executor import finish_step_metrics, step_metrics
from grpo_cli.drivers.prompts import PromptSampler
from grpo_cli.drivers.ray_actors import GeneratorHandle
from grpo_cli.drivers.ray_run import RayRun
from grpo_cli.drivers.versions import ONE_BEHIND_MAX_LAG, ReplayBuffer, check_lag, staleness_stats
from grpo_cli.tasks import Example

if TYPE_CHECKING:
    from ray import ObjectRef

    from grpo_cli.config.schemas import GRPOConfig

# One completion of a rollout batch, as the replay buffer holds it: prompt ids, completion ids, reward, advantage,
# old log-probs, loss-mask weight (1.0: counts in the loss), the sampler's log-probs, the token mask (an episode's
# holes; None: single-turn).
Trajectory = tuple[
    list[int], list[int], float, float, torch.Tensor | None, float, torch.Tensor | None, torch.Tensor | None
]


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


@dataclass
class Request:
    """A rollout batch asked of the generator and not received yet."""

    ref: ObjectRef[RolloutData]
    sampler_state: dict[str, Any]  # the prompt sampler before this batch's prompts were drawn


class RayExecutor:
    """The executor of a one_behind or replay_buffer run (see the module docstring). `run`: the actors to drive
    (None: start them, RayRun.start)."""

    def __init__(
        self, cfg: GRPOConfig, output_dir: Path, sampler: PromptSampler, run: RayRun[GeneratorHandle] | None = None
    ) -> None:
        self.cfg = cfg
        self.sampler = sampler
        self.shape = BatchShape.from_config(cfg)
        self.with_old_log_probs = needs_old_log_probs(cfg)
        self.requests: list[Request] = []
        self.last_transcripts: list[dict[str, Any]] = []
        self.version = 0  # the learner's policy version
        self.batch_counter = 0  # rollout batches asked for (their sampling seeds)
        self.buffer: ReplayBuffer[Trajectory] = ReplayBuffer(cfg.sync.buffer_size, cfg.sync.max_staleness)
        # train.dynamic_sampling with the replay buffer: groups kept out of it, and the batches waited for this step
        self.groups_dropped = 0
        self.extra_rounds = 0
        if run is None:
            run = RayRun.start(cfg, output_dir, sampler.examples, GeneratorHandle, 1, "generator and learner actors")
        self.run = run
        self.learner = run.learner
        self.generator = run.generators[0]
        self.device_text = run.device_text
        self.load_s = run.load_s

    @property
    def learner_version(self) -> int:
        return self.version

    def start(self, start_step: int) -> dict[str, float]:
        # The generator's copy starts from the learner's weights (fresh, or the resumed checkpoint's).
        self.version = start_step
        self.batch_counter = start_step
        return {"time/sync_s": self.publish(self.version)}

    def close(self) -> None:
        """Stop both actors and the local Ray. With a batch in flight the generator is not asked to release its
        engine first: the call would wait for the batch, and killing the actor releases everything anyway."""
        self.run.close(generators_close_s=None if self.requests else 10)

    # --- checkpoints --------------------------------------------------------------------------------------
    def resume(self) -> tuple[int, dict[str, Any], list[str]]:
        return self.run.get(self.learner.resume())

    def save_checkpoint(self, step: int) -> Path:
        # Prompts of batches still in flight are not trained on yet: a resumed run draws them again. (The
        # replay buffer's contents are not saved: a resumed run starts with an empty buffer.)
        state = self.requests[0].sampler_state if self.requests else self.sampler.state()
        return self.run.get(self.learner.save_checkpoint(step, {"sampler": state}))

    # --- moving batches and weights -----------------------------------------------------------------------
    def request(self) -> None:
        """Ask the generator for the next rollout batch (it starts when its earlier calls are done)."""
        state, epoch = self.sampler.state(), self.sampler.epoch
        examples = self.sampler.next_batch(self.shape.prompts_per_rollout_batch)
        self.batch_counter += 1
        ref = self.generator.produce(examples, self.batch_counter, self.with_old_log_probs, 0, epoch)
        self.requests.append(Request(ref, state))

    def receive(self) -> tuple[RolloutData, float]:
        """The oldest requested batch, and how long the driver waited for it."""
        t0 = time.perf_counter()
        data = self.run.get(self.requests[0].ref)
        waited = time.perf_counter() - t0
        self.requests.pop(0)
        self.run.check_loads()  # a failed weight load (a WeightSyncError) now, rather than as a lag error later
        return data, waited

    def publish(self, version: int) -> float:
        """Put the learner's weights into the object store and queue their load on the generator; returns the
        seconds the learner spent on it (the generator's load time comes back with its next batch)."""
        weights, seconds = self.run.weights()
        self.run.loads.append(self.generator.load_weights(weights, version))
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
        learned, nonfinite_streak = self.run.get(self.learner.learn(data, step))
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
        learn_ref = self.learner.learn(batch, step)
        # While the learner trains, keep the generator busy and its batches flowing into the buffer.
        while True:
            ready, _ = self.run.ray.wait([learn_ref, *(r.ref for r in self.requests)], num_returns=1, fetch_local=False)
            if learn_ref in ready:
                break
            arrived += self.harvest()
        learned, nonfinite_streak = self.run.get(learn_ref)
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
            ready, _ = self.run.ray.wait([self.requests[0].ref], timeout=0, fetch_local=False)
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
        metrics, records, version = self.run.get(self.generator.evaluate(examples, self.sampler.epoch))
        if version != self.version:
            raise RuntimeError(f"evaluation ran on policy version {version}, not the learner's {self.version}")
        if on_generated is not None:
            on_generated(len(records))  # the actor cannot call back: the bar completes when the result arrives
        return metrics, records
