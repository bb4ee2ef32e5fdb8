"""Packed rows (train.pack_sequences, grpo_cli/core/packing.py): the layout, its un-packing, the probe that decides
whether a model packs, and the log-probs and gradients of every architecture the shared-prompt tests cover."""

from __future__ import annotations

import random

import pytest
import torch

from grpo_cli.core import response_log_probs, tokenize_prompt_and_output_ids
from grpo_cli.core.packing import (
    assign_rows,
    pack_rows,
    packed_positions,
    packed_row_tokens,
    packed_sequences_leak,
    packing_beats_sharing,
    packing_problem,
    probe_lengths,
    row_width,
    sequence_lengths,
    unpack_at,
)
from tests.conftest import build_tiny_lm
from tests.unit.core.test_prompt_sharing_architectures import LLAMA4, REFUSED
from tests.unit.core.test_sliding_window_logprobs import (  # noqa: F401 - _one_thread is an autouse fixture
    ARCHITECTURES,
    TINY,
    _one_thread,
    assert_scored_like_one_unpadded_forward_per_sequence,
    build,
    build_tiny,
    group_batch,
    one_row_log_probs,
)

MODELS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", TINY),
    **{name: (model, config, {**TINY, **extra}) for name, (model, config, extra) in ARCHITECTURES.items()},
    "llama4": LLAMA4,
    **REFUSED,
}


def scorer(model: torch.nn.Module):
    """The probe's view of the scoring path: response log-probs at `mask`, packed or padded."""

    def score(input_ids, labels, mask, packed):
        return response_log_probs(model, input_ids, labels, mask, pack_sequences=packed)["log_probs"][mask]

    return score


def test_rows_are_filled_first_fit_decreasing_and_keep_their_order():
    assert assign_rows([3, 9, 0, 4, 6], row_tokens=9) == [[1], [0, 4], [3]]
    assert assign_rows([3, 9, 0, 4, 6], row_tokens=None) == [[0, 1, 3, 4]]
    assert assign_rows([12, 2], row_tokens=5) == [[0], [1]]  # longer than a row: a row of its own
    assert assign_rows([0, 0], row_tokens=4) == []


def _row_cost(lengths: list[int], width: int, hidden: int) -> float:
    rows, filled = packed_positions(lengths, width)
    return rows * filled * (1 + filled / hidden)


def test_row_width_fills_rows_where_rows_of_the_longest_leave_one_mostly_empty():
    """The packing benchmark's microbatch (docs/results/2026-11-28-packing.md): one 571-token sequence beside
    seven short ones. Rows of the longest take 3 rows (27% padding); two rows of 646 hold them all (3.3%)."""
    lengths = [60 + c - 1 for c in (36, 19, 52, 22, 16, 27, 512, 94)]
    assert packed_positions(lengths, max(lengths)) == (3, 571)
    width = row_width(lengths, hidden_size=576)
    rows, filled = packed_positions(lengths, width)
    assert (rows, filled) == (2, 646)
    assert 1 - sum(lengths) / (rows * filled) <= 0.05
    assert row_width(lengths, hidden_size=None) == max(lengths)  # no hidden size: the first rule
    assert row_width([0, 0], hidden_size=64) == 1


def test_row_width_is_near_the_cheapest_of_every_width():
    """Against every width from the longest sequence to one row, priced the same way: never dearer than rows of
    the longest or one row, and within 10% of the exhaustive best on long-tailed batches."""
    rng = random.Random(1)
    for _ in range(60):
        lengths = [int(16 * 32 ** rng.random()) for _ in range(rng.randrange(2, 40))]
        hidden = rng.choice([32, 64, 576, 2048])
        chosen = _row_cost(lengths, row_width(lengths, hidden), hidden)
        every = [_row_cost(lengths, width, hidden) for width in range(max(lengths), sum(lengths) + 1)]
        assert chosen <= every[0] * (1 + 1e-9) and chosen <= every[-1] * (1 + 1e-9)
        assert chosen <= 1.1 * min(every)


