"""The transformers engine's decode loop, its generate() fallback and the project's sampling function
(engines/decode.py, engines/hf_generate.py, engines/hf_internals.py, engines/sampling.py).

Tests marked with the `path` fixture run twice: on the decode loop and on the generate() fallback. Where the loop
does not run (its check against generate() fails on the installed transformers, `engines.loop_check`), the loop
runs are skipped with the reason, which is a pass for an install the project does not pin (.ci/readme_install);
GRPO_CLI_REQUIRE_DECODE_LOOP=1 (set by .ci/run, whose install pins a release the loop is tested on) turns those
skips into failures, so the loop cannot stop running there unnoticed.

- the loop is checked against generate() on the loaded model before it samples; where it disagrees (broken the
  ways a transformers release could break it) or fails, the engine samples through generate() and says so once;
- greedy decoding gives generate()'s tokens on every path (static cache with grouped attention, static cache with
  transformers' attention, the fallback), for each architecture the loop accepts (one tiny random model each,
  also under LoRA); the others go to the fallback, which gives generate()'s tokens too;
- the sampler's log-probs are the learner's (core.response_log_probs) for the sampled ids;
- samples come from softmax(logits / T) within the top-p nucleus (chi-square on many draws; a wrong temperature
  fails the same test);
- a completion's tokens depend on (seed, prompt index in the step, completion index) only: not on the other
  prompts of the batch, their padding, chunking, or where the loop stopped for stop strings;
- torch.compile failing falls back to eager with one log line;
- the decode steps' linear layers on few rows compute F.linear's product, by the faster kernel.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import replace

import pytest
import torch
import transformers
from transformers import GenerationConfig

from grpo_cli.core import response_log_probs, tokenize_prompt_and_output_ids
from grpo_cli.engines import hf, hf_internals, loop_check
from grpo_cli.engines.decode import CACHE_BUCKET, SKINNY_ROWS, Decoder, SkinnyLinear, left_pad
from grpo_cli.engines.hf import cut_completion
from grpo_cli.engines.hf_generate import GenerateDecoder
from grpo_cli.engines.sampling import (
    completion_seed,
    gumbel_max_,
    row_generators,
    sample_next_tokens,
    top_p_mask_,
)
from grpo_cli.rollout import HFRolloutEngine, SamplingSettings
from tests.conftest import TINY_LM_CONFIG, build_tiny_lm, random_weights

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
    weights large enough that greedy text varies and the next-token distribution is peaked.

    architecture: llama (tied embeddings), llama-untied, llama3-rope (Llama 3 rope scaling), qwen2 (qkv bias),
    qwen2-sliding (sliding-window layers), qwen3, mistral (no sliding window), mistral-sliding, gemma2.
    """
    common = dict(
        TINY_LM_CONFIG,
        vocab_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        eos_token_id=EOS,
        pad_token_id=PAD,
        bos_token_id=2,
        attn_implementation=attn_implementation,
    )
    if architecture == "gemma2":  # sliding-window layers and logit soft-capping
        # eager: transformers >= 5.21 refuses sdpa for Gemma 2 (what it picks by itself on a checkpoint).
        keys = dict(common, attn_implementation="eager", sliding_window=16, query_pre_attn_scalar=8)
        return build_tiny_lm("Gemma2ForCausalLM", "Gemma2Config", std, **keys).eval()
    if architecture in ("qwen2", "qwen2-sliding"):
        sliding = dict(use_sliding_window=True, sliding_window=6, max_window_layers=0)
        keys = dict(common, **(sliding if architecture == "qwen2-sliding" else {}))
        model = build_tiny_lm("Qwen2ForCausalLM", "Qwen2Config", std, **keys)
        assert model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's qkv bias
        return model.eval()
    if architecture == "qwen3":
        return build_tiny_lm("Qwen3ForCausalLM", "Qwen3Config", std, **common).eval()
    if architecture in ("mistral", "mistral-sliding"):
        window = 6 if architecture == "mistral-sliding" else None
        return build_tiny_lm("MistralForCausalLM", "MistralConfig", std, **common, sliding_window=window).eval()
    extra: dict = {"tie_word_embeddings": architecture != "llama-untied"}
    if architecture == "llama3-rope":
        extra["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,  # shorter than the prompts: the scaling is exercised
        }
    return build_tiny_lm("LlamaForCausalLM", "LlamaConfig", std, **common, **extra).eval()


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    """The model under peft LoRA adapters with non-zero B (so the adapters change the logits)."""
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]))
    return random_weights(wrapped, seed=1, only="lora_B").eval()


