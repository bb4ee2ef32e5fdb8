"""sync=async in-process (rollout/async_generation.py, drivers/versions.py): the staleness bound under random update
timings, the batch a step trains, the hard check, the episodes' versions, the config's refusals. The Ray runs are in
tests/e2e/test_async_e2e.py."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo_cli.config import validate_config
from grpo_cli.drivers.async_executor import AsyncExecutor
from grpo_cli.drivers.prompts import PromptSampler
from grpo_cli.drivers.ray_actors import AsyncGeneratorHandle, LearnerHandle
from grpo_cli.drivers.ray_run import RayRun
from grpo_cli.drivers.versions import staleness_check
from grpo_cli.errors import UserFacingError
from grpo_cli.rollout.async_generation import AsyncGeneration, BatchOrder, FinishedGroup
from grpo_cli.tasks import load_examples
from tests.conftest import compose_config
from tests.e2e.test_multiturn_e2e import ENVIRONMENT
from tests.unit.engines.test_stream import one_row_log_probs

ASYNC = ["debug=smoke", "sync=async", "loss=grpo_clip", "model.mixed_precision=no"]


# --- the check --------------------------------------------------------------------------------------------------


def test_the_check_measures_each_samples_oldest_token_and_refuses_past_the_bound():
    stats = staleness_check(5, [[3, 3, 4], [5, 5], [4, -1, -1, 5]], max_lag=2)
    assert stats["max"] == 2 and stats["mean"] == pytest.approx((2 + 0 + 1) / 3)
    assert stats["token_mean"] == pytest.approx((2 + 2 + 1 + 0 + 0 + 1 + 0) / 7)  # -1: environment tokens, none
    assert stats["partial_frac"] == pytest.approx(2 / 3) and stats["span_mean"] == 1.0
    with pytest.raises(RuntimeError, match="lag 3 exceeds 2"):
        staleness_check(5, [[2, 5]], max_lag=2)
    with pytest.raises(RuntimeError, match="decrease"):
        staleness_check(5, [[4, 3]], max_lag=2)
    with pytest.raises(ValueError, match="ahead"):
        staleness_check(5, [[6]], max_lag=2)


# --- the bound under random timings -------------------------------------------------------------------------------


def weights_of(generation: AsyncGeneration, version: int, base: dict[str, torch.Tensor] | None = None):
    """Version `version`'s weights: the generator's initial ones (`base`, default its current ones) moved by seeded
    noise per version (version 0: unchanged), enough that each version's log-probs differ."""
    base = base or {n: p.detach().clone() for n, p in generation.worker.model.named_parameters()}
    g = torch.Generator().manual_seed(version)
    return {n: p + (0.05 * torch.randn(p.shape, generator=g) if version else 0.0) for n, p in base.items()}


def drive(overrides: list[str], steps: int, seed: int) -> list[tuple[int, list[FinishedGroup]]]:
    """A learner that takes random time per step, offers arriving after random delays (from other threads, as
    the actor receives them), batches handed out as the executor does (up to step + max_staleness): returns what
    each step trained."""
    rng = random.Random(seed)
    cfg = compose_config([*ASYNC, "rollout.max_tokens=16", *overrides])
    validate_config(cfg)
    k = cfg.sync.max_staleness
    generation = AsyncGeneration(cfg)
    sampler = PromptSampler(load_examples(cfg.task, "train"), seed=cfg.seed)
    handed = 0
    trained = []
    arrived: dict[int, list[FinishedGroup]] = {}
    try:
        generation.offer_weights(weights_of(generation, 0), 0)

        def hand_out(up_to: int) -> None:
            nonlocal handed
            while handed < min(up_to, steps):
                handed += 1
                generation.submit(BatchOrder(handed, sampler.next_batch(2)))

        hand_out(1 + k)
        for step in range(1, steps + 1):
            while sum(len(g.prompt_indices) for g in arrived.get(step, ())) < 2:
                groups, _counters, _version, _idle = generation.collect(0.2)
                for g in groups:
                    arrived.setdefault(g.batch_number, []).append(g)
            trained.append((step, arrived.pop(step)))
            time.sleep(rng.uniform(0.0, 0.15))  # the learner's update
            delay = rng.uniform(0.0, 0.2)
            threading.Timer(delay, generation.offer_weights, (weights_of(generation, step), step)).start()
            hand_out(step + 1 + k)
    finally:
        generation.close()
    return trained


