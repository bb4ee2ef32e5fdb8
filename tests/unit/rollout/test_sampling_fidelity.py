"""What the trainer scores is what the engine sampled, with the weights it trains: the silent learning bugs of
issue #14, each pinned by a test that failed before its fix.

- model.dtype=auto keeps fp32 master weights on CUDA (bf16 only as autocast compute);
- the HF engine samples from our settings alone, not from the checkpoint's generation_config;
- scoring divides the logits by the sampling temperature, like sampling did;
- the logits go through the architecture's own head semantics (soft-capping, logit scales);
- no-grad scoring passes (old and reference log-probs) run in eval mode (no dropout noise);
- a torn last line of metrics.jsonl is dropped on resume.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GenerationConfig

from grpo_cli.batch.forward import ScoringSettings, per_completion_log_probs
from grpo_cli.batch.rollout_data import RolloutData
from grpo_cli.core import LOGITS_CHUNK_TOKENS, response_log_probs, tokenize_prompt_and_output_ids
from grpo_cli.models import TINY_RANDOM, apply_lora, load_policy
from grpo_cli.models.runtime import compute_dtype, pure_half_precision_warning, resolve_dtype
from grpo_cli.rollout import HFRolloutEngine, SamplingSettings
from grpo_cli.tracking import read_metrics, truncate_metrics
from tests.conftest import random_weights, tiny_head_lm

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


@pytest.fixture
def tiny():
    return load_policy(TINY_RANDOM, CPU, torch.float32, seed=0)


def fake_cuda(monkeypatch, bf16: bool = True) -> None:
    """A CUDA device as the decision points see it (this machine has none)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)


# --- precision ------------------------------------------------------------------------------------------------


def test_auto_dtype_on_cuda_is_fp32_master_weights_with_bf16_compute(monkeypatch):
    fake_cuda(monkeypatch)
    # Before the fix `auto` cast the weights (and so AdamW's state) to bf16 on CUDA: a 1e-5 step rounds away.
    assert resolve_dtype("auto", CUDA) == torch.float32
    assert compute_dtype(CUDA, "auto") == torch.bfloat16
    assert compute_dtype(CUDA, "no") is None
    assert pure_half_precision_warning("auto") is None