def test_packing_concatenates_sequences_with_restarting_positions_and_unpacks_back():
    prompt_ids, completions = group_batch()
    batch = tokenize_prompt_and_output_ids(prompt_ids, completions, pad_token_id=0)
    mask = batch["response_mask"].bool()
    lengths = sequence_lengths(mask)
    assert lengths == [len(p) + len(c) - 1 for p, c in zip(prompt_ids, completions, strict=True)]
    packed = pack_rows(batch["input_ids"], mask, row_tokens=max(lengths))
    # lengths 14, 9, 13, 7, 12, 6: rows [14], [13], [12], [9], [7 + 6] and padding
    assert packed.sequences == 6 and packed.input_ids.shape == (5, 14)
    for row in range(6):  # each sequence whole, in one row, its positions 0..n-1
        where = packed.index[row, : lengths[row]]
        assert (packed.input_ids.flatten()[where] == batch["input_ids"][row, : lengths[row]]).all()
        assert packed.position_ids.flatten()[where].tolist() == list(range(lengths[row]))
        assert (packed.index[row, lengths[row] :] == -1).all()
    # Un-packing: the values of the packed positions come back in the padded mask's row-major order.
    values = packed.input_ids[..., None].float() * torch.tensor([1.0, -1.0])  # (R, L, 2)
    expected = batch["input_ids"][..., None].float() * torch.tensor([1.0, -1.0])
    torch.testing.assert_close(unpack_at(values, packed, mask), expected[mask])
    with pytest.raises(ValueError, match="outside the packed sequences"):
        unpack_at(values, packed, torch.ones_like(mask))


def test_a_row_without_a_response_is_left_out():
    batch = tokenize_prompt_and_output_ids([[5, 6, 7], [8, 9]], [[10, 11], []], pad_token_id=0)
    packed = pack_rows(batch["input_ids"], batch["response_mask"], row_tokens=None)
    assert packed.sequences == 1 and packed.input_ids.tolist() == [[5, 6, 7, 10]]
    assert (packed.index[1] == -1).all()


def test_flash_attention_gets_one_row_that_transformers_reads_as_packed_varlen_sequences():
    """On CUDA with flash-attention (mocked here: the model's attention implementation says so), the microbatch is
    one row: transformers' `_flash_attention_forward` takes its variable-length path from position ids only in a
    batch of one row, with the sequence boundaries (cu_seqlens) read from the restarting positions."""
    from transformers.modeling_flash_attention_utils import _is_packed_sequence, prepare_fa_kwargs_from_position_ids

    model = build_tiny(*MODELS["llama"])
    prompt_ids, completions = group_batch()
    batch = tokenize_prompt_and_output_ids(prompt_ids, completions, pad_token_id=0)
    mask = batch["response_mask"].bool()
    lengths = sequence_lengths(mask)
    # sdpa: rows as wide as row_width prices cheapest for the model's hidden size
    assert packed_row_tokens(model, lengths) == row_width(lengths, model.config.hidden_size)
    # What from_pretrained(..., attn_implementation="flash_attention_2") sets, without its check for the kernels.
    model.config._attn_implementation_internal = "flash_attention_2"
    assert model.config._attn_implementation == "flash_attention_2"
    assert packed_row_tokens(model, lengths) is None

    calls = []

    class Decoder(torch.nn.Module):  # records the call instead of running kernels this machine lacks
        def forward(self, **kwargs):
            calls.append(kwargs)
            hidden = torch.zeros((*kwargs["input_ids"].shape, model.config.hidden_size))
            return type("Output", (), {"last_hidden_state": hidden})()

    model.get_decoder = lambda: Decoder()
    response_log_probs(model, batch["input_ids"], batch["labels"], mask, pack_sequences=True)
    (call,) = calls
    assert call["attention_mask"] is None and call["use_cache"] is False
    positions = call["position_ids"]
    assert positions.shape == (1, sum(lengths))
    assert bool(_is_packed_sequence(positions, batch_size=1))
    (cu_seqlens, _), (max_length, _) = prepare_fa_kwargs_from_position_ids(positions)
    assert cu_seqlens.tolist() == torch.tensor([0, *lengths]).cumsum(0).tolist() and max_length == max(lengths)


