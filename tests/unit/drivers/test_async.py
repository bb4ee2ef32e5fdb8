"""sync=async in-process (rollout/async_generation.py, drivers/versions.py): the staleness bound under random update
timings, the batch a step trains, the hard check, the episodes' versions, the config's refusals. The Ray runs are in
tests/e2e/test_async_e2e.py."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from grpo_cli.config import validate_config
from grpo_cli.drivers.prompts import PromptSampler
from grpo_cli.drivers.versions import staleness_check
from grpo_cli.errors import UserFacingError
from grpo_cli.rollout.async_generation import AsyncGeneration, BatchOrder, FinishedGroup
from grpo_cli.tasks import load_examples
from tests.conftest import compose_config
from tests.e2e.test_multiturn_e2e import ENVIRONMENT

ASYNC = ["debug=smoke", "sync=async", "loss=grpo_clip", "model.mixed_precision=no"]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def weights_of(generation: AsyncGeneration, version: int) -> dict[str, torch.Tensor]:
    """The generator's weights moved a little per version (the values do not matter to the bound)."""
    return {n: p.detach().clone() + 1e-4 * version for n, p in generation.worker.model.named_parameters()}


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
                groups, _counters, _version = generation.collect(0.2)
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
    try:
        assert generation.whole_batches
        engine = generation.batch_engine
        calls = []
        real = engine._engine.generate

        def generate_then_offer(prompt_ids, settings):
            batch = real(prompt_ids, settings)
            calls.append(engine.policy_version)
            if len(calls) == 1:  # an update arrives after the first turn
                generation.offer_weights(weights_of(generation, 1), 1)
            return batch

        engine._engine.generate = generate_then_offer
        sampler = PromptSampler(load_examples(cfg.task, "train"), seed=0)
        generation.offer_weights(weights_of(generation, 0), 0)
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
    with pytest.raises(UserFacingError, match="sync.partial_rollouts=True acts only under sync=async"):
        validate_config(cfg)
