"""Rollout contract: completions cut after EOS / stop strings (kept), ids line up with what the trainer scores."""

import pytest
import torch

from grpo_cli.core.tokenization import tokenize_prompt_and_output_ids
from grpo_cli.engines.hf import cut_completion
from grpo_cli.rollout import HFRolloutEngine, SamplingSettings, render_prompts


class CharTokenizer:
    """One token per character; id 0 is EOS, id 1 is PAD."""

    eos_token_id, pad_token_id = 0, 1

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if i in (0, 1) and skip_special_tokens else ("<eos>" if i == 0 else chr(i)) for i in ids)


def ids(text):
    return [ord(c) for c in text]


def test_cut_after_eos_keeps_the_eos_token():
    tok = CharTokenizer()
    out, finished = cut_completion(ids("ab") + [0, 1, 1], {0}, (), tok)
    assert out == ids("ab") + [0] and finished


def test_cut_after_stop_string_keeps_it_and_drops_the_rest():
    tok = CharTokenizer()
    out, finished = cut_completion(ids("x </answer> more"), {0}, ("</answer>",), tok)
    assert tok.decode(out) == "x </answer>" and finished


def test_earliest_of_eos_and_stop_wins():
    tok = CharTokenizer()
    out, _ = cut_completion(ids("ab") + [0] + ids("</answer>"), {0}, ("</answer>",), tok)
    assert out == ids("ab") + [0]


def test_no_eos_no_stop_is_truncated():
    tok = CharTokenizer()
    out, finished = cut_completion(ids("abc"), {0}, ("</answer>",), tok)
    assert out == ids("abc") and not finished


# vLLM's rule (grpo_cli/engines/stopping.py): a stop string counts only where it ends after the text of the first
# min_tokens tokens. One token per character here, so "ends after" is "ends at token min_tokens + 1 or later".


def test_a_stop_string_within_the_first_min_tokens_never_counts():
    tok = CharTokenizer()
    out, finished = cut_completion(ids("ab</answer>cdefgh"), {0}, ("</answer>",), tok, min_tokens=11)
    assert out == ids("ab</answer>cdefgh") and not finished  # it ends at token 11: within, and not later either
    out, _ = cut_completion(ids("ab</answer>cdefgh"), {0}, ("</answer>",), tok, min_tokens=10)
    assert tok.decode(out) == "ab</answer>"  # one token fewer held: it ends at token 11, after


def test_a_stop_string_straddling_min_tokens_counts_where_it_ends():
    tok = CharTokenizer()
    out, finished = cut_completion(ids("abcdefgh</answer>xyz"), {0}, ("</answer>",), tok, min_tokens=10)
    assert tok.decode(out) == "abcdefgh</answer>" and finished  # begun at token 9, ended at token 17


def test_the_first_stop_string_that_counts_cuts():
    tok = CharTokenizer()
    text = "</answer>abc</answer>z"
    assert tok.decode(cut_completion(ids(text), {0}, ("</answer>",), tok, min_tokens=8)[0]) == "</answer>"
    assert tok.decode(cut_completion(ids(text), {0}, ("</answer>",), tok, min_tokens=9)[0]) == "</answer>abc</answer>"


class PieceTokenizer:
    """Ids of byte strings, some of them part of a character, decoded as a byte-level tokenizer does (U+FFFD for
    an incomplete character)."""

    eos_token_id, pad_token_id = 0, 0
    pieces = {0: b"", 1: b"x", 2: b" \xf0", 3: b"\x9f\x98", 4: b"\x80", 5: b"y"}  # "x", " 😀" in three ids, "y"

    def decode(self, ids, skip_special_tokens=False):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_a_stop_string_is_completed_where_an_incremental_detokenizer_shows_it():
    """vLLM's detokenizer shows " 😀" only once its last byte is there: a stop string " " ends at the 4th id."""
    tok = PieceTokenizer()
    assert tok.decode([1, 2]) == "x \ufffd"
    assert cut_completion([1, 2, 3, 4, 5], {0}, (" ",), tok)[0] == [1, 2, 3, 4]
    # The first 2 ids have shown "x" only, so " " ends after them, and counts.
    assert cut_completion([1, 2, 3, 4, 5], {0}, (" ",), tok, min_tokens=2)[0] == [1, 2, 3, 4]


@pytest.fixture(scope="module")
def tiny():
    from grpo_cli.models import TINY_RANDOM, load_policy

    model, tokenizer = load_policy(TINY_RANDOM, torch.device("cpu"), torch.float32, seed=0)
    return model, tokenizer


def test_hf_engine_returns_n_completions_per_prompt_in_prompt_major_order(tiny):
    model, tokenizer = tiny
    engine = HFRolloutEngine(model, tokenizer)
    prompts = render_prompts([[{"role": "user", "content": "hi"}], "A much longer plain text prompt here"], tokenizer)
    batch = engine.generate(prompts, SamplingSettings(n=3, temperature=1.0, max_tokens=6, min_tokens=2, seed=1))
    assert len(batch.completion_ids) == 6
    assert batch.prompt_ids[:3] == [prompts[0]] * 3 and batch.prompt_ids[3:] == [prompts[1]] * 3
    for completion, truncated in zip(batch.completion_ids, batch.truncated, strict=True):
        assert 2 <= len(completion) <= 6
        assert truncated == (completion[-1] not in engine.eos_ids)


def test_sampling_is_seeded_and_greedy_is_deterministic(tiny):
    model, tokenizer = tiny
    engine = HFRolloutEngine(model, tokenizer)
    prompts = render_prompts(["one", "two three"], tokenizer)
    sample = SamplingSettings(n=2, temperature=1.0, max_tokens=8, seed=5)
    assert engine.generate(prompts, sample).completion_ids == engine.generate(prompts, sample).completion_ids
    greedy = SamplingSettings(n=1, temperature=0.0, max_tokens=8)
    first = engine.generate(prompts, greedy).completion_ids
    # chunked generation (one prompt per call, different padding) gives the same greedy tokens
    assert HFRolloutEngine(model, tokenizer, max_batch_prompts=1).generate(prompts, greedy).completion_ids == first


def test_response_mask_lines_up_with_sampled_ids(tiny):
    # The trainer scores exactly the sampled ids: the labels under the response mask must be them, in order.
    model, tokenizer = tiny
    engine = HFRolloutEngine(model, tokenizer)
    prompts = render_prompts(["short", "a somewhat longer prompt"], tokenizer)
    batch = engine.generate(prompts, SamplingSettings(n=2, temperature=1.0, max_tokens=7, seed=3))
    tensors = tokenize_prompt_and_output_ids(batch.prompt_ids, batch.completion_ids, tokenizer.pad_token_id)
    for row, completion in enumerate(batch.completion_ids):
        mask = tensors["response_mask"][row].bool()
        assert tensors["labels"][row][mask].tolist() == completion
    # and the sampled tokens' log-probs under the model are finite and match a full forward pass
    from grpo_cli.core import response_log_probs

    lp = response_log_probs(model, tensors["input_ids"], tensors["labels"], tensors["response_mask"])["log_probs"]
    full = torch.log_softmax(model(tensors["input_ids"]).logits.float(), -1)
    expected = full.gather(-1, tensors["labels"].unsqueeze(-1)).squeeze(-1) * tensors["response_mask"]
    torch.testing.assert_close(lp, expected, atol=1e-5, rtol=1e-5)
