"""The transformers engine's decode loop and the project's sampling function (rollout/decode.py, rollout/sampling.py).

- greedy decoding gives generate()'s tokens on every cache/attention path (static cache with grouped attention,
  static cache with transformers' attention, dynamic cache);
- samples come from softmax(logits / T) within the top-p nucleus (chi-square on many draws; a wrong temperature
  fails the same test);
- a completion's tokens depend on (seed, prompt index in the step, completion index) only: not on the other
  prompts of the batch, their padding, chunking, or where the loop stopped for stop strings;
- torch.compile failing falls back to eager with one log line;
- the decode steps' linear layers on few rows compute F.linear's product, by the faster kernel.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import transformers
from transformers import GenerationConfig

from grpo_cli.rollout import HFRolloutEngine, SamplingSettings
from grpo_cli.rollout.decode import CACHE_BUCKET, SKINNY_ROWS, SkinnyLinear, left_pad
from grpo_cli.rollout.hf import cut_completion
from grpo_cli.rollout.sampling import (
    completion_seed,
    gumbel_max_,
    row_generators,
    sample_next_tokens,
    top_p_mask_,
)

EOS, PAD = 0, 1


@pytest.fixture(autouse=True)
def _one_thread():
    """Models this small gain nothing from a second thread, and lose a lot on a busy machine (every op waits for
    the other thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class CharTokenizer:
    """One token per character (ids 0-127); id 0 is EOS, id 1 is PAD."""

    eos_token_id, pad_token_id = EOS, PAD

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if i in (EOS, PAD) and skip_special_tokens else chr(i) for i in ids)


def tiny_lm(architecture: str = "llama", attn_implementation: str = "sdpa", std: float = 0.5) -> torch.nn.Module:
    """A 2-layer causal LM with grouped-query attention (4 query heads, 2 key/value heads) and 128 tokens, with
    weights large enough that greedy text varies and the next-token distribution is peaked."""
    common = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        eos_token_id=EOS,
        pad_token_id=PAD,
        bos_token_id=2,
        attn_implementation=attn_implementation,
    )
    if architecture == "gemma2":  # sliding-window layers: the dynamic-cache path
        config = transformers.Gemma2Config(**common, sliding_window=16, query_pre_attn_scalar=8)
        model = transformers.Gemma2ForCausalLM(config)
    elif architecture == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, std)
    return model.eval()


PROMPTS = [[2, 40, 41, 42], [2, 50, 51, 52, 53, 54, 55, 56, 57], [2, 60], [2, 70, 71, 72, 73, 74]]


def reference_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    input_ids, mask = left_pad(prompts, PAD)
    with torch.no_grad():
        sequences = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            generation_config=GenerationConfig(
                max_new_tokens=max_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=PAD
            ),
        )
    return [cut_completion(ids, {EOS}, (), CharTokenizer())[0] for ids in sequences[:, input_ids.shape[1] :].tolist()]


# --- greedy parity ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("architecture", "attention", "static", "grouped"),
    [
        ("llama", "sdpa", True, True),
        ("qwen2", "sdpa", True, True),
        ("llama", "eager", True, False),
        ("gemma2", "sdpa", False, False),
    ],
    ids=["llama-grouped", "qwen2-grouped", "llama-eager-attention", "gemma2-dynamic-cache"],
)
def test_greedy_tokens_are_generates(architecture, attention, static, grouped):
    model = tiny_lm(architecture, attention)
    engine = HFRolloutEngine(model, CharTokenizer())
    assert (engine.decoder.static, engine.decoder.grouped_attention) == (static, grouped)
    ours = engine.generate(PROMPTS, SamplingSettings(n=1, temperature=0.0, max_tokens=20)).completion_ids
    theirs = reference_greedy(model, PROMPTS, 20)
    assert ours == theirs
    if architecture != "gemma2":  # (the random gemma2 repeats its last prompt token; parity still holds)
        assert max(len(set(ids)) for ids in ours) > 3  # varied text, so a wrong position or mask would show


