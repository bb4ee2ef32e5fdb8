"""The generator of sync=async: a thread that keeps sampling while the learner trains (docs/sync.md).

The driver (drivers/async_executor.py) hands it rollout batches in order (`submit`) and the learner's weights after
every step (`offer_weights`), and takes its finished groups (`collect`). Inside, one thread owns the model and the
engine:

- single-turn tasks run on a decode stream (engines/stream.py): each group's G rows join the running rows as soon
  as there is room (continuous batching) and the group ships, scored, as soon as its G rows have ended, so one long
  completion no longer holds the others;
- multi-turn tasks and agents run a batch at a time through the task's own run (rollout/runs.py); the engine they
  call applies a waiting update before each of its calls (between turns; the agent endpoint holds calls while it
  runs), so each turn's tokens carry the version that sampled them;
- `sync.lockstep`: each batch whole, by exactly version `batch - 1 - max_staleness`, through the very `produce` of
  the other strategies (a fixed schedule, for comparisons and tests).

The bound: a group of batch b is trained at learner version b - 1 (on_stale=wait: each step trains its own batch).
It may start only once the generator holds version >= b - 1 - max_staleness, and its tokens' versions never
decrease, so no trained sample lags more than max_staleness (the driver checks it again on every sample). With
on_stale=drop nothing is paced and the driver drops the groups past the bound.

Updates: with sync.partial_rollouts the newest offered weights are applied between two decode steps (the stream
recomputes or keeps the running rows' keys/values: sync.kv_after_update); without, an update waits until the running
rows have ended (no new group starts meanwhile), so every sample is one version's.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

import torch

from grpo_cli.batch.rollout_data import RolloutData, concat_rollouts, select_completions
from grpo_cli.config import BatchShape
from grpo_cli.engines.base import context_room, render_prompts
from grpo_cli.engines.decode import Decoder
from grpo_cli.engines.hf import HFRolloutEngine
from grpo_cli.engines.sampling import completion_seed
from grpo_cli.engines.stopping import decoded
from grpo_cli.engines.stream import DecodeStream, HFDecodeStream, StreamRow
from grpo_cli.errors import UserFacingError
from grpo_cli.models.runtime import limit_threads
from grpo_cli.rollout.async_parts import (
    BatchOrder,
    FinishedGroup,
    GeneratorCounters,
    Update,
    UpdatingEngine,
    counter_difference,
)
from grpo_cli.rollout.batch_statistics import combine_rollout_metrics, split_whole_batch_metrics
from grpo_cli.rollout.runs import OneTurnRun, Samples
from grpo_cli.rollout.worker import RolloutWorker, rollout_seed, sampling_settings
from grpo_cli.tasks import Example

if TYPE_CHECKING:
    from grpo_cli.config.rollout_schemas import HFRolloutConfig
    from grpo_cli.config.schemas import GRPOConfig

# How long the loop sleeps when it has nothing to do before it looks again (a submit or an offer wakes it earlier).
IDLE_POLL_S = 0.05
# The longest one engine call of the loop may take (a decode step of the stream, one call of a whole-batch run, a
# lockstep batch) before `collect` and `evaluate` stop the run: an engine that never returns must not hang it.
ENGINE_CALL_TIMEOUT_S = 1800.0
# The longest `evaluate` waits for its result in all (the running rows to drain, then the evaluation itself).
EVALUATE_TIMEOUT_S = 3600.0


@dataclass
class _Group:
    """A group in flight on the stream."""

    order: BatchOrder
    prompt_index: int
    example: Example
    rows: list[StreamRow]


class AsyncGeneration:
    """The generator actor's object (drivers/async_executor.py hosts it): a RolloutWorker and the loop thread."""

    def __init__(
        self, cfg: GRPOConfig, threads: int = 0, initial_weights: Callable[[torch.nn.Module], None] | None = None
    ) -> None:
        """`initial_weights`: loads the run's initial weights into the policy copy (init_from's: the driver's
        loader, as rollout/ does not import learner/); the loop samples nothing before the learner's first offer
        lands anyway (`holds_weights`)."""
        limit_threads(threads)
        self.cfg = cfg
        self.sync = cfg.sync
        self.shape = BatchShape.from_config(cfg)
        self.worker = RolloutWorker(cfg, None, None, threads)
        if initial_weights is not None:
            initial_weights(self.worker.model)
            self.worker.engine.sync_weights(version=0)
        # False until the learner's first offered weights are applied: before them the copy may hold other weights
        # than any version it could record (the base model after a resume, or under init_from).
        self.holds_weights = False
        self.busy: tuple[str, float] | None = None  # the engine call the loop is in, and since when
        self.cond = threading.Condition()
        self.orders: deque[BatchOrder] = deque()  # submitted, not all of whose groups have started
        self.next_group = 0  # within orders[0]: the next prompt index to start
        self.updates: list[Update] = []  # offered, not applied (in version order)
        self.floor_version: int | None = None
        self.offered = -1  # the newest version offered so far
        # Since when the loop has waited (idle, or held by the bound) with no submit, offer or evaluation arriving
        # and no work done: only the driver can end such a wait, so the driver reads it (collect) to tell a
        # deadlock from a wait (None: it worked, or something arrived, since it last waited).
        self.stalled_since: float | None = None
        self.waited_this_turn = False
        self.finished: list[FinishedGroup] = []
        self.counters = GeneratorCounters()
        self.eval_request: tuple[list[Example], float, int] | None = None
        self.eval_result: tuple[dict[str, float], list[dict[str, Any]], int] | None = None
        self.error: BaseException | None = None
        self.closed = False
        self.in_flight: list[_Group] = []
        self.whole_batches = self.sync.lockstep or not isinstance(self.worker.run, OneTurnRun)
        self.stream: DecodeStream | None = None if self.whole_batches else self._make_stream()
        if self.stream is None:
            self.whole_batches = True
        self.batch_engine = UpdatingEngine(self.worker.engine, self)
        self.thread = threading.Thread(target=self._loop, name="grpo-cli-generator", daemon=True)
        self.thread.start()

    # --- what the driver calls (any thread) ------------------------------------------------------------------
    def describe(self) -> str:
        return self.worker.describe()

    def check_prompts_fit(self, examples: list[Example]) -> None:
        self.worker.check_prompts_fit(examples)

    def submit(self, order: BatchOrder) -> None:
        with self.cond:
            # The actor takes calls on several threads, so two submits may arrive out of order: keep batch order.
            position = len(self.orders)
            while position > 0 and self.orders[position - 1].batch_number > order.batch_number:
                position -= 1
            if position == 0 and self.orders and self.next_group > 0:
                position = 1  # never ahead of the batch whose groups have started
            self.orders.insert(position, order)
            self.stalled_since = None
            self.cond.notify_all()

    def offer_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """The learner's weights of `version`; applied by the loop when it may (module docstring)."""
        with self.cond:
            self.stalled_since = None
            if self.floor_version is None:
                self.floor_version = version  # the run's first weights (the resumed checkpoint's after a resume)
            # Offers may arrive out of order too (several threads): keep them in version order, never one older than
            # the weights held.
            if version > self.worker.version or self.floor_version == version:
                update = Update(tensors, version)
                if self.sync.lockstep:  # each version is applied in turn
                    self.updates = sorted([*self.updates, update], key=lambda u: u.version)
                elif not self.updates or version > self.updates[-1].version:
                    self.updates = [update]  # only the newest matters
            self.offered = max(self.offered, version)
            self.cond.notify_all()

    def collect(self, timeout: float) -> tuple[list[FinishedGroup], dict[str, float], int, float]:
        """Groups finished since the last call (waiting up to `timeout` seconds for one), the generator's counters
        since then, the version it holds, and for how long it has been stalled: waiting (with nothing to do, or held
        by the staleness bound) with nothing arriving and no work done (0 while it works). Raises what stopped the
        loop."""
        deadline = time.perf_counter() + timeout
        with self.cond:
            while not self.finished and self.error is None and not self.closed:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self.cond.wait(left)
            if self.error is not None:
                raise self.error
            self._check_engine_call()
            groups, self.finished = self.finished, []
            counters, self.counters = self.counters, GeneratorCounters()
            stalled_for = 0.0 if self.stalled_since is None else time.perf_counter() - self.stalled_since
            return groups, vars(counters).copy(), self.worker.version, stalled_for

    def evaluate(
        self, examples: list[Example], epoch: float, version: int
    ) -> tuple[dict[str, float], list[dict[str, Any]], int]:
        """Held-out evaluation by the weights of `version` (the learner's, offered already): the loop runs it
        between two steps of its own, once the running rows allow (a stream that cannot be set aside is drained
        first)."""
        deadline = time.perf_counter() + EVALUATE_TIMEOUT_S
        with self.cond:
            self.stalled_since = None
            self.eval_request = (examples, epoch, version)
            self.eval_result = None
            self.cond.notify_all()
            while self.eval_result is None and self.error is None:
                self._check_engine_call()
                if time.perf_counter() > deadline:
                    raise UserFacingError(
                        f"the held-out evaluation of version {version} did not finish within {EVALUATE_TIMEOUT_S:.0f}s "
                        "(grpo_cli.rollout.async_generation.EVALUATE_TIMEOUT_S): use fewer eval examples "
                        "(eval.*) or a smaller rollout.max_tokens"
                    )
                self.cond.wait(1.0)
            if self.error is not None:
                raise self.error
            result, self.eval_result = self.eval_result, None
            return result

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.thread.join(timeout=60)
        close_stream = getattr(self.stream, "close", None)  # vLLM's: abort the requests still in its engine
        if close_stream is not None:
            close_stream()
        self.worker.close()

    @contextmanager
    def engine_call(self, what: str) -> Iterator[None]:
        """Marks the loop as inside one engine call (`what`), for `_check_engine_call`."""
        with self.cond:
            self.busy = (what, time.perf_counter())
        try:
            yield
        finally:
            with self.cond:
                self.busy = None

    def _check_engine_call(self) -> None:
        """Raises when the loop has been inside one engine call for longer than ENGINE_CALL_TIMEOUT_S (the caller
        holds the lock): a hung engine stops the run in one line instead of hanging it."""
        if self.busy is not None and time.perf_counter() - self.busy[1] > ENGINE_CALL_TIMEOUT_S:
            raise UserFacingError(
                f"the generator's engine has not returned from {self.busy[0]} for "
                f"{time.perf_counter() - self.busy[1]:.0f}s (grpo_cli.rollout.async_generation.ENGINE_CALL_TIMEOUT_S): "
                "the engine hangs; check its device and logs, or use sync=one_behind"
            )

    def _count(self, **amounts: float) -> None:
        """Add to the counters under the lock `collect` swaps them under (a count never lands in a swapped-out
        object)."""
        with self.cond:
            for name, amount in amounts.items():
                setattr(self.counters, name, getattr(self.counters, name) + amount)

    # --- the loop (its own thread: the only one that touches the model and the engine) ----------------------
    def _loop(self) -> None:
        try:
            while True:
                with self.cond:
                    if self.closed:
                        return
                self.waited_this_turn = False
                if self.eval_request is not None and self._may_evaluate():
                    self._run_evaluation()
                elif self.whole_batches:
                    self._whole_batch_turn()
                else:
                    self._stream_turn()
                if not self.waited_this_turn:
                    with self.cond:
                        self.stalled_since = None  # it worked (or will, next turn)
        except BaseException as error:  # noqa: BLE001 - handed to the driver, which raises it
            with self.cond:
                self.error = error
                self.cond.notify_all()

    def _wait(self, counter: str) -> None:
        """Nothing to do now: sleep until a submit, an offer or IDLE_POLL_S, the time counted under `counter`."""
        started = time.perf_counter()
        self.waited_this_turn = True
        with self.cond:
            if self.stalled_since is None:
                self.stalled_since = started
            if not self.closed:
                self.cond.wait(IDLE_POLL_S)
        self._count(**{counter: time.perf_counter() - started})

    def _bound_allows(self, batch_number: int) -> bool:
        """Whether a group of batch `batch_number` may start now: it will be trained at version batch_number - 1,
        and its first token's version is the one held now (on_stale=drop: always)."""
        if self.sync.on_stale == "drop":
            return True
        return self.worker.version >= batch_number - 1 - self.sync.max_staleness

    def _apply(self, update: Update) -> None:
        started = time.perf_counter()
        if self.stream is not None and not self.whole_batches:
            self.worker.copy_weights(update.tensors)
            self.worker.version = update.version
            if self.stream.running():
                self._count(updates_mid_generation=1)
            self.stream.updated(update.version, self.sync.kv_after_update)
        else:
            self.worker.load_weights(update.tensors, update.version)
            self.worker.load_s = 0.0  # counted here, not in the next batch's produce time
        self.holds_weights = True
        self._count(update_s=time.perf_counter() - started)

    def _take_update(self, newest_allowed: int | None = None) -> Update | None:
        with self.cond:
            usable = [u for u in self.updates if newest_allowed is None or u.version <= newest_allowed]
            if not usable:
                return None
            update = usable[-1]
            self.updates = [u for u in self.updates if u.version > update.version]
            return update

    # whole batches ---------------------------------------------------------------------------------------------
    def between_calls(self) -> None:
        """Before each engine call of a whole-batch run: a waiting update lands here with partial rollouts."""
        if self.sync.partial_rollouts:
            update = self._take_update()
            if update is not None:
                self._count(updates_mid_generation=1)
                self._apply(update)

    def _whole_batch_turn(self) -> None:
        with self.cond:
            order = self.orders[0] if self.orders else None
        if order is None:
            update = None if self.sync.lockstep else self._take_update()
            if update is not None:
                self._apply(update)
            else:
                self._wait("idle_s")
            return
        # lockstep: exactly version batch - 1 - max_staleness, or the run's first weights before it exists (each
        # offered version is kept until its batch); otherwise the newest.
        exact = max(order.batch_number - 1 - self.sync.max_staleness, self.floor_version or 0)
        update = self._take_update(exact if self.sync.lockstep else None)
        if update is not None:
            self._apply(update)
        if not self.holds_weights or not self._bound_allows(order.batch_number):
            self._wait("paced_s")
            return
        if self.sync.lockstep and self.worker.version != exact:
            self._wait("paced_s")
            return
        with self.cond:
            if self.orders[0] is not order:
                # An earlier batch's submit landed ahead of it meanwhile (the actor takes calls on several threads):
                # that one goes first, next turn. Taking the front here would drop it and sample `order` twice.
                return
            self.orders.popleft()
        self._sample_batch(order)

    def _sample_batch(self, order: BatchOrder) -> None:
        started = time.perf_counter()
        indices = [i for i in range(len(order.examples)) if i not in order.skip]
        examples = [order.examples[i] for i in indices]
        worker, version = self.worker, self.worker.version
        with_old = self.sync.proximal == "behaviour" and not self.sync.partial_rollouts
        if self.sync.lockstep:  # the very produce of the other strategies
            with self.engine_call("a lockstep batch"):
                data = worker.produce(examples, order.batch_number, with_old, 0, order.epoch)
            group_metrics = split_whole_batch_metrics(data.metrics, len(indices))  # scored whole
        else:
            cfg = self.cfg
            timings: dict[str, float] = {}
            with worker.autocast():
                sampling = sampling_settings(
                    cfg, self.shape.group_size, seed=rollout_seed(cfg.seed, order.batch_number)
                )
                samples = worker.run.sample(self.batch_engine, sampling, examples)
            timings["time/generation_s"] = time.perf_counter() - started
            parts = worker.scored_groups(samples, timings, started, with_old, order.epoch)
            data, group_metrics = concat_rollouts(parts), [p.metrics for p in parts]  # each group's own metrics
            data.metrics = combine_rollout_metrics(parts)  # the batch's, for the counters
        if data.token_versions is None:  # the run recorded no version: exact only if no update landed meanwhile
            if self.worker.version != version:
                raise UserFacingError(
                    f"batch {order.batch_number} was sampled by versions {version} to {self.worker.version}, but its "
                    "run recorded no version per token (its behaviour policy is unknown): use "
                    "sync.partial_rollouts=false"
                )
            data.token_versions = [[version] * len(ids) for ids in data.completion_ids]
        self._behaviour_as_old(data)
        self._count(
            generation_s=data.metrics.get("time/generation_s", 0.0),
            sampled_tokens=int(data.metrics.get("n_tokens", 0.0)),
            scoring_s=data.metrics.get("time/scoring_s", 0.0) + data.metrics.get("time/old_log_probs_s", 0.0),
            groups=len(indices),
        )
        g = self.shape.group_size
        for k, index in enumerate(indices):  # one group at a time, as the stream ships them
            group = select_completions(data, list(range(k * g, (k + 1) * g)))
            group.metrics = group_metrics[k]
            self._ship(FinishedGroup(order.batch_number, [index], group))

    def _behaviour_as_old(self, data: RolloutData) -> None:
        """sync.proximal=behaviour with partial rollouts: the sampler's own log-probs are the old policy's (no
        single version could score the sample)."""
        if self.sync.proximal == "behaviour" and self.sync.partial_rollouts:
            if data.sampler_log_probs is None:
                raise UserFacingError(
                    "sync.proximal=behaviour with sync.partial_rollouts=true needs the sampler's log-probs, which the "
                    "engine did not return: use sync.partial_rollouts=false"
                )
            data.old_log_probs = [lp.clone() for lp in data.sampler_log_probs]

    def _ship(self, group: FinishedGroup) -> None:
        with self.cond:
            self.finished.append(group)
            self.cond.notify_all()

    # the stream ------------------------------------------------------------------------------------------------
    def _make_stream(self) -> DecodeStream | None:
        """The engine's decode stream, or None where it has none (the whole-batch path then serves)."""
        engine, cfg = self.worker.engine, self.cfg
        capacity = self.sync.decode_rows or cfg.train.rollout_batch_size
        settings = sampling_settings(cfg, self.shape.group_size, seed=0)
        if isinstance(engine, HFRolloutEngine) and isinstance(engine.decoder, Decoder):
            self.worker.model.eval()  # the generator's copy never trains: no dropout while sampling
            # Its own Decoder: its caches are the stream's, never an evaluation's.
            decoder = Decoder(
                engine.model,
                engine.tokenizer,
                engine.eos_ids,
                compile_setting=cast("HFRolloutConfig", cfg.rollout).compile,
            )
            return HFDecodeStream(decoder, settings, capacity, version=self.worker.version)
        if cfg.rollout.engine == "vllm":
            from grpo_cli.engines.vllm_engine import VLLMRolloutEngine  # vLLM is an optional extra
            from grpo_cli.engines.vllm_stream import VLLMDecodeStream

            if isinstance(engine, VLLMRolloutEngine):
                return VLLMDecodeStream(engine, settings, capacity, version=self.worker.version)
        if self.sync.partial_rollouts:
            raise UserFacingError(
                "sync.partial_rollouts=true needs the decode loop, which does not run this model (see the "
                "rollout: line above): use sync.partial_rollouts=false"
            )
        return None

    def _stream_turn(self) -> None:
        stream = self.stream
        assert stream is not None
        pending_update = bool(self.updates)
        if pending_update and (self.sync.partial_rollouts or stream.running() == 0):
            update = self._take_update()
            if update is not None:
                self._apply(update)
                pending_update = False
        # Without partial rollouts a waiting update holds new groups back, so the running ones end and it lands.
        paced = False
        if not (pending_update and not self.sync.partial_rollouts) and self.eval_request is None:
            paced = self._admit(stream)
        if stream.running() == 0:
            self._wait("paced_s" if paced else "idle_s")
            return
        before = replace(stream.counters)
        with self.worker.autocast(), self.engine_call("a decode step"):
            ended = stream.step()
        with self.cond:
            self.counters.add_stream(counter_difference(stream.counters, before))
        for row in ended:
            self._row_ended(row)

    def _admit(self, stream: DecodeStream) -> bool:
        """Start groups while the stream has room and the bound allows; True when the bound held one back."""
        g = self.shape.group_size
        while stream.room() >= g:
            with self.cond:
                while self.orders and self.next_group >= len(self.orders[0].examples):
                    self.orders.popleft()
                    self.next_group = 0
                if not self.orders:
                    return False
                order = self.orders[0]
                index = self.next_group
                if index in order.skip:
                    self.next_group += 1
                    continue
                if not self.holds_weights or not self._bound_allows(order.batch_number):
                    return True  # the first weights, or the bound, hold it back
                self.next_group += 1
            stream.add(self._group_rows(order, index))
        return False

    def _group_rows(self, order: BatchOrder, index: int) -> list[StreamRow]:
        example = order.examples[index]
        prompt_ids = render_prompts([example.prompt], self.worker.tokenizer)[0]
        engine = self.worker.engine
        if isinstance(engine, HFRolloutEngine) and not engine.decode_loop_checked:
            problem = engine.check_decode_loop([prompt_ids])
            if problem is not None:
                raise UserFacingError(
                    f"sync=async samples with the decode loop, which disagrees with generate() on this model "
                    f"({problem}): use sync=one_behind"
                )
        room = context_room([prompt_ids], self.cfg.rollout.max_tokens, self.worker.engine.context_length)[0]
        seed = rollout_seed(self.cfg.seed, order.batch_number)
        rows = [
            StreamRow(
                key=(order.batch_number, index, j),
                prompt_ids=list(prompt_ids),
                max_tokens=room,
                seed=completion_seed(seed, index, j),
                context_limited=room < self.cfg.rollout.max_tokens,
            )
            for j in range(self.shape.group_size)
        ]
        group = _Group(order, index, example, rows)
        self.in_flight.append(group)
        if room == 0:  # the prompt fills the context: nothing to sample (check_prompts_fit refuses it first)
            for row in rows:
                row.ended = True
            self._maybe_finish(group)
        return rows

    def _row_ended(self, row: StreamRow) -> None:
        for group in self.in_flight:
            if group.order.batch_number == row.key[0] and group.prompt_index == row.key[1]:
                self._maybe_finish(group)
                return

    def _maybe_finish(self, group: _Group) -> None:
        if not all(row.ended for row in group.rows):
            return
        self.in_flight.remove(group)
        started = time.perf_counter()
        tokenizer = self.worker.tokenizer
        rows = group.rows
        samples = Samples(
            prompt_ids=[row.prompt_ids for row in rows],
            completion_ids=[row.token_ids for row in rows],
            responses=[decoded(tokenizer, row.token_ids, skip_special_tokens=True) for row in rows],
            ground_truths=[group.example.ground_truth] * len(rows),
            truncated=[not row.stopped for row in rows],
            model_tokens=[len(row.token_ids) for row in rows],
            context_limited=[row.context_limited and not row.stopped for row in rows],
            sampler_log_probs=[row.log_probs for row in rows],
            token_versions=[row.versions for row in rows],
        )
        with_old = self.sync.proximal == "behaviour" and not self.sync.partial_rollouts
        data = self.worker.scored(samples, {"time/generation_s": 0.0}, started, with_old, group.order.epoch)
        self._behaviour_as_old(data)
        self._count(scoring_s=time.perf_counter() - started, groups=1)
        self._ship(FinishedGroup(group.order.batch_number, [group.prompt_index], data))

    # evaluation ------------------------------------------------------------------------------------------------
    def _may_evaluate(self) -> bool:
        """Once the weights to evaluate were offered, between two steps of the loop; a stream that cannot be set
        aside has no running row (none start while an evaluation waits); under lockstep no batch waits for an
        older version than the evaluated one."""
        assert self.eval_request is not None
        version = self.eval_request[2]
        if self.offered < version:  # its weights' offer is still on its way (another thread)
            return False
        k = self.sync.max_staleness
        if self.sync.lockstep and any(order.batch_number - 1 - k < version for order in self.orders):
            return False
        if self.whole_batches or self.stream is None or self.stream.running() == 0:
            return True
        return bool(getattr(self.stream, "suspendable", False)) and self.sync.partial_rollouts

    def _run_evaluation(self) -> None:
        assert self.eval_request is not None
        examples, epoch, version = self.eval_request
        update = self._take_update(version)
        if update is not None:
            self._apply(update)
        if self.worker.version != version:
            raise RuntimeError(
                f"evaluation asked for policy version {version}, the generator holds {self.worker.version}"
            )
        result = self.worker.evaluate(examples, None, epoch)  # as long as it takes: evaluate's own timeout
        with self.cond:
            self.eval_request = None
            self.eval_result = result
            self.cond.notify_all()


def join_groups(groups: Sequence[FinishedGroup]) -> RolloutData:
    """One training batch of finished groups, in order (batch_std's scale is set by rollout/batch_statistics)."""
    return concat_rollouts([g.data for g in groups])