def test_an_all_ones_mask_or_a_cache_would_let_sequences_attend_to_each_other():
    """Why the packed forward passes attention_mask=None and use_cache=False: with either, transformers skips
    its packed-sequence detection and the same packed rows score differently (this batch shows it)."""
    model = build_tiny(*MODELS["llama"]).eval()
    prompt_ids, completions = group_batch()
    batch = tokenize_prompt_and_output_ids(prompt_ids, completions, pad_token_id=0)
    mask = batch["response_mask"].bool()
    packed = pack_rows(batch["input_ids"], mask, row_tokens=max(sequence_lengths(mask)))
    decoder = model.get_decoder()
    arguments = dict(input_ids=packed.input_ids, position_ids=packed.position_ids)
    with torch.no_grad():
        right = decoder(**arguments, attention_mask=None, use_cache=False).last_hidden_state
        ones = decoder(**arguments, attention_mask=torch.ones_like(packed.input_ids), use_cache=False)
        cached = decoder(**arguments, attention_mask=None, use_cache=True)
        expected = decoder(input_ids=batch["input_ids"]).last_hidden_state[mask]
    torch.testing.assert_close(unpack_at(right, packed, mask), expected, atol=1e-5, rtol=1e-5)
    for wrong in (ones.last_hidden_state, cached.last_hidden_state):
        assert (unpack_at(wrong, packed, mask) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("architecture", list(MODELS))
def test_every_architecture_packs_exactly_or_is_refused_by_the_probe(architecture):
    """The probe (packed against separate log-probs on the model itself) decides; where it passes, the trainer's
    packed scoring of a batch of prompts and completions longer than the windows equals one unpadded forward per
    sequence, log-probs and gradients. Where it refuses, the difference is real (it says how large), and the
    learner keeps the padded layout (tests/unit/learner/test_packed_rows.py)."""
    model = build_tiny(*MODELS[architecture])
    problem = packing_problem(model, scorer(model))
    if problem is None:
        assert_scored_like_one_unpadded_forward_per_sequence(model, share_prompts=False, pack_sequences=True)
    else:
        assert problem.startswith(model.config.get_text_config().model_type)


@pytest.mark.parametrize("architecture", ["llama", "mistral", "gemma2", "qwen2"])
def test_attention_models_pass_the_probe(architecture):
    """Full and sliding-window attention with GQA (TINY: 2 query heads, 1 key/value head) pack."""
    model = build_tiny(*MODELS[architecture])
    assert packing_problem(model, scorer(model)) is None


def test_the_probe_crosses_every_window_it_can_and_refuses_longer_ones():
    config = type("Config", (), {"sliding_window": 4, "max_position_embeddings": 64})()
    lengths = probe_lengths(config)
    assert max(lengths) > 4 + 1 and sum(lengths) > max(lengths)
    # The second row holds two sequences and the second one crosses a window boundary from a mid-row start.
    rows = assign_rows(lengths, max(lengths))
    assert any(len(row) == 2 and lengths[row[0]] % 4 and lengths[row[0]] + lengths[row[1]] > 4 for row in rows)
    assert probe_lengths(type("Config", (), {"attention_chunk_size": 10**6})()) == []
    assert probe_lengths(type("Config", (), {"sliding_window": 100, "max_position_embeddings": 64})()) == []


def test_chunked_attention_is_refused_because_its_chunks_count_from_the_row_start():
    """Llama 4's chunks start at the row's first token, not at each packed sequence's: packed, it scores wrong,
    and the probe says so."""
    model = build_tiny(*LLAMA4)
    prompt_ids, completions = group_batch()
    batch = tokenize_prompt_and_output_ids(prompt_ids, completions, pad_token_id=0)
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        packed = response_log_probs(model, batch["input_ids"], batch["labels"], mask, pack_sequences=True)
        expected = one_row_log_probs(model, prompt_ids, completions)
    assert (packed["log_probs"][mask] - expected).abs().max() > 1e-2
    assert "off separate sequences" in packing_problem(model, scorer(model))


def test_a_forward_without_position_ids_is_refused_not_raised():
    model = build_tiny(*MODELS["llama"])

    class NoPositions(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask=None, use_cache=None):
            return self.inner(input_ids=input_ids)

    real = model.get_decoder()
    model.get_decoder = lambda: NoPositions(real)
    problem = packing_problem(model, scorer(model))
    assert problem is not None and "fails on packed rows (TypeError" in problem


def test_half_precision_weights_are_compared_at_their_own_rounding():
    model = build_tiny(*MODELS["llama"]).to(torch.bfloat16)
    assert packing_problem(model, scorer(model)) is None


class LeakingDecoder(torch.nn.Module):
    """A decoder with the bug the packed forward exists to avoid: it hands transformers an all-ones attention mask
    with the packed rows' restarting position ids, so the packed-sequence detection is skipped and every packed
    sequence attends to the ones before it in its row. Other calls (padded, separate, shared) go through as they
    came."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, position_ids=None, attention_mask=None, **kwargs):
        if position_ids is not None and attention_mask is None:  # the packed forward's call
            attention_mask = torch.ones_like(input_ids)
        return self.inner(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, **kwargs)


def weak_context_llama(dtype: torch.dtype, leaking: bool) -> torch.nn.Module:
    """The tiny Llama at transformers' own initial scale (std 0.02, not the tests' 0.5): its log-probs hardly depend
    on the context, so a leak moves them by less than bf16's rounding allowance, though it moves them."""
    model = build_tiny_lm("LlamaForCausalLM", "LlamaConfig", std=0.02, seed=0, **TINY).to(dtype)
    if leaking:
        decoder = LeakingDecoder(model.get_decoder())
        model.get_decoder = lambda: decoder
    return model