@pytest.mark.parametrize(
    ("overrides", "seed"),
    [
        (["sync.max_staleness=1"], 0),
        (["sync.max_staleness=2", "sync.partial_rollouts=true"], 1),
        (["sync.max_staleness=1", "sync.partial_rollouts=true", "sync.kv_after_update=keep", "sync.decode_rows=2"], 2),
    ],
)
def test_random_update_timings_never_take_a_sample_past_the_bound(overrides, seed):
    k = int(overrides[0].split("=")[1])
    trained = drive(overrides, steps=6, seed=seed)
    lags = []
    for step, groups in trained:
        assert sorted(g.prompt_indices[0] for g in groups) == [0, 1]  # the step trains its own batch, whole
        versions = [v for g in groups for v in g.data.token_versions]
        stats = staleness_check(step - 1, versions, max_lag=k)  # raises past the bound
        lags.append(stats["max"])
    assert max(lags) <= k


def test_the_lockstep_schedule_samples_batch_b_with_exactly_version_b_minus_1_minus_k():
    trained = drive(["sync.max_staleness=1", "sync.lockstep=true"], steps=4, seed=3)
    for step, groups in trained:
        for group in groups:
            versions = {v for row in group.data.token_versions for v in row}
            assert versions == {max(0, step - 2)}


# --- episodes -------------------------------------------------------------------------------------------------


def test_an_episodes_turns_carry_the_version_of_the_weights_that_sampled_them_and_its_tools_none(tmp_path):
    (tmp_path / "parity_env.py").write_text(ENVIRONMENT)
    cfg = compose_config(
        [
            *ASYNC,
            "task=guess_number",
            f"task.environment={tmp_path / 'parity_env.py'}:Parity",
            "task.max_turns=3",
            "rollout.max_tokens=6",
            "sync.partial_rollouts=true",
        ]
    )
    generation = AsyncGeneration(cfg)
    initial = weights_of(generation, 0)
    try:
        assert generation.whole_batches
        engine = generation.batch_engine
        calls = []
        real = engine._engine.generate

        def generate_then_offer(prompt_ids, settings):
            batch = real(prompt_ids, settings)
            calls.append(engine.policy_version)
            if len(calls) == 1:  # an update arrives after the first turn
                generation.offer_weights(weights_of(generation, 1, initial), 1)
            return batch

        engine._engine.generate = generate_then_offer
        sampler = PromptSampler(load_examples(cfg.task, "train"), seed=0)
        generation.offer_weights(initial, 0)
        generation.submit(BatchOrder(1, sampler.next_batch(2)))
        groups: list[FinishedGroup] = []
        while len(groups) < 2:
            groups += generation.collect(1.0)[0]
    finally:
        generation.close()
    assert calls == [0, 1]  # two turns: the second sampled by the update that arrived after the first
    for group in groups:
        data = group.data
        for versions, mask in zip(data.token_versions, data.token_masks, strict=True):
            for version, is_model in zip(versions, mask.tolist(), strict=True):
                assert (version >= 0) == bool(is_model)  # environment tokens carry none
            sampled = [v for v in versions if v >= 0]
            assert sampled == sorted(sampled) and set(sampled) == {0, 1}
    # Each model token's recorded log-prob is its log-prob under the weights of the version it records, by an
    # unpadded one-row forward (the episode's environment tokens are context there, never scored).
    model = generation.worker.model
    under: dict[int, list[list[float]]] = {}
    rows = [(g.data.prompt_ids[r], g.data.completion_ids[r]) for g in groups for r in range(len(g.data.prompt_ids))]
    for version in (0, 1):
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                parameter.copy_(weights_of(generation, version, initial)[name])
        under[version] = [one_row_log_probs(model, p, c, cfg.rollout.temperature) for p, c in rows]
    recorded = [
        (g.data.token_versions[r], g.data.sampler_log_probs[r]) for g in groups for r in range(len(g.data.prompt_ids))
    ]
    checked = 0
    for row, (versions, log_probs) in enumerate(recorded):
        for t, version in enumerate(versions):
            if version >= 0:
                assert log_probs[t].item() == pytest.approx(under[version][row][t], abs=1e-5), (row, t, version)
                checked += 1
    assert checked > 10