REQUIRE_LOOP = os.environ.get("GRPO_CLI_REQUIRE_DECODE_LOOP") == "1"


@pytest.fixture(params=["loop", "generate"])
def path(request, monkeypatch) -> str:
    """Runs a test on the decode loop and on the generate() fallback (forced as an unsupported transformers)."""
    if request.param == "generate":
        monkeypatch.setattr(hf_internals, "fast_path_problem", lambda model, device: "forced by the test")
    else:
        skip_without_the_loop()
    return request.param


def loop_not_running(problem: str) -> None:
    """Skip a loop test where the loop does not run here (a failure where the install must run it)."""
    message = f"the decode loop does not run here: {problem}"
    if REQUIRE_LOOP:
        pytest.fail(f"{message} (GRPO_CLI_REQUIRE_DECODE_LOOP=1)")
    pytest.skip(message)


def skip_without_the_loop() -> None:
    model = tiny_lm()
    problem = hf_internals.fast_path_problem(model, torch.device("cpu"))
    if problem is None:
        problem = loop_check.loop_disagreement(Decoder(model, CharTokenizer(), {EOS}), model, PROMPTS)
    if problem is not None:
        loop_not_running(problem)


def decoder_path(engine: HFRolloutEngine) -> str:
    return "loop" if isinstance(engine.decoder, Decoder) else "generate"


def assert_sampled_on(engine: HFRolloutEngine, path: str) -> None:
    """After a call: the engine sampled on `path` (a loop whose check failed on this model skips, as above)."""
    if path == "loop" and engine.loop_problem is not None:
        loop_not_running(engine.loop_problem)
    assert decoder_path(engine) == path


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


# Each architecture a preset names, as a tiny random model: whether the loop takes it, and with which attention.
LOOP_ARCHITECTURES = ["llama", "llama-untied", "llama3-rope", "qwen2", "qwen3", "mistral"]
FALLBACK_ARCHITECTURES = ["gemma2", "qwen2-sliding", "mistral-sliding"]


def assert_greedy_parity(model, engine) -> None:
    ours = engine.generate(PROMPTS, SamplingSettings(n=1, temperature=0.0, max_tokens=20)).completion_ids
    theirs = reference_greedy(model, PROMPTS, 20)
    assert ours == theirs
    assert max(len(set(ids)) for ids in ours) > 3  # varied text, so a wrong position or mask would show


@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("architecture", LOOP_ARCHITECTURES)
def test_greedy_tokens_are_generates_on_both_paths(architecture, lora, path):
    model = tiny_lm(architecture)
    model = with_lora(model) if lora else model
    engine = HFRolloutEngine(model, CharTokenizer())
    assert decoder_path(engine) == path
    if path == "loop":
        assert engine.decoder.static and engine.decoder.grouped_attention
    assert_greedy_parity(model, engine)
    assert_sampled_on(engine, path)


def test_greedy_tokens_are_generates_with_transformers_own_attention(path):
    model = tiny_lm("llama", attn_implementation="eager")
    engine = HFRolloutEngine(model, CharTokenizer())
    if path == "loop":
        assert engine.decoder.static and not engine.decoder.grouped_attention
    assert_greedy_parity(model, engine)
    assert_sampled_on(engine, path)