def probe_batch(model: torch.nn.Module):
    """packing_problem's synthetic batch for `model`: (input_ids, labels, mask, vocab)."""
    lengths = probe_lengths(model.config)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.zeros((len(lengths), max(lengths)), dtype=torch.long)
    labels, mask = torch.zeros_like(input_ids), torch.zeros_like(input_ids, dtype=torch.bool)
    for row, n in enumerate(lengths):
        tokens = torch.randint(1, model.config.vocab_size, (n + 1,), generator=generator)
        input_ids[row, :n], labels[row, :n], mask[row, 1:n] = tokens[:-1], tokens[1:], True
    return input_ids, labels, mask, model.config.vocab_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_leak_between_packed_sequences_is_refused_whatever_the_precision(dtype):
    """Issue #48: in bf16 the comparison with separate forwards allows one unit in the last place of the largest
    log-prob or 4x the padded batch's own rounding, and this leak stays inside it (on transformers 5.19 the probe
    without the bitwise test returned None here): only the bitwise test (change one sequence, every other must
    not move) refuses it in bf16. In fp32 both do (the comparison by 2.5e-5 against its 1e-5)."""
    model = weak_context_llama(dtype, leaking=True)
    problem = packing_problem(model, scorer(model))
    assert problem is not None and problem.startswith("llama")
    model.eval()
    with torch.no_grad():
        leak = packed_sequences_leak(scorer(model), *probe_batch(model))
    assert leak is not None and "when sequence" in leak and "packed sequences that see each other" in leak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_sequences_that_do_not_see_each_other_keep_every_bit(dtype):
    """Without the leak the same model passes both checks in both precisions: changing one packed sequence leaves
    every other one's log-probs bitwise equal."""
    model = weak_context_llama(dtype, leaking=False)
    assert packing_problem(model, scorer(model)) is None
    model.eval()
    with torch.no_grad():
        assert packed_sequences_leak(scorer(model), *probe_batch(model)) is None


@pytest.mark.parametrize("before", [(False, False), (True, False), (True, True)])
def test_a_device_that_does_not_repeat_itself_cannot_pass_the_leak_test(before):
    """The control: the same packed input scored twice must match bitwise under torch's deterministic algorithms.
    Scores that differ by a rounding-sized amount from run to run (nondeterministic kernels, simulated here) make
    the probe refuse, saying why, instead of pass; the previous deterministic setting comes back either way."""
    model = build_tiny(*MODELS["llama"])
    real = scorer(model)
    deterministic_during_packed_calls = []

    def nondeterministic(input_ids, labels, mask, packed):
        log_probs = real(input_ids, labels, mask, packed)
        if not packed:
            return log_probs
        deterministic_during_packed_calls.append(torch.are_deterministic_algorithms_enabled())
        return log_probs + 1e-6 * torch.rand(log_probs.shape)  # well inside the comparison's 1e-5

    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    try:
        problem = packing_problem(model, nondeterministic)
        now = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
    assert problem is not None
    assert "differently on a second run with torch's deterministic algorithms on" in problem
    assert "nondeterministic kernels on cpu" in problem and "leak test cannot run" in problem
    assert deterministic_during_packed_calls[-2:] == [True, True]  # the control's two runs
    assert now == before


def test_packing_beats_sharing_by_the_positions_each_layout_computes():
    # Long-tailed completions under one prompt: shared = 40 + 4 x 59 = 276 positions, packed = 4 x 40 + 63 = 223.
    assert packing_beats_sharing([40] * 4, [60, 2, 3, 2], [40])
    # Equal completions under a long prompt: shared = 40 + 4 x 5 = 60, packed = 4 x 45 = 180.
    assert not packing_beats_sharing([40] * 4, [6] * 4, [40])


@pytest.mark.parametrize("architecture", ["llama", "mistral"])
def test_pack_and_share_together_score_like_one_unpadded_forward_per_sequence(architecture):
    """Both asked for: each batch takes one of the two layouts, and either scores exactly: group_batch shares
    (54 positions against 61 packed), a long-tailed batch packs (29 positions against 60 shared)."""
    model = build_tiny(*MODELS[architecture])
    assert_scored_like_one_unpadded_forward_per_sequence(model, share_prompts=True, pack_sequences=True)
    prompt_ids, completions = [[5, 6, 7]] * 3, [[8], [9, 10], list(range(11, 31))]
    batch = tokenize_prompt_and_output_ids(prompt_ids, completions, pad_token_id=0)
    mask = batch["response_mask"].bool()
    assert packing_beats_sharing([3] * 3, [1, 2, 20], [3])
    with torch.no_grad():
        scored = response_log_probs(
            model, batch["input_ids"], batch["labels"], mask, share_prompts=True, pack_sequences=True
        )["log_probs"][mask]
        expected = one_row_log_probs(model, prompt_ids, completions)
    torch.testing.assert_close(scored, expected, atol=1e-5, rtol=1e-5)