def test_an_earlier_batch_submitted_while_the_loop_picks_a_later_one_is_sampled_once_and_first(tmp_path):
    """The actor takes submits on several threads, so batch 1's may land after batch 3's, while the loop has picked
    batch 3 and not yet taken it. It used to take the deque's front then, which by then was batch 1: batch 1 was
    never sampled and batch 3 twice, and the driver waited for batch 1 for ever (seen as a resumed async run that
    hung in tests/e2e/test_async_e2e.py)."""
    (tmp_path / "parity_env.py").write_text(ENVIRONMENT)
    overrides = [f"task.environment={tmp_path / 'parity_env.py'}:Parity", "task.max_turns=2", "rollout.max_tokens=4"]
    cfg = compose_config([*ASYNC, "task=guess_number", "sync.max_staleness=2", *overrides])
    generation = AsyncGeneration(cfg)
    sampler = PromptSampler(load_examples(cfg.task, "train"), seed=0)
    orders = [BatchOrder(b, sampler.next_batch(2)) for b in (1, 2, 3)]
    real = generation._take_update
    late_submits = []

    def take_update_while_batches_1_and_2_arrive(newest_allowed=None):
        # Called by the loop between picking orders[0] and taking it: the late submits land exactly there.
        if not late_submits and generation.orders and generation.orders[0].batch_number == 3:
            late_submits.append(True)
            generation.submit(orders[0])
            generation.submit(orders[1])
        return real(newest_allowed)

    generation._take_update = take_update_while_batches_1_and_2_arrive
    sampled: list[int] = []
    try:
        assert generation.whole_batches
        generation.offer_weights(weights_of(generation, 0), 0)
        generation.submit(orders[2])
        deadline = time.monotonic() + 120
        while len(sampled) < 6 and time.monotonic() < deadline:
            sampled += [g.batch_number for g in generation.collect(1.0)[0]]
        sampled += [g.batch_number for g in generation.collect(2.0)[0]]  # a batch sampled twice shows here
    finally:
        generation.close()
    assert late_submits
    assert sampled == [1, 1, 2, 2, 3, 3]  # each batch's two groups once, in batch order


def test_a_generator_held_by_the_bound_reports_itself_stalled_until_something_arrives():
    """Held by the staleness bound (batch 3 needs version 1; it holds 0), the generator can do nothing until the
    driver offers weights: collect says for how long (it said 0 while orders were queued, so the driver's stall
    guard never fired for a paced generator and such a deadlock hung the run); an offer ends it."""
    cfg = compose_config([*ASYNC, "sync.max_staleness=1", "rollout.max_tokens=4"])
    generation = AsyncGeneration(cfg)
    sampler = PromptSampler(load_examples(cfg.task, "train"), seed=0)
    try:
        generation.offer_weights(weights_of(generation, 0), 0)
        generation.submit(BatchOrder(3, sampler.next_batch(2)))
        time.sleep(1.5)
        groups, counters, version, stalled_for = generation.collect(0.0)
        assert groups == [] and version == 0 and counters["paced_s"] > 0
        assert stalled_for >= 1.0
        generation.offer_weights(weights_of(generation, 1), 1)
        assert generation.collect(0.0)[3] < 0.5  # the offer arrived: not stalled, whatever it does next
        deadline = time.monotonic() + 120
        sampled: list[int] = []
        while len(sampled) < 2 and time.monotonic() < deadline:
            sampled += [g.batch_number for g in generation.collect(1.0)[0]]
        assert sampled == [3, 3]
    finally:
        generation.close()