def test_auto_compute_on_a_cpu_without_fast_bf16_stays_fp32(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert resolve_dtype("auto", CPU) == torch.float32 and compute_dtype(CPU, "auto") is None
    assert compute_dtype(CPU, "bf16") == torch.bfloat16


def test_pure_bf16_weights_only_when_asked_and_with_one_warning_line():
    assert resolve_dtype("bfloat16", CUDA) == torch.bfloat16
    warning = pure_half_precision_warning("bfloat16")
    assert warning is not None and "\n" not in warning and "model.dtype=auto" in warning


def test_why_bf16_master_weights_lose_updates():
    # The arithmetic behind the fix: an lr-1e-5 AdamW step (|update| ~ lr) on weights near 1.0 (norms) is below
    # half a bf16 ulp (2^-8), so it rounds away entirely; fp32 keeps it.
    weights = torch.ones(1000)
    step = torch.full((1000,), 1e-5)
    assert torch.equal((weights.bfloat16() - step.bfloat16()).float(), weights)
    assert not torch.equal(weights - step, weights)


# --- sampling distribution --------------------------------------------------------------------------------------


def test_hf_engine_ignores_the_checkpoints_generation_config(tiny):
    model, tokenizer = tiny
    with torch.no_grad():  # a peaked distribution (~20 likely tokens) repeats itself, so the penalty would bite
        model.get_input_embeddings().weight.mul_(10.0)
    prompts = [tokenizer("Hello there")["input_ids"], tokenizer("A cat")["input_ids"]]
    settings = SamplingSettings(n=3, temperature=1.0, top_p=1.0, max_tokens=24, seed=5)
    plain = HFRolloutEngine(model, tokenizer).generate(prompts, settings)
    # Qwen2.5-Instruct ships settings like these; generate() would merge them into every call.
    model.generation_config.repetition_penalty = 5.0
    model.generation_config.top_k = 3
    model.generation_config.no_repeat_ngram_size = 2
    shipped = HFRolloutEngine(model, tokenizer).generate(prompts, settings)
    assert shipped.completion_ids == plain.completion_ids
    assert model.generation_config.repetition_penalty == 5.0  # the model's own config is left as it was


def group_batch(tokenizer) -> dict[str, torch.Tensor]:
    prompts = [tokenizer("The sea is")["input_ids"], tokenizer("Two plus two")["input_ids"]]
    completions = [[300, 301, 302, 303], [400, 401]]
    return tokenize_prompt_and_output_ids(prompts, completions, tokenizer.pad_token_id)


def manual_log_probs(model, batch, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits.float() / temperature
    full = torch.log_softmax(logits, -1).gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
    return full * batch["response_mask"]


def test_scored_log_probs_are_those_of_the_sampling_temperature(tiny):
    model, tokenizer = tiny
    batch = group_batch(tokenizer)
    mask = batch["response_mask"]
    with torch.no_grad():
        scored = response_log_probs(model, batch["input_ids"], batch["labels"], mask, temperature=0.5)["log_probs"]
    torch.testing.assert_close(scored, manual_log_probs(model, batch, 0.5), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(scored, manual_log_probs(model, batch, 1.0), atol=1e-3)


def test_old_and_reference_log_probs_use_the_sampling_temperature(tiny):
    model, tokenizer = tiny
    batch = group_batch(tokenizer)
    data = RolloutData(
        prompt_ids=[tokenizer("The sea is")["input_ids"], tokenizer("Two plus two")["input_ids"]],
        completion_ids=[[300, 301, 302, 303], [400, 401]],
        raw_rewards=torch.zeros(2),
        advantages=torch.zeros(2),
    )
    scoring = ScoringSettings(
        temperature=0.5,
        share_prompts=False,
        logits_chunk_tokens=LOGITS_CHUNK_TOKENS,
        microbatch_size=2,
        pad_token_id=tokenizer.pad_token_id,
    )
    per_completion = per_completion_log_probs(model, data, CPU, scoring)
    expected = manual_log_probs(model, batch, 0.5)
    for row, values in enumerate(per_completion):
        torch.testing.assert_close(values, expected[row][batch["response_mask"][row]], atol=1e-5, rtol=1e-5)


def test_learner_scores_at_rollout_temperature(tmp_path, monkeypatch, letter_e_task):
    from rich.console import Console

    from grpo_cli.batch import forward as batch_module
    from grpo_cli.drivers.loop import TrainingLoop
    from tests.conftest import compose_config

    seen = []
    real = batch_module.response_log_probs  # every scoring pass's call (batch.score_microbatch)

    def recording(*args, **kwargs):
        seen.append(kwargs.get("temperature", 1.0))
        return real(*args, **kwargs)

    monkeypatch.setattr(batch_module, "response_log_probs", recording)
    cfg = compose_config(
        ["debug=smoke", "task.name=letter_e", "rollout.temperature=0.5", "kl.beta=0.1", "train.eval_every=0"],
        output_dir=str(tmp_path),
    )
    cfg.train.steps = 1
    TrainingLoop(cfg, tmp_path, Console(quiet=True)).run()
    assert seen and set(seen) == {0.5}  # the update and the reference pass both divide by T


# --- head semantics ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("architecture", ["gemma2_softcap", "cohere_scale", "granite_scale"])
def test_response_scoring_applies_the_models_own_head_semantics(architecture):
    model = tiny_head_lm(architecture).eval()
    batch = tokenize_prompt_and_output_ids([[1, 5, 7], [2, 9]], [[11, 12, 13], [14]], pad_token_id=0)
    mask = batch["response_mask"]
    with torch.no_grad():
        own = response_log_probs(model, batch["input_ids"], batch["labels"])["log_probs"] * mask  # model(...)
        fast = response_log_probs(model, batch["input_ids"], batch["labels"], mask)["log_probs"]
    torch.testing.assert_close(fast, own, atol=1e-5, rtol=1e-5)


# --- eval mode for no-grad passes ------------------------------------------------------------------------------


def test_old_log_probs_are_computed_without_dropout(tiny):
    model, tokenizer = tiny
    lora = apply_lora(model, r=4, alpha=8, dropout=0.9, target_modules=["q_proj", "v_proj"])
    random_weights(lora, std=1.0, seed=None, only="lora_B")  # adapters must matter for their dropout to matter
    lora.train()  # the learner's state between updates
    data = RolloutData(
        prompt_ids=[tokenizer("The sea is")["input_ids"]] * 2,
        completion_ids=[[300, 301, 302], [400, 401]],
        raw_rewards=torch.zeros(2),
        advantages=torch.zeros(2),
    )
    scoring = ScoringSettings(
        temperature=1.0,
        share_prompts=False,
        logits_chunk_tokens=LOGITS_CHUNK_TOKENS,
        microbatch_size=2,
        pad_token_id=tokenizer.pad_token_id,
    )
    first = per_completion_log_probs(lora, data, CPU, scoring)
    second = per_completion_log_probs(lora, data, CPU, scoring)
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b)
    assert lora.training  # put back as it was


# --- a torn metrics.jsonl ---------------------------------------------------------------------------------------


def test_a_torn_last_line_is_dropped_and_the_rest_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval/reward": 0.5}, {"step": 1, "train/loss": 0.1}, {"step": 2, "train/loss": 0.2}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "train/lo')
    message = truncate_metrics(path, last_step=2)
    assert message is not None and "metrics.jsonl" in message and "\n" not in message
    assert read_metrics(path) == rows


def test_an_intact_file_needs_no_message(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 2}) + "\n")
    assert truncate_metrics(path, last_step=1) is None
    assert read_metrics(path) == [{"step": 1}]