def test_prompts_of_other_lengths_reuse_one_cache():
    engine = HFRolloutEngine(tiny_lm(), CharTokenizer())
    greedy = SamplingSettings(n=2, temperature=0.0, max_tokens=8)
    engine.generate(PROMPTS[:2], greedy)
    engine.generate([[2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [2, 9]], greedy)
    assert len(engine.decoder._caches) == 1
    (rows, length, *_rest) = next(iter(engine.decoder._caches))
    assert rows == 4 and length == CACHE_BUCKET


# --- batch invariance ------------------------------------------------------------------------------------------


def test_a_completion_depends_only_on_its_seed_prompt_index_and_completion_index():
    engine = HFRolloutEngine(tiny_lm(std=0.3), CharTokenizer())
    settings = SamplingSettings(n=3, temperature=1.0, max_tokens=10, min_tokens=2, seed=11)
    whole = engine.generate(PROMPTS, settings).completion_ids
    first_half = engine.generate(PROMPTS[:2], settings).completion_ids
    second_half = engine.generate(PROMPTS[2:], replace(settings, first_prompt_index=2)).completion_ids
    assert first_half + second_half == whole
    chunked = HFRolloutEngine(engine.model, CharTokenizer(), max_batch_prompts=1)
    assert chunked.generate(PROMPTS, settings).completion_ids == whole
    assert len({tuple(ids) for ids in whole[:3]}) > 1  # the n completions of a prompt differ
    other_seed = engine.generate(PROMPTS, replace(settings, seed=12)).completion_ids
    assert other_seed != whole


def test_stopping_for_stop_strings_does_not_change_the_tokens_before_the_cut():
    engine = HFRolloutEngine(tiny_lm(std=0.3), CharTokenizer())
    settings = SamplingSettings(n=4, temperature=1.0, max_tokens=30, seed=3)
    full = engine.generate(PROMPTS, settings).completion_ids
    stop = (chr(full[0][3]),)  # a character the first completion samples early
    stopped = engine.generate(PROMPTS, replace(settings, stop=stop))
    assert stopped.completion_ids == [cut_completion(ids, {EOS}, stop, CharTokenizer())[0] for ids in full]
    assert len(stopped.completion_ids[0]) <= 4


def test_completion_seeds_differ_across_neighbours_and_fit_in_63_bits():
    seeds = {completion_seed(s, p, c) for s in range(3) for p in range(4) for c in range(4)}
    assert len(seeds) == 48 and all(0 <= s < 2**63 for s in seeds)
    assert completion_seed(-5, 1, 2) == completion_seed(-5, 1, 2)


# --- the sampling distribution ---------------------------------------------------------------------------------


def chi_square_rejects(counts: torch.Tensor, probs: torch.Tensor, alpha_z: float = 3.09) -> bool:
    """Whether Pearson's chi-square test rejects `probs` for `counts` at about p = 1e-3 (z = 3.09), categories
    with an expected count under 5 lumped together. Critical value by the Wilson-Hilferty approximation."""
    total = counts.sum().item()
    expected = probs.double() * total
    big = expected >= 5
    observed = torch.cat([counts[big].double(), counts[~big].double().sum().view(1)])
    expected = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = expected > 0
    if (observed[~keep] > 0).any():
        return True  # a category of probability 0 was sampled
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    dof = int(keep.sum().item()) - 1
    critical = dof * (1 - 2 / (9 * dof) + alpha_z * math.sqrt(2 / (9 * dof))) ** 3
    return statistic > critical


def draw_counts(logits: torch.Tensor, draws: int, temperature: float, top_p: float) -> torch.Tensor:
    generators = row_generators(seed=7, first_prompt_index=0, n_prompts=1, n=draws)
    tokens = sample_next_tokens(logits.expand(draws, -1).clone(), temperature, top_p, generators)
    return torch.bincount(tokens, minlength=logits.shape[-1])


def test_gumbel_max_samples_softmax_of_logits_over_temperature():
    torch.manual_seed(0)
    logits = torch.randn(600) * 2.5  # 600 entries: not a multiple of the block, so the padding is exercised
    counts = draw_counts(logits, 6000, temperature=0.7, top_p=1.0)
    assert not chi_square_rejects(counts, torch.softmax(logits / 0.7, -1))
    assert chi_square_rejects(counts, torch.softmax(logits / 1.0, -1))  # the test can tell temperatures apart
    assert chi_square_rejects(counts, torch.softmax(logits / 0.5, -1))


def test_top_p_keeps_the_nucleus_and_its_proportions():
    torch.manual_seed(1)
    logits = torch.randn(300) * 2.0
    probs = torch.softmax(logits, -1)
    ordered, order = probs.sort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order] = (ordered.cumsum(0) - ordered) < 0.6  # kept when the mass ranked above is below top_p
    counts = draw_counts(logits, 4000, temperature=1.0, top_p=0.6)
    assert counts[~keep].sum() == 0
    nucleus = torch.where(keep, probs, 0.0)
    assert not chi_square_rejects(counts, nucleus / nucleus.sum())


def test_top_p_mask_matches_transformers_and_its_sort_fallback():
    from transformers.generation.logits_process import TopPLogitsWarper

    torch.manual_seed(2)
    logits = torch.randn(5, 3000) * 3
    for top_p in (0.3, 0.9, 0.999):
        theirs = TopPLogitsWarper(top_p)(None, logits.clone())
        assert torch.equal(top_p_mask_(logits.clone(), top_p).isinf(), theirs.isinf())
        # a candidate list too short for the nucleus falls back to a full sort
        assert torch.equal(top_p_mask_(logits.clone(), top_p, candidates=8).isinf(), theirs.isinf())


