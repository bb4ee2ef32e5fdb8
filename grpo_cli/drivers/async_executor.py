"""sync=async: generators that never wait for training, and one learner, as Ray actors (docs/sync.md).

    generator(s)  rollout/async_generation.AsyncGeneration: a thread that keeps sampling the batches it was handed,
                  ships each group when it has ended, applies offered weights when it may
    learner       Learner: proximal log-probs at its own version -> decoupled PPO update -> publishes its weights

Each step (learner version V = step - 1 before it):

    on_stale=wait  the batches up to step + 1 + max_staleness are handed out (batch b to generator b mod N); the step
                   trains on batch `step`'s groups, in prompt order, waiting for its last one; the generators pace
                   themselves (a group of batch b starts only at version >= b - 1 - max_staleness).
    on_stale=drop  enough batches are handed out to keep max_staleness + 1 batches in flight; the step trains on the
                   first groups to end, dropping (and counting) those older than the bound.

Every trained sample is checked: V - (the oldest version among its tokens) <= max_staleness, or the run stops (an
orchestration bug must not bias training silently). Resume: a checkpoint holds the prompt sampler as it was before
the first prompt not trained yet, and under drop the prompts trained since (their groups are not sampled again) and
the batches closed behind an open one (drawn again for their seeds, not sampled); what was in flight is sampled
again after the resume, never trained twice, never skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_cli.batch.rollout_data import RolloutData
from grpo_cli.config import BatchShape
from grpo_cli.drivers.dynamic_sampling import combine_rollout_metrics
from grpo_cli.drivers.executor import finish_step_metrics, step_metrics
from grpo_cli.drivers.prompts import PromptSampler
from grpo_cli.drivers.ray_actors import AsyncGeneratorHandle
from grpo_cli.drivers.ray_run import RayRun
from grpo_cli.drivers.versions import staleness_check
from grpo_cli.rollout.async_generation import BatchOrder, FinishedGroup, join_groups
from grpo_cli.rollout.batch_statistics import trained_batch_advantages
from grpo_cli.tasks import Example

if TYPE_CHECKING:
    from grpo_cli.config.schemas import GRPOConfig

# How long one collect call waits on a generator before the driver looks at the others (and at their errors).
COLLECT_WAIT_S = 0.5
# How long every generator may be stalled (waiting, idle or held by the staleness bound, with every call the driver
# made on it landed and nothing done since) while a step waits for groups, before the run stops: only the driver
# could end that wait, and it is waiting for them.
STALL_S = 60.0


class AsyncExecutor:
    """The executor of a sync=async run (module docstring). It holds the run's actors and Ray (drivers/ray_run.RayRun,
    as the one_behind / replay_buffer executor does) and keeps only async's loop. `run`: the actors to drive (None:
    start them, RayRun.start)."""

    def __init__(
        self,
        cfg: GRPOConfig,
        output_dir: Path,
        sampler: PromptSampler,
        run: RayRun[AsyncGeneratorHandle] | None = None,
    ) -> None:
        self.cfg = cfg
        self.sampler = sampler
        self.shape = BatchShape.from_config(cfg)
        self.last_transcripts: list[dict[str, Any]] = []
        self.version = 0  # the learner's policy version
        self.batch_counter = 0  # batches handed out (their numbers are their sampling seeds)
        self.orders: dict[int, dict[str, Any]] = {}  # batch number -> {"state": sampler before it, "left": prompts}
        self.arrived: dict[int, list[FinishedGroup]] = {}  # wait: groups by batch, not trained yet
        self.ready: list[FinishedGroup] = []  # drop: groups in the order they ended, not trained yet
        self.trained_groups: dict[int, set[int]] = {}  # drop: per open batch, the prompt indices trained or dropped
        self.closed_batches: set[int] = set()  # drop: batches all trained or dropped (checkpoints keep the open ones')
        self.resume_closed: set[int] = set()  # drop: batches a resume draws but does not send (closed before it)
        self.resume_skips: dict[int, frozenset[int]] = {}  # drop: per batch a resume draws, its prompts trained before
        self.counters: dict[str, float] = {}
        self.dropped_stale = 0  # groups dropped past the bound (on_stale=drop), in all
        self.dropped_this_step = 0
        self.resumed_state: dict[str, Any] = {}
        if run is None:
            n = cfg.sync.generators
            actors = f"{'a generator' if n == 1 else f'{n} generators'} and a learner actor"
            run = RayRun.start(cfg, output_dir, sampler.examples, AsyncGeneratorHandle, n, actors)
        self.run = run
        self.learner = run.learner
        self.generators = run.generators
        self.device_text = run.device_text
        self.load_s = run.load_s

    @property
    def learner_version(self) -> int:
        return self.version

    # --- checkpoints ----------------------------------------------------------------------------------------
    def resume(self) -> tuple[int, dict[str, Any], list[str]]:
        step, state, messages = self.run.get(self.learner.resume())
        self.resumed_state = state
        return step, state, messages

    def save_checkpoint(self, step: int) -> Path:
        open_batches = sorted(b for b in self.orders if self.orders[b]["left"] > 0)
        first = open_batches[0] if open_batches else None
        state: dict[str, Any] = {"sampler": self.orders[first]["state"] if first is not None else self.sampler.state()}
        if self.cfg.sync.on_stale == "drop" and first is not None:
            state["async_first_batch"] = first
            state["async_trained"] = {str(b): sorted(self.trained_groups.get(b, ())) for b in open_batches}
            # Batches that closed behind an open one: a resume draws them again (their numbers are their seeds)
            # but trains none of their prompts.
            self.closed_batches = {b for b in self.closed_batches if b > first}
            state["async_closed"] = sorted(self.closed_batches)
        return self.run.get(self.learner.save_checkpoint(step, state))

    # --- weights, batches -----------------------------------------------------------------------------------
    def start(self, start_step: int) -> dict[str, float]:
        self.version = start_step
        # Batch numbers are sampling seeds: after a resume the batches not trained are drawn again with theirs.
        first = int(self.resumed_state.get("async_first_batch", start_step + 1))
        self.batch_counter = first - 1
        trained = self.resumed_state.get("async_trained", {})
        self.resume_skips = {int(b): frozenset(v) for b, v in trained.items()}
        self.resume_closed = {int(b) for b in self.resumed_state.get("async_closed", [])}
        self.closed_batches = set()
        return {"time/sync_s": self.publish(start_step)}

    def publish(self, version: int) -> float:
        """The learner's weights offered to every generator (each applies them when it may); returns the seconds the
        learner spent putting them into the object store."""
        weights, seconds = self.run.weights()
        self.run.loads += [generator.offer_weights(weights, version) for generator in self.generators]
        return seconds

    def hand_out(self, up_to: int) -> None:
        """Hand out batches until batch `up_to` has been (each to its generator, in order)."""
        while self.batch_counter < up_to:
            state, epoch = self.sampler.state(), self.sampler.epoch
            examples = self.sampler.next_batch(self.shape.prompts_per_rollout_batch)
            self.batch_counter += 1
            b = self.batch_counter
            if b in self.resume_closed:  # trained before the resume (it closed behind an open batch): drawn, not sent
                self.resume_closed.discard(b)
                self.closed_batches.add(b)
                continue
            skip = self.resume_skips.pop(b, frozenset())
            self.orders[b] = {"state": state, "left": len(examples) - len(skip)}
            if skip:
                self.trained_groups[b] = set(skip)
            generator = self.generators[b % len(self.generators)]
            self.run.loads.append(generator.submit(BatchOrder(b, examples, epoch, skip)))

    def gather(self, until: Callable[[], bool]) -> float:
        """Collect finished groups from every generator until `until()` holds; returns the seconds waited."""
        t0 = time.perf_counter()
        while True:
            self.run.check_loads()
            wait = 0.0 if until() else COLLECT_WAIT_S / len(self.generators)
            stalled = []
            for generator in self.generators:
                groups, counters, _version, stalled_for = self.run.get(generator.collect(wait))
                stalled.append(stalled_for)
                for key, value in counters.items():
                    self.counters[key] = self.counters.get(key, 0.0) + value
                for group in groups:
                    if self.cfg.sync.on_stale == "drop":
                        self.ready.append(group)
                    else:
                        self.arrived.setdefault(group.batch_number, []).append(group)
            if self.cfg.sync.on_stale == "drop":
                self._drop_stale()
            if until():
                return time.perf_counter() - t0
            self.run.check_loads()
            if not self.run.loads and min(stalled) > STALL_S:
                # Every hand-out and offer has landed, and no generator can sample anything (nothing is left, or the
                # bound holds what is left until weights this step has not trained yet): the step's groups cannot
                # come. An orchestration bug; stop with it rather than wait forever.
                raise RuntimeError(
                    f"the generators have had nothing they may sample for {min(stalled):.0f}s while the step waits for "
                    "groups that never came (sync=async's bookkeeping lost them)"
                )

    # --- the step -----------------------------------------------------------------------------------------------
    def step(self, step: int) -> tuple[dict[str, float], int]:
        step_start = time.perf_counter()
        self.dropped_this_step = 0
        sync, prompts = self.cfg.sync, self.shape.prompts_per_rollout_batch
        last = self.cfg.train.steps
        if sync.on_stale == "wait":
            # Up to the batch the next version may start: the generators' bound holds it until then (counted as
            # paced, not idle), and it starts the moment that version's weights arrive.
            self.hand_out(min(step + 1 + sync.max_staleness, last))
            waiting_s = self.gather(
                lambda: sum(len(g.prompt_indices) for g in self.arrived.get(step, ())) >= self.orders[step]["left"]
            )
            groups = sorted(self.arrived.pop(step), key=lambda g: g.prompt_indices[0])
        else:
            self.top_up()
            waiting_s = self.gather(lambda: self._fresh_groups() >= prompts)
            groups = self._take_fresh(prompts)
            self.top_up()
        for group in groups:
            self._mark_trained(group)
        batch = join_groups(groups)
        norm = self.cfg.normalization  # batch_std's scale: the trained batch's, not each group's (issue 57)
        batch.advantages = trained_batch_advantages(batch, self.shape.group_size, norm.advantage, norm.advantage_eps)
        if batch.token_versions is None:  # the generators always record them: a bug, never an unchecked step
            raise RuntimeError(f"step {step}'s batch carries no token versions: its lag cannot be checked")
        staleness = staleness_check(self.version, batch.token_versions, sync.max_staleness)
        learned, nonfinite_streak = self.run.get(self.learner.learn(batch, step))
        self.version = step
        sync_s = self.publish(step)
        counters, self.counters = self.counters, {}
        metrics = step_metrics(
            self._rollout_metrics(groups, counters),
            learned,
            {"time/step_s": time.perf_counter() - step_start, "time/waiting_s": waiting_s, "time/sync_s": sync_s},
            self._sync_metrics(batch, staleness, self.dropped_this_step, counters),
        )
        self.last_transcripts = [t for g in groups for t in g.data.transcripts or []]
        metrics = finish_step_metrics(metrics, batch.raw_rewards)
        # The generators' rate over their own clock: the groups trained now were sampled over several steps, so
        # the trained tokens over this step's generation time (add_throughput's) would mean nothing.
        generation_s = counters.get("generation_s", 0.0)
        metrics["throughput/generation_tokens_per_s"] = (
            counters.get("sampled_tokens", 0.0) / generation_s if generation_s > 0 else 0.0
        )
        return metrics, nonfinite_streak

    def top_up(self) -> None:
        """on_stale=drop: prompts handed out and neither trained nor dropped, at least max_staleness + 1 batches'
        worth (dropped groups are replaced by new prompts, so the run draws more than steps x batch)."""
        prompts = self.shape.prompts_per_rollout_batch
        while sum(order["left"] for order in self.orders.values()) < (self.cfg.sync.max_staleness + 1) * prompts:
            self.hand_out(self.batch_counter + 1)

    def _drop_stale(self) -> None:
        """on_stale=drop: groups past the bound never become fresh again (versions only grow): drop them now, so
        that their prompts are replaced while the step waits."""
        bound = self.version - self.cfg.sync.max_staleness
        stale = [g for g in self.ready if g.data.policy_version < bound]
        if stale:
            self.ready = [g for g in self.ready if g.data.policy_version >= bound]
            for group in stale:
                self._mark_trained(group)
            self.dropped_stale += len(stale)
            self.dropped_this_step += len(stale)
            self.top_up()

    def _fresh_groups(self) -> int:
        bound = self.version - self.cfg.sync.max_staleness
        return sum(1 for g in self.ready if g.data.policy_version >= bound)

    def _take_fresh(self, n: int) -> list[FinishedGroup]:
        """on_stale=drop: the first n groups to end (gather dropped the stale ones)."""
        taken, self.ready = self.ready[:n], self.ready[n:]
        return taken

    def _mark_trained(self, group: FinishedGroup) -> None:
        b = group.batch_number
        self.orders[b]["left"] -= len(group.prompt_indices)
        self.trained_groups.setdefault(b, set()).update(group.prompt_indices)
        if self.orders[b]["left"] == 0:
            # Nothing of it left in flight: a checkpoint remembers its number only (save_checkpoint).
            del self.orders[b]
            self.trained_groups.pop(b, None)
            self.closed_batches.add(b)

    def _rollout_metrics(self, groups: list[FinishedGroup], counters: dict[str, float]) -> dict[str, float]:
        rollout = combine_rollout_metrics([g.data for g in groups])  # as the one batch's: reward_std over all
        # The generators' own time (groups overlap one another: theirs is not a sum of the groups').
        rollout["time/generation_s"] = counters.get("generation_s", 0.0)
        rollout["time/produce_s"] = sum(counters.get(k, 0.0) for k in ("generation_s", "scoring_s", "update_s"))
        rollout["time/weight_load_s"] = counters.get("update_s", 0.0)
        # Rewards, advantages and (sync.proximal=behaviour) the old log-probs, on the generators.
        rollout["time/scoring_s"] = counters.get("scoring_s", 0.0)
        rollout["time/old_log_probs_s"] = 0.0
        return rollout

    def _sync_metrics(
        self, batch: RolloutData, staleness: dict[str, float], dropped: int, counters: dict[str, float]
    ) -> dict[str, float]:
        row_steps = counters.get("row_steps", 0.0)
        return {
            "sync/policy_version": float(batch.policy_version),
            "sync/lag": staleness["max"],
            "sync/lag_mean": staleness["mean"],
            "sync/staleness_token_mean": staleness["token_mean"],
            "sync/partial_frac": staleness["partial_frac"],
            "sync/version_span_mean": staleness["span_mean"],
            "sync/dropped_stale": float(dropped),
            "sync/dropped_stale_total": float(self.dropped_stale),
            "sync/updates_mid_generation": counters.get("updates_mid_generation", 0.0),
            "sync/wasted_row_steps": counters.get("wasted_row_steps", 0.0),
            "sync/wasted_row_frac": counters.get("wasted_row_steps", 0.0) / row_steps if row_steps else 0.0,
            "time/generator_idle_s": counters.get("idle_s", 0.0),
            "time/generator_paced_s": counters.get("paced_s", 0.0),
            "time/update_pause_s": counters.get("update_s", 0.0),
            "time/recompute_s": counters.get("recompute_s", 0.0),
        }

    # --- evaluation, shutdown -------------------------------------------------------------------------------
    def evaluate(
        self, examples: list[Example], on_generated: Callable[[int], None] | None
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        metrics, records, version = self.run.get(
            self.generators[0].evaluate(examples, self.sampler.epoch, self.version)
        )
        if version != self.version:
            raise RuntimeError(f"evaluation ran on policy version {version}, not the learner's {self.version}")
        if on_generated is not None:
            on_generated(len(records))
        return metrics, records

    def close(self) -> None:
        """Stop the generators (each first closes its loop and engine: its thread joins within 60 s), the learner
        and the local Ray."""
        self.run.close(generators_close_s=70)