def test_generation_config_object_is_not_shared_with_the_model(tiny):
    model, tokenizer = tiny
    model.generation_config = GenerationConfig(repetition_penalty=2.0, eos_token_id=tokenizer.eos_token_id)
    HFRolloutEngine(model, tokenizer).generate(
        [tokenizer("Hi")["input_ids"]], SamplingSettings(n=1, temperature=1.0, max_tokens=3, seed=0)
    )
    assert model.generation_config.repetition_penalty == 2.0


def test_resume_over_a_torn_metrics_line_logs_each_step_once(tmp_path):
    from rich.console import Console

    from grpo_cli.drivers.loop import TrainingLoop
    from tests.conftest import compose_config

    def loop(steps: int, console: Console, resume: bool = False) -> TrainingLoop:
        overrides = ["debug=smoke", f"train.steps={steps}", "train.checkpoint_every=1", "train.eval_every=0"]
        return TrainingLoop(
            compose_config([*overrides, *(["resume=true"] if resume else [])], output_dir=str(tmp_path)),
            tmp_path,
            console,
        )

    loop(2, Console(quiet=True)).run()
    metrics = tmp_path / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"step": 3, "train/loss": 0.1')  # the process died mid-write (no newline, no closing brace)
    console = Console(record=True, width=300)
    loop(3, console, resume=True).run()
    assert "dropped its last line, cut off mid-write" in console.export_text()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]  # every line parses
    steps = [r["step"] for r in rows if "train/loss" in r]
    assert steps == [1, 2, 3]


def test_most_answers_cut_at_max_tokens_give_one_warning_naming_the_key():
    from grpo_cli.rollout.evaluation import truncation_warning

    assert truncation_warning({"eval/truncated_frac": 0.5}, 48) is None
    warning = truncation_warning({"eval/truncated_frac": 0.9}, 48)
    assert warning is not None and "rollout.max_tokens=48" in warning and "\n" not in warning


def test_episodes_cut_by_a_task_limit_are_not_said_to_hit_rollout_max_tokens():
    """A multi-turn evaluation whose episodes ran out of task.max_episode_tokens names that key, not the per-turn
    rollout.max_tokens (issue #39: the warning named a key that did not apply)."""
    from grpo_cli.rollout.evaluation import truncation_warning
    from grpo_cli.tasks.schema import TaskConfig

    task = TaskConfig(name="custom", max_turns=4, max_episode_tokens=256)
    records = [
        {"truncated": True, "stop_reason": "max_episode_tokens"},
        {"truncated": True, "stop_reason": "max_episode_tokens"},
        {"truncated": True, "stop_reason": "done"},  # its last turn was cut at rollout.max_tokens
        {"truncated": False, "stop_reason": "done"},
    ]
    warning = truncation_warning({"eval/truncated_frac": 0.75}, 48, records, task)
    assert warning is not None and "rollout.max_tokens" not in warning and "\n" not in warning
    assert "2 of 4 by task.max_episode_tokens=256" in warning
    records = [{"truncated": True, "stop_reason": "context"}] * 3
    assert "the model's context" in str(truncation_warning({"eval/truncated_frac": 1.0}, 48, records, task))