def test_each_row_draws_from_its_own_stream_whatever_the_batch():
    torch.manual_seed(3)
    logits = torch.randn(4, 1000)
    seeds = [completion_seed(9, p, 0) for p in range(4)]

    def generators(rows):
        return [torch.Generator().manual_seed(seeds[r]) for r in rows]

    together = gumbel_max_(logits.clone(), generators(range(4)))
    first, second = (
        gumbel_max_(logits[:2].clone(), generators([0, 1])),
        gumbel_max_(logits[2:].clone(), generators([2, 3])),
    )
    apart = torch.cat([first, second])
    assert torch.equal(together, apart)


def test_the_engines_first_tokens_follow_the_models_distribution():
    model = tiny_lm(std=0.7)  # peaked: a few likely tokens
    engine = HFRolloutEngine(model, CharTokenizer())
    prompt = PROMPTS[1]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    counts = torch.zeros(128, dtype=torch.long)
    for seed in range(6):
        batch = engine.generate([prompt], SamplingSettings(n=500, temperature=0.8, top_p=1.0, max_tokens=1, seed=seed))
        counts += torch.bincount(torch.tensor([ids[0] for ids in batch.completion_ids]), minlength=128)
    assert torch.softmax(logits, -1).max() > 0.2 and counts.sum() == 3000
    assert not chi_square_rejects(counts, torch.softmax(logits / 0.8, -1))
    assert chi_square_rejects(counts, torch.softmax(logits / 1.0, -1))


def test_min_tokens_holds_eos_back():
    model = tiny_lm(std=0.3)
    with torch.no_grad():
        model.lm_head.bias = None
        model.lm_head.weight[EOS] += 5.0 * model.model.norm.weight.sign()  # EOS likely everywhere
    engine = HFRolloutEngine(model, CharTokenizer())
    free = engine.generate(PROMPTS, SamplingSettings(n=2, temperature=1.0, max_tokens=12, seed=1)).completion_ids
    held = engine.generate(PROMPTS, SamplingSettings(n=2, temperature=1.0, max_tokens=12, min_tokens=5, seed=1))
    assert min(len(ids) for ids in free) < 5
    assert all(len(ids) >= 5 and EOS not in ids[:4] for ids in held.completion_ids)


# --- torch.compile ---------------------------------------------------------------------------------------------


def test_a_failing_compiler_falls_back_to_eager_with_one_log_line(monkeypatch, caplog):
    def broken_compile(fn, **kwargs):
        def compiled(*args, **kw):
            raise RuntimeError("no C++ compiler")

        return compiled

    model = tiny_lm()
    eager = HFRolloutEngine(model, CharTokenizer()).generate(PROMPTS, SamplingSettings(temperature=0.0, max_tokens=12))
    monkeypatch.setattr(torch, "compile", broken_compile)
    engine = HFRolloutEngine(model, CharTokenizer(), compile="always")
    with caplog.at_level("WARNING"):
        for _ in range(2):
            out = engine.generate(PROMPTS, SamplingSettings(temperature=0.0, max_tokens=12))
            assert out.completion_ids == eager.completion_ids
    assert len([r for r in caplog.records if "torch.compile" in r.getMessage()]) == 1
    assert not engine.decoder.compile


@pytest.mark.slow
def test_the_compiled_decode_step_gives_eagers_tokens_without_recompiling_per_prompt_length():
    import torch._dynamo

    model = tiny_lm()
    greedy = SamplingSettings(n=2, temperature=0.0, max_tokens=12)
    eager = HFRolloutEngine(model, CharTokenizer(), compile="never")
    engine = HFRolloutEngine(model, CharTokenizer(), compile="always")
    torch._dynamo.reset()
    assert engine.generate(PROMPTS, greedy).completion_ids == eager.generate(PROMPTS, greedy).completion_ids
    assert engine.decoder.compile  # it compiled (no fallback)
    with torch._dynamo.config.patch(error_on_recompile=True):
        other_lengths = [[2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [2, 3], [2, 20, 21], [2, 30]]
        compiled = engine.generate(other_lengths, greedy).completion_ids
        assert compiled == eager.generate(other_lengths, greedy).completion_ids


def test_skinny_linear_computes_f_linear_on_few_rows_and_leaves_everything_else_alone(monkeypatch):
    torch.manual_seed(0)
    weight, bias = torch.randn(300, 40), torch.randn(300)
    few, many = torch.randn(4, 1, 40), torch.randn(SKINNY_ROWS + 1, 40)
    calls = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *args: calls.append(args[0].shape) or mm(*args))
    with torch.no_grad(), SkinnyLinear():
        out_few = torch.nn.functional.linear(few, weight, bias)
        out_many = torch.nn.functional.linear(many, weight, bias)
    assert calls == [(300, 40)]  # W @ x^T for the few rows only
    assert out_few.shape == (4, 1, 300) and out_few.is_contiguous()
    torch.testing.assert_close(out_few, torch.nn.functional.linear(few, weight, bias))
    assert torch.equal(out_many, torch.nn.functional.linear(many, weight, bias))
    with SkinnyLinear():  # with autograd on (a training forward): F.linear itself, never the rewrite
        torch.nn.functional.linear(few, weight.requires_grad_(), bias)
    assert len(calls) == 1