# --- the config ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["loss=reinforce_with_baseline"], "sync=async trains on samples up to"),
        (["sync.max_staleness=0"], "needs at least 1"),
        (["sync.partial_rollouts=true", "rollout.decoder=generate"], "generate()"),
        (["sync.lockstep=true", "sync.partial_rollouts=true"], "lockstep"),
        (["train.dynamic_sampling=true"], "dynamic_sampling"),
    ],
)
def test_the_config_refuses_what_async_cannot_do_in_one_line(overrides, message):
    cfg = compose_config([*ASYNC, *overrides])
    with pytest.raises(UserFacingError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        validate_config(cfg)
    assert "\n" not in str(error.value)


def test_async_only_keys_are_refused_under_other_strategies():
    cfg = compose_config(["debug=smoke", "sync=one_behind", "loss=grpo_clip", "sync.partial_rollouts=true"])
    with pytest.raises(UserFacingError, match="sync.partial_rollouts=true acts only under sync=async"):
        validate_config(cfg)


# --- the driver's resume bookkeeping ------------------------------------------------------------------------------


class FakeActor:
    """Stands in for a Ray actor handle without Ray: records each call `actor.<method>.remote(*args)` as
    (method, *args) and answers it with `answer` (by default the call itself)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        return SimpleNamespace(remote=lambda *args: self.record(method, *args))

    def record(self, method: str, *args):
        self.calls.append((method, *args))
        return self.answer(method, *args)

    def answer(self, method: str, *args):
        return (method, *args)


RAY_ERRORS = ("RayTaskError", "RayActorError", "ObjectLostError")


class FakeRay:
    """The ray module as a RayRun without Ray uses it: a result is the fake actor's answer itself."""

    exceptions = SimpleNamespace(**{name: type(name, (Exception,), {}) for name in RAY_ERRORS})

    @staticmethod
    def get(ref, timeout=None):
        return ref

    @staticmethod
    def wait(refs, **kwargs):
        return refs, []

    @staticmethod
    def kill(actor) -> None:
        actor.calls.append(("killed",))


def bare_executor(cfg, sampler: PromptSampler, state: dict, learner=None, generators=None) -> AsyncExecutor:
    """An AsyncExecutor without Ray: its bookkeeping, driving actors that record their calls."""
    actors = generators if generators is not None else [FakeActor()]
    handles = [AsyncGeneratorHandle(actor) for actor in actors]
    run = RayRun(FakeRay, Path("unused"), LearnerHandle(learner if learner is not None else FakeActor()), handles)
    executor = AsyncExecutor(cfg, Path("unused"), sampler, run)
    executor.resumed_state = state
    return executor


def submitted(executor: AsyncExecutor) -> list[BatchOrder]:
    return [call[1] for call in executor.generators[0].actor.calls if call[0] == "submit"]


def test_drop_resume_samples_again_exactly_the_prompts_not_trained_with_their_batch_numbers():
    cfg = compose_config([*ASYNC, "sync.on_stale=drop", "sync.max_staleness=1"])
    examples = load_examples(cfg.task, "train")
    before = bare_executor(cfg, PromptSampler(examples, seed=0), {})
    before.start(0)
    before.top_up()  # (k + 1) batches in flight
    orders = submitted(before)
    assert [o.batch_number for o in orders] == [1, 2]
    # Groups end out of order: batch 2's prompt 1, then batch 1's prompt 0, are trained (or dropped)
    for batch, prompt in ((2, 1), (1, 0)):
        group = FinishedGroup(batch, [prompt], None)  # type: ignore[arg-type]
        before._mark_trained(group)
    state = before.save_checkpoint(3)[2]
    assert state["async_first_batch"] == 1 and state["async_trained"] == {"1": [0], "2": [1]}

    resumed_sampler = PromptSampler(examples, seed=0)
    resumed_sampler.load_state(state["sampler"])
    after = bare_executor(cfg, resumed_sampler, state)
    after.start(3)
    after.top_up()
    again = submitted(after)
    assert [o.batch_number for o in again[:2]] == [1, 2]  # the same batch numbers: the same sampling seeds
    assert [o.skip for o in again[:2]] == [frozenset({0}), frozenset({1})]
    for old, new in zip(orders, again[:2], strict=True):
        assert [e.prompt for e in new.examples] == [e.prompt for e in old.examples]
    left = {o.batch_number: [i for i in range(len(o.examples)) if i not in o.skip] for o in again[:2]}
    assert left == {1: [1], 2: [0]}  # exactly the prompts not trained before the kill


# --- the driver's stall guard ---------------------------------------------------------------------------------


class StalledGenerator(FakeActor):
    """A generator whose every collect says it has been stalled for `stalled_for` seconds, with no groups."""

    def __init__(self, stalled_for: float) -> None:
        super().__init__()
        self.stalled_for = stalled_for

    def answer(self, method: str, *args):
        if method == "collect":
            return [], {}, 0, self.stalled_for
        return super().answer(method, *args)


class SlowLoads(FakeRay):
    """Calls on the generators that land only after `pending` checks."""

    pending = 3

    @classmethod
    def wait(cls, refs, **kwargs):
        if cls.pending > 0:
            cls.pending -= 1
            return [], refs
        return refs, []


def test_the_step_stops_in_one_line_when_every_generator_is_stalled_and_every_call_has_landed(monkeypatch):
    import grpo_cli.drivers.async_executor as async_executor

    monkeypatch.setattr(async_executor, "COLLECT_WAIT_S", 0.0)
    cfg = compose_config([*ASYNC, "sync.max_staleness=1"])
    sampler = PromptSampler(load_examples(cfg.task, "train"), seed=0)
    executor = bare_executor(cfg, sampler, {}, generators=[StalledGenerator(async_executor.STALL_S + 1)])
    executor.run.ray = SlowLoads
    executor.start(0)
    executor.hand_out(1)
    collects = lambda: sum(call[0] == "collect" for call in executor.generators[0].actor.calls)  # noqa: E731
    with pytest.raises(RuntimeError, match="nothing they may sample for 61s while the step waits"):
        executor.gather(lambda: False)
    # The calls were in flight for three checks (two per round): it collected again instead of stopping, and
    # stopped in the round they landed.
    assert collects() == 2
    # A generator that works (stalled 0) beside a stalled one: the step waits (until() ends it here).
    working = bare_executor(cfg, sampler, {}, generators=[StalledGenerator(120.0), StalledGenerator(0.0)])
    checks = []
    assert working.gather(lambda: checks.append(1) or len(checks) > 8) >= 0  # several rounds, no stop