@pytest.mark.parametrize("architecture", FALLBACK_ARCHITECTURES)
def test_architectures_the_loop_was_not_checked_on_sample_through_generate(architecture, caplog):
    model = tiny_lm(architecture)
    with caplog.at_level(logging.WARNING):
        engine = HFRolloutEngine(model, CharTokenizer())
    assert decoder_path(engine) == "generate"
    ours = engine.generate(PROMPTS, SamplingSettings(n=1, temperature=0.0, max_tokens=20)).completion_ids
    assert ours == reference_greedy(model, PROMPTS, 20)


def test_a_transformers_older_than_the_loops_floor_means_generate_and_one_log_line(monkeypatch, caplog):
    # Patched on the module object hf_internals reads: in the full suite of 2026-11-25, patching this test module's
    # `transformers` left hf_internals reading 5.19.0 (the cause, which test's imports, is not found yet).
    monkeypatch.setattr(hf_internals.transformers, "__version__", "4.57.1")
    monkeypatch.setattr(hf, "_LOGGED", set())
    problem = hf_internals.fast_path_problem(tiny_lm(), torch.device("cpu"))
    assert problem is not None and "4.57.1" in problem
    with caplog.at_level(logging.WARNING):
        engines = [HFRolloutEngine(tiny_lm(), CharTokenizer()) for _ in range(2)]  # training and evaluation
    assert all(decoder_path(engine) == "generate" for engine in engines)
    lines = [r.getMessage() for r in caplog.records if "generate()" in r.getMessage()]
    assert len(lines) == 1 and "transformers 4.57.1" in lines[0]


def test_a_newer_transformers_release_is_checked_on_the_model_not_refused_by_version(monkeypatch, caplog):
    skip_without_the_loop()
    # a release after every one the tests ran on, on the module object hf_internals reads (see above)
    monkeypatch.setattr(hf_internals.transformers, "__version__", "9.0.0")
    monkeypatch.setattr(hf, "_LOGGED", set())
    assert hf_internals.fast_path_problem(tiny_lm(), torch.device("cpu")) is None
    engine = HFRolloutEngine(tiny_lm(), CharTokenizer())
    with caplog.at_level(logging.INFO):
        assert_greedy_parity(engine.model, engine)
        engine.generate(PROMPTS, SamplingSettings(n=2, temperature=1.0, max_tokens=6))
    assert decoder_path(engine) == "loop" and engine.loop_problem is None
    lines = [r.getMessage() for r in caplog.records if r.name == hf.log.name]
    assert lines == [
        "rollout: sampling with the decode loop (its first 8 greedy tokens on this model equal "
        "generate()'s under transformers 9.0.0)"
    ]


def shift_decode_positions(monkeypatch) -> None:
    """The decode steps see positions one too far (a release reading position ids differently would do this)."""
    step = Decoder._decode_step
    monkeypatch.setattr(
        Decoder, "_decode_step", lambda self, ids, positions, mask, cache: step(self, ids, positions + 1, mask, cache)
    )


def cache_off_by_one(monkeypatch) -> None:
    """The static cache's fill count one short: the first decode step overwrites the last prompt position's keys
    (a release counting cache positions differently would do this)."""
    copy = hf_internals.copy_prefill_into_static

    def shifted(static, prefix, n, width):
        copied = copy(static, prefix, n, width)
        for layer in static.layers:
            layer.cumulative_length.fill_(width - 1)
        return copied

    monkeypatch.setattr(hf_internals, "copy_prefill_into_static", shifted)


def cache_argument_ignored(monkeypatch) -> None:
    """The decode steps pass the cache under a keyword the model does not read (what a renamed keyword becomes
    once the old name's deprecation period is over)."""
    monkeypatch.setattr(hf_internals, "cache_keyword", lambda model: "kv_cache_that_was_renamed")


def internal_removed(monkeypatch) -> None:
    def missing(*args, **kwargs):
        raise AttributeError("'StaticCache' object has no attribute 'early_initialization'")

    monkeypatch.setattr(hf_internals, "new_static_cache", missing)


