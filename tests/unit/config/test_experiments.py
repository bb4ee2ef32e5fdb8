"""Issue #14: tasks carry the generation settings their prompts need, and `experiment=<name>` presets set every
value of one published setup (seeds 001-003), composed and validated here without loading a model."""

from __future__ import annotations

import json

import pytest

from grpo_cli.config import VLLMRolloutConfig, validate_config
from grpo_cli.tasks import load_examples
from tests.conftest import compose_config

EXPERIMENTS = ("cs336_math", "hw4_qlora", "trl_medcalc", "gsm8k_tools", "python_math", "guess_number")

# ---------------------------------------------------------------------------------------------------------
# Task-aware generation


@pytest.mark.parametrize("task", ["math", "gsm8k"])
@pytest.mark.parametrize("rollout", ["hf", "vllm"])
def test_reasoning_tasks_generate_up_to_1024_tokens_on_either_engine(task, rollout):
    cfg = compose_config([f"task={task}", f"rollout={rollout}"])
    validate_config(cfg)
    assert (cfg.rollout.engine, cfg.rollout.min_tokens, cfg.rollout.max_tokens) == (rollout, 4, 1024)


@pytest.mark.parametrize("prompt", ["r1_zero", "question_only", "chat"])
def test_math_keeps_1024_tokens_whatever_the_prompt_style(prompt):
    # A MATH solution is as long in any prompt style; only r1_zero's </answer> stop follows the style.
    cfg = compose_config(["task=math", f"task.prompt={prompt}"])
    assert cfg.rollout.max_tokens == 1024


@pytest.mark.parametrize("task", ["addition", "medcalc"])
def test_short_reasoning_tasks_generate_up_to_128_tokens(task):
    cfg = compose_config([f"task={task}", "rollout=vllm"])
    assert cfg.rollout.max_tokens == 128


@pytest.mark.parametrize(
    "overrides",
    [
        ["task=math", "rollout.max_tokens=64"],
        ["task=math", "rollout=vllm", "rollout.max_tokens=64"],
        ["rollout.max_tokens=64", "rollout=vllm", "task=gsm8k"],
        ["experiment=cs336_math", "rollout.max_tokens=64"],
        ["experiment=cs336_math", "rollout=hf", "rollout.max_tokens=64"],
    ],
)
def test_a_command_line_max_tokens_wins_over_the_task(overrides):
    assert compose_config(overrides).rollout.max_tokens == 64


@pytest.mark.parametrize("overrides", [[], ["task=keyword"], ["task=keyword", "rollout=vllm"], ["task=lipogram"]])
def test_the_keyword_default_keeps_48_tokens(overrides):
    cfg = compose_config(overrides)
    assert (cfg.rollout.min_tokens, cfg.rollout.max_tokens) == (4, 48)


def test_smoke_and_benchmark_still_set_their_own_lengths_after_the_task():
    assert compose_config(["task=math", "debug=smoke"]).rollout.max_tokens == 8
    assert compose_config(["task=math", "job=benchmark"]).rollout.max_tokens == 48


# ---------------------------------------------------------------------------------------------------------
# Experiment presets


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_validates(name):
    validate_config(compose_config([f"experiment={name}"]))


def test_cs336_math_is_the_handouts_starter_setup():
    cfg = compose_config(["experiment=cs336_math"])
    validate_config(cfg)
    assert cfg.model.name_or_path == "Qwen/Qwen2.5-Math-1.5B"
    assert (cfg.model.quantization, cfg.model.lora.enabled) == ("none", False)
    assert (cfg.task.name, cfg.task.prompt) == ("math", "r1_zero")
    assert isinstance(cfg.rollout, VLLMRolloutConfig) and cfg.rollout.engine == "vllm"
    r = cfg.rollout
    assert (r.temperature, r.top_p, r.min_tokens, r.max_tokens) == (1.0, 1.0, 4, 1024)
    t = cfg.train
    assert (t.steps, t.rollout_batch_size, t.group_size, t.train_batch_size) == (200, 256, 8, 256)
    assert (t.gradient_accumulation_steps, t.max_grad_norm, t.eval_every) == (128, 1.0, 10)
    assert t.train_batch_size // t.gradient_accumulation_steps == 2  # "microbatch size is 2, will fit on H100"
    assert (cfg.optim.lr, cfg.optim.betas, cfg.optim.weight_decay) == (1e-5, [0.9, 0.95], 0.0)
    assert cfg.loss.type == "reinforce_with_baseline" and cfg.kl.beta == 0.0
    assert (cfg.normalization.advantage, cfg.normalization.advantage_eps) == ("std", 1e-6)
    assert (cfg.sync.strategy, cfg.sync.epochs_per_rollout_batch) == ("on_policy", 1)
    # >= 1024 held-out problems: the first 1024 of the train split, disjoint from the rest it trains on
    assert (cfg.task.hub_eval_split, cfg.task.hub_train_split) == ("train[:1024]", "train[1024:]")
    assert cfg.task.n_eval is None and cfg.train.eval_examples is None and cfg.task.eval_path is None


