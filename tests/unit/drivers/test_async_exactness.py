"""sync=async's exact numbers (issue 57): the generator samples nothing before it holds the version it records
(a resume, init_from), a missing behaviour log-prob or version stops the step in one line, a drop-mode resume
trains each prompt once, the counters are counted under their lock, a hung engine stops the run."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from grpo_cli.batch.rollout_data import RolloutData, concat_rollouts, missing_behaviour
from grpo_cli.config import validate_config
from grpo_cli.drivers.prompts import PromptSampler
from grpo_cli.drivers.ray_actors import initial_weights
from grpo_cli.errors import UserFacingError
from grpo_cli.learner.checkpoint import save_checkpoint
from grpo_cli.learner.learner import Learner
from grpo_cli.rollout import async_generation
from grpo_cli.rollout.async_generation import AsyncGeneration, BatchOrder, FinishedGroup
from grpo_cli.rollout.episode_rollout import episode_batch, episode_versions
from grpo_cli.tasks import load_examples
from tests.conftest import compose_config
from tests.unit.drivers.test_async import ASYNC, bare_executor, submitted, weights_of
from tests.unit.engines.test_stream import one_row_log_probs

# --- 2: the behaviour policy recorded is the one that sampled ----------------------------------------------------


def test_after_a_resume_the_stream_samples_nothing_before_the_checkpoints_weights_and_init_from_loads(tmp_path):
    """A resume at step S=2 <= k: batch 3 may start at version >= 0, which the base model's copy would claim; the
    generator must wait for the learner's version-2 weights and every token's recorded log-prob be theirs. The
    generator's copy also starts from init_from's weights, not model.*'s."""
    base_cfg = compose_config([*ASYNC, "rollout.max_tokens=8"])
    probe = AsyncGeneration(base_cfg)
    try:
        model = probe.worker.model
        base = {n: p.detach().clone() for n, p in model.named_parameters()}
        branched = weights_of(probe, 7, base)  # the weights of the run init_from names
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                parameter.copy_(branched[name])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        save_checkpoint(tmp_path / "parent", 3, model, optimizer, {"step": 3}, keep=1)
    finally:
        probe.close()

    cfg = compose_config([*ASYNC, "rollout.max_tokens=8", f"init_from={tmp_path / 'parent'}"])
    validate_config(cfg)
    generation = AsyncGeneration(cfg, initial_weights=initial_weights(cfg))
    try:
        for name, parameter in generation.worker.model.named_parameters():
            assert torch.equal(parameter.detach(), branched[name]), name  # init_from's, not model.*'s
        sampler = PromptSampler(load_examples(cfg.task, "train"), seed=0)
        generation.submit(BatchOrder(3, sampler.next_batch(2)))
        time.sleep(1.0)  # the loop has had every chance to start batch 3
        assert generation.collect(0.2)[0] == []
        assert generation.stream is not None and generation.stream.running() == 0
        resumed = weights_of(generation, 2, base)  # the checkpoint's weights, version 2
        generation.offer_weights(resumed, 2)
        groups: list[FinishedGroup] = []
        deadline = time.monotonic() + 60
        while len(groups) < 2 and time.monotonic() < deadline:
            groups += generation.collect(1.0)[0]
    finally:
        generation.close()
    assert len(groups) == 2
    model = generation.worker.model
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(resumed[name])
    checked = 0
    for group in groups:
        data = group.data
        assert data.token_versions is not None and data.sampler_log_probs is not None
        for prompt, completion, versions, log_probs in zip(
            data.prompt_ids, data.completion_ids, data.token_versions, data.sampler_log_probs, strict=True
        ):
            assert set(versions) == {2}
            expected = one_row_log_probs(model, prompt, completion, cfg.rollout.temperature)
            torch.testing.assert_close(log_probs, torch.tensor(expected), atol=1e-5, rtol=1e-5)
            checked += len(completion)
    assert checked > 10


def test_an_episode_batch_with_a_turn_of_unknown_version_stops_in_one_line():
    def episode(versions: list[int | None]) -> Any:  # what episode_versions reads of an Episode
        return SimpleNamespace(versions=versions)

    assert episode_versions([episode(versions=[3, 3, -1, 4]), episode(versions=[4])]) == [[3, 3, -1, 4], [4]]
    none_recorded = [episode(versions=[None, -1, None]), episode(versions=[None])]  # -1: environment tokens
    assert episode_versions(none_recorded) is None
    with pytest.raises(UserFacingError, match="1 sampled tokens of this batch's episodes carry no policy version"):
        episode_versions([episode(versions=[3, 3]), episode(versions=[None])])


