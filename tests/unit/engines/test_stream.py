"""The transformers decode stream of sync=async (engines/stream.py), against independent computations:

- with no update it samples what the batch engine samples (same streams: same ids, the same log-probs);
- rows join a running batch (continuous batching) without changing any row's completion;
- a scripted weight update at decode step s (kv_after_update=recompute): every token's recorded version and log-prob
  equal the log-prob of an unpadded one-row forward under the weights of that version; versions never decrease;
- pushing unchanged weights mid-generation gives the same completions: bitwise with keep, to fp32 tolerance with
  recompute (the prefill's sums run in another order);
- keep records the token sampled from the old logits with the old version, the ones after with the new.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from grpo_cli.engines.decode import Decoder
from grpo_cli.engines.sampling import completion_seed
from grpo_cli.engines.stream import HFDecodeStream, StreamRow
from grpo_cli.rollout import HFRolloutEngine, SamplingSettings
from tests.unit.engines.test_decode import EOS, PROMPTS, CharTokenizer, tiny_lm

SETTINGS = SamplingSettings(n=2, temperature=1.0, max_tokens=12, seed=7)


def stream_for(model: torch.nn.Module, capacity: int = 64, settings: SamplingSettings = SETTINGS) -> HFDecodeStream:
    decoder = Decoder(model, CharTokenizer(), {EOS}, compile_setting="never")
    return HFDecodeStream(decoder, settings, capacity)


def rows_of(prompts: list[list[int]], settings: SamplingSettings = SETTINGS, first: int = 0) -> list[StreamRow]:
    return [
        StreamRow((0, first + i, j), list(p), settings.max_tokens, completion_seed(settings.seed, first + i, j))
        for i, p in enumerate(prompts)
        for j in range(settings.n)
    ]


def run_to_end(stream: HFDecodeStream, on_step=None) -> None:
    step = 0
    while stream.running():
        if on_step is not None:
            on_step(step)
        stream.step()
        step += 1


def one_row_log_probs(model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float) -> list:
    """The independent computation: an unpadded forward of one sequence, log softmax(logits / T) of each token."""
    with torch.no_grad():
        ids = torch.tensor([prompt + completion])
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).tolist()


def test_without_updates_the_stream_samples_what_the_batch_engine_samples():
    model = tiny_lm(std=0.3)
    batch = HFRolloutEngine(model, CharTokenizer()).generate(PROMPTS, SETTINGS)
    stream = stream_for(model)
    rows = rows_of(PROMPTS)
    stream.add(rows)
    run_to_end(stream)
    assert [r.token_ids for r in rows] == batch.completion_ids
    for row, expected in zip(rows, batch.sampler_log_probs, strict=True):
        torch.testing.assert_close(torch.tensor(row.log_probs), torch.tensor(expected), atol=1e-5, rtol=1e-5)
        assert row.versions == [0] * len(row.token_ids)


def test_rows_that_join_a_running_batch_change_no_completion():
    def short_first(rows: list[StreamRow]) -> list[StreamRow]:
        rows[0].max_tokens, rows[1].max_tokens = 3, 5  # two places free up early
        return rows

    model = tiny_lm(std=0.3)
    alone = stream_for(model)
    reference = short_first(rows_of(PROMPTS))
    alone.add(reference)
    run_to_end(alone)

    joined = stream_for(model)
    first, later = short_first(rows_of(PROMPTS[:2])), rows_of(PROMPTS[2:], first=2)
    joined.add(first)

    def add_later(step: int) -> None:
        if step == 6:
            joined.add(later)  # two join in the ended rows' places at once; the others when more end

    run_to_end(joined, add_later)
    assert joined.counters.rows_joined >= 2  # in ended rows' places, prefilling only themselves
    assert [r.token_ids for r in first + later] == [r.token_ids for r in reference]
    for row, ref in zip(first + later, reference, strict=True):
        torch.testing.assert_close(torch.tensor(row.log_probs), torch.tensor(ref.log_probs), atol=1e-5, rtol=1e-5)


def perturb_(model: torch.nn.Module, seed: int = 3) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_an_update_at_step_s_records_each_tokens_version_and_its_log_prob_under_it(temperature):
    settings = replace(SETTINGS, temperature=temperature, max_tokens=16)
    model = tiny_lm(std=0.3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stream = stream_for(model, settings=settings)
    rows = rows_of(PROMPTS, settings)
    stream.add(rows)

    def update_at_5(step: int) -> None:
        if step == 5:
            perturb_(model)
            stream.updated(1, "recompute")

    run_to_end(stream, update_at_5)
    after = {k: v.clone() for k, v in model.state_dict().items()}
    old = tiny_lm(std=0.3)
    old.load_state_dict(before)
    assert any(r.partial for r in rows)
    for row in rows:
        assert row.versions == sorted(row.versions)  # never decrease
        assert row.versions[:5] == [0] * min(5, len(row.versions))
        assert all(v == 1 for v in row.versions[5:])
        under = {0: one_row_log_probs(old, row.prompt_ids, row.token_ids, temperature)}
        model.load_state_dict(after)
        under[1] = one_row_log_probs(model, row.prompt_ids, row.token_ids, temperature)
        expected = [under[v][t] for t, v in enumerate(row.versions)]
        torch.testing.assert_close(torch.tensor(row.log_probs), torch.tensor(expected), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_pushing_unchanged_weights_mid_generation_changes_no_token(kv):
    model = tiny_lm(std=0.3)
    plain = stream_for(model)
    reference = rows_of(PROMPTS)
    plain.add(reference)
    run_to_end(plain)

    pushed = stream_for(model)
    rows = rows_of(PROMPTS)
    pushed.add(rows)
    run_to_end(pushed, lambda step: pushed.updated(1, kv) if step == 4 else None)
    assert [r.token_ids for r in rows] == [r.token_ids for r in reference]
    for row, ref in zip(rows, reference, strict=True):
        if kv == "keep":
            assert row.log_probs == ref.log_probs  # bitwise: nothing was recomputed
        else:
            torch.testing.assert_close(torch.tensor(row.log_probs), torch.tensor(ref.log_probs), atol=1e-5, rtol=1e-5)
    assert pushed.counters.recompute_s > 0 if kv == "recompute" else pushed.counters.recompute_s == 0


def test_keep_records_the_token_of_the_old_logits_with_the_old_version():
    model = tiny_lm(std=0.3)
    stream = stream_for(model, settings=replace(SETTINGS, max_tokens=10))
    rows = rows_of(PROMPTS[:1], replace(SETTINGS, max_tokens=10))
    stream.add(rows)

    def update_at_3(step: int) -> None:
        if step == 3:
            perturb_(model)
            stream.updated(1, "keep")

    run_to_end(stream, update_at_3)
    for row in rows:
        assert len(row.versions) > 4
        # the 4th token comes from the forward run before the update; the 5th from one under the new weights
        assert row.versions[:4] == [0, 0, 0, 0] and row.versions[4:] == [1] * (len(row.versions) - 4)


def test_ended_rows_are_counted_as_wasted_until_the_batch_is_rebuilt():
    model = tiny_lm(std=0.3)
    stream = stream_for(model)
    rows = rows_of(PROMPTS)
    stream.add(rows)
    run_to_end(stream)
    lengths = [len(r.token_ids) for r in rows]
    assert stream.counters.row_steps >= sum(lengths)
    assert stream.counters.row_steps - stream.counters.wasted_row_steps == sum(lengths)


def test_a_compiled_step_sees_one_batch_shape_whatever_joins_and_ends():
    """On CUDA the step is compiled (CUDA graphs, captured per shape): the stream pads its batch to capacity. The
    compiler is stood in for by the eager step, recording the shapes it is called with."""
    model = tiny_lm(std=0.3)
    reference = rows_of(PROMPTS)
    plain = stream_for(model)
    plain.add(reference)
    run_to_end(plain)

    stream = stream_for(model, capacity=12)
    decoder = stream.decoder
    shapes = []

    def eager(input_ids, positions, mask, cache):
        shapes.append(tuple(input_ids.shape))
        return decoder._forward(input_ids, positions, mask, cache)

    decoder.compile, decoder._compiled = True, eager
    first, later = rows_of(PROMPTS[:2]), rows_of(PROMPTS[2:], first=2)
    stream.add(first)
    run_to_end(stream, lambda step: stream.add(later) if step == 2 else None)
    assert set(shapes) == {(12, 1)}
    assert [r.token_ids for r in first + later] == [r.token_ids for r in reference]


def test_a_batch_whose_rows_all_ended_takes_a_whole_capacity_again():
    """After a small batch has ended (here two rows of a capacity of 8), the stream has room for a whole group
    again: what the generator asks before it starts one (a stream that answered its ended rows only would never
    start another group of 4)."""
    model = tiny_lm(std=0.3)
    stream = stream_for(model, capacity=8)
    stream.add(rows_of(PROMPTS[:1]))
    run_to_end(stream)
    assert stream.running() == 0 and stream.room() == 8
    later = rows_of(PROMPTS[1:3], first=1)
    stream.add(later)
    run_to_end(stream)
    assert all(row.ended and row.token_ids for row in later)