def test_cs336_math_evaluates_on_1024_held_out_problems_disjoint_from_training(tmp_path, monkeypatch):
    # A local dataset directory stands in for the hub's MATH 12K (same `datasets` split slicing, no network).
    data = tmp_path / "math12k"
    data.mkdir()
    rows = [{"problem": f"What is {i} + 0?", "answer": str(i)} for i in range(1100)]
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    cfg = compose_config(["experiment=cs336_math", f"task.hub_dataset={data}"])
    held_out, train = load_examples(cfg.task, "eval"), load_examples(cfg.task, "train")
    assert len(held_out) == 1024 and len(train) == 1100 - 1024
    assert {e.ground_truth for e in held_out}.isdisjoint({e.ground_truth for e in train})
    assert held_out[0].prompt.endswith("Assistant: <think>")


def test_hw4_qlora_is_the_notebooks_setup():
    cfg = compose_config(["experiment=hw4_qlora"])
    validate_config(cfg)
    m = cfg.model
    assert (m.name_or_path, m.quantization) == ("Qwen/Qwen2.5-0.5B-Instruct", "4bit")
    assert (m.lora.enabled, m.lora.r, m.lora.alpha, m.lora.dropout) == (True, 16, 32, 0.05)
    assert m.lora.target_modules == ["q_proj", "v_proj"]  # peft's default for Qwen2 (the notebook names none)
    assert (cfg.task.name, cfg.task.prompt) == ("addition", "chat")
    weights = cfg.task.reward_weights
    assert (weights.correctness, weights.format, weights.answer, weights.numeric_close) == (0.0, 1.0, 0.0, 0.0)
    assert (cfg.loss.type, cfg.loss.cliprange, cfg.normalization.advantage) == ("grpo_clip", 0.2, "std")
    assert (cfg.kl.beta, cfg.optim.lr, cfg.train.max_grad_norm) == (0.05, 2e-5, 1.0)
    assert (cfg.optim.betas, cfg.optim.weight_decay) == ([0.9, 0.999], 0.01)  # torch.optim.AdamW's defaults
    assert (cfg.rollout.temperature, cfg.rollout.max_tokens, cfg.rollout.eval_temperature) == (0.9, 128, 0.0)
    t = cfg.train
    assert (t.steps, t.group_size, t.rollout_batch_size, t.train_batch_size) == (25, 2, 64, 64)
    assert t.train_batch_size // t.gradient_accumulation_steps == 4 * t.group_size  # 4 prompts x G per microbatch
    assert (cfg.task.n_train, cfg.task.n_eval, t.eval_every) == (64, 32, 0)


def test_trl_medcalc_is_the_handouts_grpo_config():
    cfg = compose_config(["experiment=trl_medcalc"])
    validate_config(cfg)
    assert cfg.model.name_or_path == "Qwen/Qwen2.5-1.5B-Instruct"
    assert (cfg.model.mixed_precision, cfg.model.quantization, cfg.model.lora.enabled) == ("bf16", "none", False)
    assert (cfg.task.name, cfg.task.prompt, cfg.task.answer_atol) == ("medcalc", "question_only", 0.5)
    weights = cfg.task.reward_weights
    assert (weights.format, weights.numeric_close, weights.correctness) == (1.0, 1.0, 0.0)
    assert (cfg.loss.type, cfg.loss.cliprange, cfg.kl.beta, cfg.optim.lr) == ("grpo_clip", 0.2, 0.04, 1e-5)
    assert (cfg.rollout.engine, cfg.rollout.max_tokens) == ("hf", 128)
    t = cfg.train
    assert (t.group_size, t.rollout_batch_size, t.train_batch_size, t.gradient_accumulation_steps) == (4, 8, 8, 8)
    assert t.steps == 10_053 // (t.rollout_batch_size // t.group_size)  # one epoch of the training rows
    assert cfg.logger.backend == "tensorboard"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["experiment=cs336_math", "optim.lr=3e-5"], {"optim.lr": 3e-5}),
        (["experiment=cs336_math", "loss=no_baseline"], {"loss.type": "no_baseline"}),
        (["experiment=cs336_math", "normalization=mean_only"], {"normalization.advantage": "mean"}),
        (["experiment=cs336_math", "rollout=hf"], {"rollout.engine": "hf", "rollout.max_tokens": 1024}),
        (["experiment=cs336_math", "model=tiny_random"], {"model.name_or_path": "random:tiny-llama"}),
        (["experiment=cs336_math", "task.prompt=question_only"], {"task.prompt": "question_only"}),
        (["experiment=hw4_qlora", "task.reward_weights.correctness=1"], {"task.reward_weights.correctness": 1.0}),
        (["experiment=hw4_qlora", "model.lora.r=8"], {"model.lora.r": 8, "model.quantization": "4bit"}),
        (["experiment=trl_medcalc", "logger=none"], {"logger.backend": "none"}),
        (["experiment=trl_medcalc", "sync=multi_epoch"], {"sync.epochs_per_rollout_batch": 2}),
        (["experiment=trl_medcalc", "train.steps=500"], {"train.steps": 500}),
    ],
)
def test_every_preset_key_and_group_still_overrides(overrides, expected):
    cfg = compose_config(overrides)
    validate_config(cfg)
    for key, value in expected.items():
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        assert node == value, key