# --- 3: the correction never turns off silently ---------------------------------------------------------------


def rollout(n: int, with_log_probs: bool, versions: bool = True) -> RolloutData:
    return RolloutData(
        prompt_ids=[[1, 2]] * n,
        completion_ids=[[3, 4, 5]] * n,
        raw_rewards=torch.arange(n, dtype=torch.float32),
        advantages=torch.arange(n, dtype=torch.float32) - 0.5,
        sampler_log_probs=[torch.full((3,), -1.0) for _ in range(n)] if with_log_probs else None,
        token_versions=[[0, 0, 0]] * n if versions else None,
    )


def test_a_part_without_behaviour_log_probs_is_kept_as_missing_not_dropped_for_the_whole_batch():
    joined = concat_rollouts([rollout(2, True), rollout(1, False), rollout(1, True)])
    assert joined.sampler_log_probs is not None and len(joined.sampler_log_probs) == 4
    assert torch.isnan(joined.sampler_log_probs[2]).all() and not torch.isnan(joined.sampler_log_probs[3]).any()
    assert missing_behaviour(joined) == "no sampler (behaviour) log-probs for 3 tokens of completion 2"
    assert missing_behaviour(concat_rollouts([rollout(2, True), rollout(1, True)])) is None
    assert concat_rollouts([rollout(1, False), rollout(1, False)]).sampler_log_probs is None
    with pytest.raises(ValueError, match="1 of 2 rollout parts carry no token versions"):
        concat_rollouts([rollout(1, True), rollout(1, True, versions=False)])


def test_an_episode_turn_without_log_probs_keeps_the_others_and_marks_its_own_missing():
    def episode(log_probs: list[float], mask: list[int]) -> Any:  # what episode_batch reads of an Episode
        ids = list(range(5, 5 + len(log_probs)))
        return SimpleNamespace(
            sampler_logprobs=log_probs, ids=ids, prompt_ids=[1], truncated=False, model_tokens=sum(mask),
            stop_reason="stop", loss_mask=mask, versions=[None] * len(ids), messages=[],
        )  # fmt: skip

    nan = float("nan")
    episodes = [episode([-0.5, -0.25, 0.0], [1, 1, 0]), episode([nan, nan], [1, 1])]
    samples = episode_batch(episodes)
    assert samples.sampler_log_probs is not None  # the first episode's are kept, the second's NaN (missing)
    assert samples.sampler_log_probs[0] == [-0.5, -0.25, 0.0]
    assert all(lp != lp for lp in samples.sampler_log_probs[1])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["sync=async", "loss=grpo_clip"], "sync=async needs the sampler's log-probs of every sampled token"),
        (["rollout.importance_correction=truncated"], "rollout.importance_correction=truncated needs the sampler's"),
    ],
)
def test_the_learner_refuses_a_batch_with_a_missing_behaviour_log_prob_in_one_line(tmp_path, overrides, message):
    cfg = compose_config(["debug=smoke", "model.mixed_precision=no", *overrides], str(tmp_path))
    learner = Learner(cfg, tmp_path)
    batch = concat_rollouts([rollout(2, True), rollout(2, False)])
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    with pytest.raises(UserFacingError, match=message) as raised:
        learner.learn(batch, 1)
    assert "\n" not in str(raised.value) and "completion 2" in str(raised.value)
    for name, parameter in learner.model.named_parameters():
        assert torch.equal(parameter.detach(), before[name])  # nothing trained


# --- 5: a drop-mode resume trains each prompt once ----------------------------------------------------------------


def simulate(executor, steps: int, long: set[tuple[int, int]], start: int = 0) -> list[list[tuple[int, int]]]:
    """Drive the executor's drop-mode bookkeeping as `step` does, with a generator that finishes each submitted
    group one tick after its submission, in submission order, but the `long` ones never (a long completion):
    returns the (batch, prompt) pairs each step trained."""
    executor.start(start)
    seen, running, trained = 0, [], []
    for step in range(start + 1, start + steps + 1):
        executor.version = step - 1
        executor.top_up()
        orders = submitted(executor)
        for order in orders[seen:]:
            running += [(order.batch_number, i) for i in range(len(order.examples)) if i not in order.skip]
        seen = len(orders)
        data = SimpleNamespace(policy_version=step - 1)  # fresh: this test is about resumes, not the bound
        while len(executor.ready) < executor.shape.prompts_per_rollout_batch:
            done = next(item for item in running if item not in long)
            running.remove(done)
            executor.ready.append(FinishedGroup(done[0], [done[1]], data))  # type: ignore[arg-type]
        groups = executor._take_fresh(executor.shape.prompts_per_rollout_batch)
        executor.top_up()
        for group in groups:
            executor._mark_trained(group)
        trained.append([(g.batch_number, g.prompt_indices[0]) for g in groups])
    return trained