BREAKAGES = {
    "positions": shift_decode_positions,
    "cache_off_by_one": cache_off_by_one,
    "cache_argument": cache_argument_ignored,
    "internal_removed": internal_removed,
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_a_loop_that_disagrees_with_generate_is_not_used_and_says_so_once(breakage, monkeypatch, caplog):
    skip_without_the_loop()
    monkeypatch.setattr(hf, "_LOGGED", set())
    BREAKAGES[breakage](monkeypatch)
    model = tiny_lm()
    with caplog.at_level(logging.WARNING):
        engines = [HFRolloutEngine(model, CharTokenizer()) for _ in range(2)]  # training and evaluation
        for engine in engines:
            ours = [engine.generate(PROMPTS, SamplingSettings(temperature=0.0, max_tokens=20)) for _ in range(2)]
            assert decoder_path(engine) == "generate" and engine.loop_problem is not None
            assert all(batch.completion_ids == reference_greedy(model, PROMPTS, 20) for batch in ours)
    lines = [r.getMessage() for r in caplog.records if r.name == hf.log.name]
    assert len(lines) == 1, lines
    assert lines[0].startswith("rollout: the decode loop") and "transformers " + transformers.__version__ in lines[0]
    assert lines[0].endswith("sampling with transformers' generate() instead (same samples, slower)")


def test_under_bf16_autocast_the_loop_is_also_checked_in_full_precision(monkeypatch):
    """bf16 rounding hides a subtle error from a comparison in bf16; the full-precision one on the same path
    (the dynamic cache, which autocast takes) does not."""
    skip_without_the_loop()
    model = tiny_lm(std=0.3)  # flat enough that shifted positions stay below bf16's tolerance
    greedy = SamplingSettings(temperature=0.0, max_tokens=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        healthy = HFRolloutEngine(model, CharTokenizer())
        healthy.generate(PROMPTS, greedy)
        assert decoder_path(healthy) == "loop"
        shift_decode_positions(monkeypatch)
        assert loop_check._compare(healthy.decoder, model, PROMPTS, loop_check.TOLERANCE_HALF, static=True) is None
        broken = HFRolloutEngine(model, CharTokenizer())
        broken.generate(PROMPTS, greedy)
    assert decoder_path(broken) == "generate" and "log-probs" in broken.loop_problem


def test_the_check_tolerates_a_near_tie_and_nothing_else():
    eos = {EOS}
    reference = torch.tensor([[5, 6, 7]])
    log_softmax = torch.full((1, 3, 8), -10.0)
    log_softmax[0, 0, 5], log_softmax[0, 1, 6], log_softmax[0, 2, 7] = -0.1, -0.5, -0.2
    log_softmax[0, 1, 3] = -0.5 - 1e-4  # token 3 nearly ties with token 6 at step 1
    same = ([[5, 6, 7]], [[-0.1, -0.5, -0.2]])
    assert loop_check.first_disagreement(*same, reference, log_softmax, eos, 1e-3) is None
    near_tie = ([[5, 3, 1]], [[-0.1, -0.5 - 1e-4, -9.0]])  # diverges after the tie: not compared
    assert loop_check.first_disagreement(*near_tie, reference, log_softmax, eos, 1e-3) is None
    assert "picked 4" in loop_check.first_disagreement(
        [[5, 4, 7]], [[-0.1, -10.0, -0.2]], reference, log_softmax, eos, 1e-3
    )
    assert "log-probs 0.01" in loop_check.first_disagreement(
        [[5, 6, 7]], [[-0.1, -0.51, -0.2]], reference, log_softmax, eos, 1e-3
    )
    ended = torch.tensor([[5, EOS, PAD]])  # generate() pads a row after its EOS; the loop samples on
    log_softmax[0, 1, EOS] = -0.01
    assert loop_check.first_disagreement([[5, EOS, 9]], [[-0.1, -0.01, -3.0]], ended, log_softmax, eos, 1e-3) is None


def test_rollout_decoder_generate_samples_through_generate(monkeypatch, caplog):
    monkeypatch.setattr(hf, "_LOGGED", set())
    with caplog.at_level(logging.INFO):
        engine = HFRolloutEngine(tiny_lm(), CharTokenizer(), decoder="generate")
        assert_greedy_parity(engine.model, engine)
    assert decoder_path(engine) == "generate" and engine.loop_problem is None
    lines = [r.getMessage() for r in caplog.records if r.name == hf.log.name]
    assert lines == ["rollout: sampling with transformers' generate() (rollout.decoder=generate)"]


def test_quantized_layers_and_other_adapters_go_to_generate():
    from peft import LoraConfig, get_peft_model

    model = tiny_lm()
    model.is_quantized = True  # what transformers sets on a bitsandbytes-loaded model
    assert "quantized" in hf_internals.fast_path_problem(model, torch.device("cpu"))
    dora = get_peft_model(tiny_lm(), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    assert "DoRA" in hf_internals.fast_path_problem(dora, torch.device("cpu"))
    assert "device" in hf_internals.fast_path_problem(tiny_lm(), torch.device("meta"))


def test_nothing_is_registered_in_transformers_tables_outside_the_decode_steps(path):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = tiny_lm()
    engine = HFRolloutEngine(model, CharTokenizer())
    assert hf_internals.DECODE_ATTENTION not in ALL_ATTENTION_FUNCTIONS
    engine.generate(PROMPTS, SamplingSettings(n=2, temperature=1.0, max_tokens=6))
    assert hf_internals.DECODE_ATTENTION not in ALL_ATTENTION_FUNCTIONS
    assert model.config._attn_implementation == "sdpa"


def test_the_fallback_samples_the_loops_completions():
    skip_without_the_loop()
    model = tiny_lm(std=0.3)
    settings = SamplingSettings(n=3, temperature=0.9, top_p=0.95, max_tokens=12, min_tokens=2, seed=5, stop=("x",))
    loop = HFRolloutEngine(model, CharTokenizer()).generate(PROMPTS, settings)
    fallback = HFRolloutEngine(model, CharTokenizer())
    fallback.decoder = GenerateDecoder(model, CharTokenizer(), {EOS})
    other = fallback.generate(PROMPTS, settings)
    assert other.completion_ids == loop.completion_ids
    for ours, theirs in zip(other.sampler_log_probs, loop.sampler_log_probs, strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), atol=1e-4, rtol=1e-4)


def test_the_fallback_ignores_the_checkpoints_generation_config(monkeypatch):
    monkeypatch.setattr(hf_internals, "fast_path_problem", lambda model, device: "forced by the test")
    model = tiny_lm()
    plain = HFRolloutEngine(model, CharTokenizer()).generate(PROMPTS, SamplingSettings(temperature=0.0, max_tokens=16))
    model.generation_config.repetition_penalty = 50.0  # would change greedy text if generate() applied it
    model.generation_config.no_repeat_ngram_size = 1
    again = HFRolloutEngine(model, CharTokenizer()).generate(PROMPTS, SamplingSettings(temperature=0.0, max_tokens=16))
    assert again.completion_ids == plain.completion_ids
    assert model.generation_config.repetition_penalty == 50.0  # restored after the call


# --- the sampler's log-probs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_sampler_log_probs_are_the_learners_log_probs(temperature, path):
    model = tiny_lm(std=0.3)
    engine = HFRolloutEngine(model, CharTokenizer())
    settings = SamplingSettings(n=2, temperature=temperature, top_p=0.9, max_tokens=10, min_tokens=3, seed=4)
    batch = engine.generate(PROMPTS, settings)
    assert [len(lp) for lp in batch.sampler_log_probs] == [len(ids) for ids in batch.completion_ids]
    scored = tokenize_prompt_and_output_ids(batch.prompt_ids, batch.completion_ids, PAD)
    with torch.no_grad():
        learner = response_log_probs(
            model,
            scored["input_ids"],
            scored["labels"],
            response_mask=scored["response_mask"],
            temperature=temperature if temperature > 0 else 1.0,
        )["log_probs"]
    for row, sampled in enumerate(batch.sampler_log_probs):
        recomputed = learner[row][scored["response_mask"][row]]
        torch.testing.assert_close(torch.tensor(sampled), recomputed, atol=1e-4, rtol=1e-4)


def test_prompts_of_other_lengths_reuse_one_cache(path):
    if path == "generate":
        pytest.skip("generate() keeps no cache between calls")
    engine = HFRolloutEngine(tiny_lm(), CharTokenizer())
    greedy = SamplingSettings(n=2, temperature=0.0, max_tokens=8)
    engine.generate(PROMPTS[:2], greedy)
    engine.generate([[2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [2, 9]], greedy)
    assert_sampled_on(engine, path)
    assert len(engine.decoder._caches) == 1
    (rows, length, *_rest) = next(iter(engine.decoder._caches))
    assert rows == 4 and length == CACHE_BUCKET


# --- batch invariance ------------------------------------------------------------------------------------------


def test_a_completion_depends_only_on_its_seed_prompt_index_and_completion_index(path):
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


def test_stopping_for_stop_strings_does_not_change_the_tokens_before_the_cut(path):
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


def test_the_engines_first_tokens_follow_the_models_distribution(path):
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


def test_min_tokens_holds_eos_back(path):
    model = tiny_lm(std=0.3)
    with torch.no_grad():
        model.lm_head.bias = None
        model.lm_head.weight[EOS] += 5.0 * model.model.norm.weight.sign()  # EOS likely everywhere
    engine = HFRolloutEngine(model, CharTokenizer())
    free = engine.generate(PROMPTS, SamplingSettings(n=2, temperature=1.0, max_tokens=12, seed=1)).completion_ids
    held = engine.generate(PROMPTS, SamplingSettings(n=2, temperature=1.0, max_tokens=12, min_tokens=5, seed=1))
    assert min(len(ids) for ids in free) < 5
    assert all(len(ids) >= 5 and EOS not in ids[:4] for ids in held.completion_ids)


# (first, end): the stop string is the greedy text's characters first..end-1 (one token per character), so it is
# completed by token `end`; with min_tokens=10, vLLM's rule (engines.stopping) keeps it from ending the
# completion unless it ends after the first 10 tokens' text, i.e. end > 10.
STOP_CASES = {
    "the first token": (0, 1, None),
    "within, ending at token 9": (7, 9, None),
    "ending where min_tokens ends": (8, 10, None),
    "straddling the boundary": (8, 11, 11),
    "after the boundary": (11, 13, 13),
}


@pytest.mark.parametrize("case", list(STOP_CASES))
def test_a_stop_string_ends_a_completion_only_past_min_tokens_as_in_vllm(case, path):
    first, end, expected = STOP_CASES[case]
    engine = HFRolloutEngine(tiny_lm(), CharTokenizer())
    settings = SamplingSettings(n=1, temperature=0.0, max_tokens=20, min_tokens=10)
    free = engine.generate(PROMPTS[:1], settings).completion_ids[0]
    assert len(free) == 20 and EOS not in free  # the greedy text runs to max_tokens without EOS
    text = CharTokenizer().decode(free)
    stop = text[first:end]
    # The first occurrence is this one; one that cannot count has no later occurrence that would.
    assert text.find(stop) == first and (expected is not None or text.count(stop) == 1)
    no_minimum = engine.generate(PROMPTS[:1], replace(settings, min_tokens=0, stop=(stop,)))
    assert no_minimum.completion_ids == [free[:end]]  # the stop string ends a completion without min_tokens
    held = engine.generate(PROMPTS[:1], replace(settings, stop=(stop,)))
    assert held.completion_ids == [free[: expected or 20]]
    assert held.truncated == [expected is None]
    assert_sampled_on(engine, path)


# --- torch.compile ---------------------------------------------------------------------------------------------


def test_a_failing_compiler_falls_back_to_eager_with_one_log_line(monkeypatch, caplog):
    def broken_compile(fn, **kwargs):
        def compiled(*args, **kw):
            raise RuntimeError("no C++ compiler")

        return compiled

    skip_without_the_loop()
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

    skip_without_the_loop()
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
