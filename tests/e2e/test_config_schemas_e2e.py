"""The grpo-run end-to-end half of tests/unit/config/test_config_schemas.py: grpo-run as a subprocess."""

from __future__ import annotations

import yaml

from grpo_cli.config import (
    choice_fields,
)
from tests.conftest import run_grpo


def test_help_lists_the_allowed_values_and_no_schema_entries(tmp_path):
    result = run_grpo(["--help"], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    for key, values in choice_fields().items():
        assert f"{key}: {', '.join(values)}" in result.stdout
    assert "task: " in result.stdout and "_schema" not in result.stdout


def test_help_of_groups_prints_their_keys_with_value_constraint_and_help(tmp_path):
    # Two groups, each with the values of the selected choices (loss=grpo_clip sets loss.type; task=custom's keys).
    chosen = run_grpo(["--help", "loss=grpo_clip", "task=custom", "loss", "task"], cwd=tmp_path, timeout=120)
    assert chosen.returncode == 0, chosen.stderr
    out = chosen.stdout
    assert "loss.type = grpo_clip  (one of no_baseline, reinforce_with_baseline, grpo_clip, gspo, cispo)" in out
    assert "loss.cliprange = 0.2  (in (0, 1))\n    Clip range epsilon" in out
    assert "== task=custom:" in out and "task.rewards = {}  (a mapping)" in out
    assert "task.reward_weights.correctness" not in out  # custom's reward_weights is a dict of its own
    assert "train.steps =" not in out and "== Allowed values" not in out  # only the groups asked for


def test_task_keyword_with_min_words_fails_in_one_line_through_grpo_run(tmp_path):
    result = run_grpo(["task=keyword", "task.min_words=3"], cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("grpo-run: error: ") and "Traceback" not in result.stderr
    assert "min_words" in line and "task=keyword has the keys" in line and "keywords_per_prompt" in line
    assert "min_words is a key of task=lipogram" in line


def test_cfg_job_prints_the_same_defaults(tmp_path):
    result = run_grpo(["--cfg", "job"], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["model"] | {"lora": None} == {
        "name": "smollm2_135m",
        "name_or_path": "embedded:smollm2-135m-instruct",
        "dtype": "auto",
        "device": "auto",
        "gradient_checkpointing": False,
        "init_seed": 0,
        "mixed_precision": "auto",
        "quantization": "none",
        "lora": None,
    }
    assert printed["model"]["lora"]["enabled"] is False and printed["model"]["lora"]["r"] == 16
    assert printed["task"] == {
        "name": "keyword",
        "prompt": "chat",
        "train_path": None,
        "eval_path": None,
        "n_train": 2000,
        "n_eval": 64,
        "data_seed": 1234,
        "reward_weights": {
            "correctness": 1.0,
            "format": 0.0,
            "answer": 0.0,
            "numeric_close": 0.0,
            "overlong": 0.0,
            "repetition": 0.0,
            "env": 1.0,
        },
        "reward_timeout_s": 10.0,
        "eval_sets": {},
        "overlong_buffer": None,
        "repetition_ngram": 3,
        "on_reward_error": "stop",
        "reward_workers": 1,
        "tools": {},
        "tool_call_format": None,
        "tool_timeout_s": 10.0,
        "environment": None,
        "max_turns": 4,
        "sandbox": {
            "isolation": "bwrap",
            "cpu_time_s": 5,
            "wall_time_s": 10.0,
            "memory_mb": 1024,
            "max_output_bytes": 4096,
            "max_file_mb": 16,
            "disk_mb": 64,
            "shm_mb": 16,
            "max_processes": 64,
            "packages": ["numpy", "sympy", "mpmath"],
            "uid": 65534,
        },
        "max_episode_tokens": None,
        "max_observation_tokens": 1024,
        "environment_factory": None,
        "agent": None,
        "agent_timeout_s": 600.0,
        "keywords_per_prompt": 2,
    }
    assert printed["eval"] == {"n_samples": 1, "pass_k": None, "model": None, "step": None}
    assert printed["rollout"] == {
        "engine": "hf",
        "temperature": 1.0,
        "top_p": 1.0,
        "min_tokens": 4,
        "max_tokens": 48,
        "stop": [],
        "eval_temperature": 0.0,
        "max_batch_prompts": None,
        "importance_correction": "none",
        "importance_level": "token",
        "importance_threshold": 2.0,
        "importance_threshold_low": None,
        "compile": "auto",
        "decoder": "auto",
    }
    assert printed["loss"] == {
        "type": "reinforce_with_baseline",
        "cliprange": 0.2,
        "cliprange_high": None,
        "dual_clip": None,
    }
    assert printed["kl"] == {
        "beta": 0.0,
        "estimator": "k3",
        "monitor": False,
        "beta_schedule": "constant",
        "beta_final": None,
    }
    assert printed["normalization"] == {
        "advantage": "std",
        "advantage_eps": 1e-6,
        "length": "sequence_mean",
        "length_constant": None,
    }
    assert printed["sync"]["strategy"] == "on_policy" and printed["sync"]["epochs_per_rollout_batch"] == 1
    # logger.mode's default is what logger=wandb sets where $WANDB_MODE is unset.
    assert printed["logger"]["backend"] == "none" and printed["logger"]["mode"] == "online"
    assert (printed["seed"], printed["resume"], printed["report"]) == (0, None, {"runs": [], "out": None})