def test_a_drop_mode_resume_after_a_batch_closed_behind_an_open_one_trains_each_prompt_once():
    cfg = compose_config([*ASYNC, "sync.on_stale=drop", "sync.max_staleness=1"])
    examples = load_examples(cfg.task, "train")
    long = {(1, 0)}  # batch 1's first prompt never ends: batch 1 stays open while batches 2 and 3 close behind it
    uninterrupted = simulate(bare_executor(cfg, PromptSampler(examples, seed=0), {}), 5, long)

    before = bare_executor(cfg, PromptSampler(examples, seed=0), {})
    first = simulate(before, 3, long)
    state = before.save_checkpoint(3)[2]  # type: ignore[index]  # the fake actor returns the call's arguments
    assert state["async_first_batch"] == 1 and state["async_closed"] == [2, 3]
    sampler = PromptSampler(examples, seed=0)
    sampler.load_state(state["sampler"])
    after = bare_executor(cfg, sampler, state)
    second = simulate(after, 2, long, start=3)

    pairs = [pair for step in first + second for pair in step]
    assert len(pairs) == len(set(pairs))  # no prompt trained twice
    assert first + second == uninterrupted  # the uninterrupted run's prompts, step by step
    assert all(o.batch_number not in (2, 3) for o in submitted(after))  # the closed batches are not sampled again


# --- 8: the counters under their lock, a hung engine, the evaluation's wait ----------------------------------------


def test_the_loop_counts_under_the_lock_that_collect_swaps_the_counters_under():
    """A count taken while `collect` holds the lock waits for it, so it lands in the counters collect hands out
    next, never in the object it just swapped out (a lost count)."""
    cfg = compose_config([*ASYNC, "rollout.max_tokens=4"])
    generation = AsyncGeneration(cfg)
    try:
        generation.collect(0.0)
        counted = threading.Event()

        def count() -> None:
            generation._count(groups=1, scoring_s=0.5)
            counted.set()

        with generation.cond:  # as collect holds it while it swaps
            swapped_out = generation.counters
            thread = threading.Thread(target=count)
            thread.start()
            assert not counted.wait(0.3)  # the count waits for the lock
            generation.counters = type(swapped_out)()
        thread.join(5)
        assert counted.is_set() and swapped_out.groups == 0
        counters = generation.collect(0.0)[1]
        assert counters["groups"] == 1 and counters["scoring_s"] == 0.5
    finally:
        generation.close()


def test_an_engine_step_that_never_returns_stops_the_run_in_one_line(monkeypatch):
    monkeypatch.setattr(async_generation, "ENGINE_CALL_TIMEOUT_S", 0.5)
    cfg = compose_config([*ASYNC, "rollout.max_tokens=4"])
    generation = AsyncGeneration(cfg)
    release = threading.Event()
    assert generation.stream is not None

    def hang() -> list:
        release.wait(30)
        return []

    generation.stream.step = hang  # type: ignore[method-assign]
    sampler = PromptSampler(load_examples(cfg.task, "train"), seed=0)
    started = time.monotonic()
    try:
        generation.offer_weights(weights_of(generation, 0), 0)
        generation.submit(BatchOrder(1, sampler.next_batch(2)))
        with pytest.raises(UserFacingError, match="has not returned from a decode step") as raised:
            while time.monotonic() - started < 20:
                generation.collect(0.2)
        assert "\n" not in str(raised.value)
        assert time.monotonic() - started < 10  # stopped, not hung
        with pytest.raises(UserFacingError, match="has not returned from a decode step"):
            generation.evaluate(sampler.next_batch(1), 0.0, 0)  # the evaluation's wait sees it too
    finally:
        release.set()
        generation.close()


def test_evaluate_waits_at_most_its_timeout(monkeypatch):
    monkeypatch.setattr(async_generation, "EVALUATE_TIMEOUT_S", 0.5)
    cfg = compose_config([*ASYNC, "rollout.max_tokens=4"])
    generation = AsyncGeneration(cfg)
    sampler = PromptSampler(load_examples(cfg.task, "train"), seed=0)
    try:  # version 3 is never offered: the evaluation can never run
        with pytest.raises(UserFacingError, match="did not finish within 0s"):
            generation.evaluate(sampler.next_batch(1), 0.0, 3)
    finally:
        generation.close()
