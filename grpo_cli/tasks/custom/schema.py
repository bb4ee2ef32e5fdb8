"""task=custom's keys: CustomTaskConfig (the task's schema, registered like every task's as `custom_schema`), its
reward model's keys, the values its choices allow, and the two readings of the config every part needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from grpo_cli.config.fields import any_value, choice, path, positive
from grpo_cli.tasks.schema import TaskConfig
from grpo_cli.usercode.user_code import RewardSpec, named_specs

REWARD_CONVENTIONS = ("trl", "per_sample")
# What completions= holds: auto is TRL's rule (messages exactly when the data is conversational).
COMPLETION_FORMATS = ("auto", "text", "messages")
# Roles a conversational prompt's messages may have.
MESSAGE_ROLES = ("system", "user", "assistant", "tool")
# What the reward model reads: the response alone (a sentiment classifier), or the prompt text and the response
# (a preference reward model, as TRL feeds one).
REWARD_MODEL_INPUTS = ("response", "prompt_and_response")


@dataclass
class RewardModelConfig:
    """task.reward_model: a Hugging Face sequence-classification model as a reward (null path: none)."""

    path: str | None = any_value(
        None, help="A local model directory or a hub id (read offline from the cache when HF_HUB_OFFLINE=1)."
    )
    label: str | None = any_value(
        None,
        help="The label whose probability (softmax over the labels) is the reward, e.g. NEGATIVE; null: the raw "
        "score of a one-logit head (a reward model).",
    )
    name: str = any_value(
        "reward_model",
        help="The name it is weighted and logged under: task.reward_weights.<name>, train/reward/<name>.",
    )
    input: str = choice(
        "response",
        REWARD_MODEL_INPUTS,
        help="What it reads: the response alone, or the prompt text followed by the response.",
    )
    batch_size: int = positive(
        32,
        help="Responses per forward pass (on the policy's device, no grad, each truncated to the model's max length).",
    )
    dtype: str = choice(
        "auto", ("auto", "float32", "bfloat16"), help="auto: bfloat16 on a CUDA GPU that has it, float32 otherwise."
    )


@dataclass
class CustomTaskConfig(TaskConfig):
    """task=custom: data, prompt and rewards from the config and the user's own code (docs/custom-tasks.md)."""

    # Dicts of the user's own names, open to new keys on the command line without + (config/registry.py).
    OPEN_KEYS: ClassVar[tuple[str, ...]] = ("rewards", "reward_weights", "tools")

    train_path: str | None = any_value(
        None,
        help="Local data, one file or folder per split: .jsonl, .csv, .parquet, or a `datasets` directory. Relative "
        "paths start where grpo-run was run (made absolute before the run starts). First of: path, generator, "
        "dataset.",
    )
    eval_path: str | None = any_value(
        None,
        help="Local held-out data, as task.train_path. Each split takes the first of: its path, task.generator, "
        "task.dataset.",
    )
    dataset: str | None = any_value(
        None, help="A `datasets` hub id or local dataset directory, read at task.split (training) and task.eval_split."
    )
    dataset_config: str | None = any_value(None, help="task.dataset's configuration (subset) name; null: its default.")
    split: str = any_value("train", help="task.dataset's split of training rows.")
    eval_split: str = any_value("test", help="task.dataset's split of held-out rows.")
    generator: str | None = any_value(
        None,
        help="Your generator, path/to/file.py:function or package.module:function, called as fn(n, seed) -> list of "
        "dicts: (task.n_train, task.data_seed) for training and (task.n_eval, task.data_seed + 1) for evaluation.",
    )
    rename_columns: dict[str, str] = any_value(
        factory=dict, help='Columns renamed before anything reads them: {"Ground Truth Answer": references}.'
    )
    template: str = any_value(
        "{prompt}",
        help="Text data's prompt, a Python format string over the row's columns: \"Rewrite this review to be "
        'negative: {review}". Conversational data (a `prompt` column of {role, content} messages) is its own '
        "prompt.",
    )
    system_prompt: str | None = any_value(
        None,
        help="Text data: sent before the prompt, a system message under task.prompt=chat, the first paragraph "
        "otherwise.",
    )
    rewards: dict[str, Any] = any_value(
        factory=dict,
        help="Your reward functions by name: path/to/file.py:function, package.module:function, or a node Hydra "
        "instantiates once per process ({_target_: trl.rewards.get_soft_overlong_punishment, max_completion_len: "
        "48, soft_punish_cache: 8}; _partial_: true binds arguments to a function). task.rewards.<name>=... adds "
        "one on the command line (no + needed: this node is open, as is reward_weights).",
    )
    reward_convention: str = choice(
        "trl",
        REWARD_CONVENTIONS,
        help="trl: fn(prompts=, completions=, completion_ids=, trainer_state=, log_extra=, log_metric=, **columns) "
        "-> list of float|None per batch (TRL 1.16's GRPOTrainer convention); per_sample: fn(response, row) -> "
        "float|None.",
    )
    completion_format: str = choice(
        "auto",
        COMPLETION_FORMATS,
        help='What a trl-convention function gets as completions=: auto is TRL\'s rule ([{"role": "assistant", '
        '"content": text}] each when the data is conversational, the text otherwise), text or messages force one.',
    )
    # The user's reward names instead of the built-in tasks' fixed RewardWeightsConfig: a narrower field than
    # TaskConfig.reward_weights declares, which mypy reports as an incompatible override (it is one on purpose).
    reward_weights: dict[str, float] = any_value(
        factory=dict,
        help="Weight of each reward by name (task.rewards' names, task.reward_model.name, the shaping terms "
        "overlong and repetition, and env with task.environment); a reward without a weight counts 1, a shaping "
        "term 0.",
    )  # type: ignore[assignment]
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    answer_from: str | None = any_value(
        None,
        help="The reward logged as answer_reward, whose value >= 1 marks an answer correct (eval/mean@n, pass@k, "
        "maj@n): a name of task.rewards, or env (the environment's summed step rewards). null: env when the "
        "environment's reward is the only weighted one (shaping terms aside), else the weighted total.",
    )
    format_from: str | None = any_value(None, help="The reward logged as format_reward; null: the weighted total.")
    cases_path: str | None = path(
        None,
        "file",
        help='job=check_reward\'s cases: a JSONL file, {"response": ..., "expected": ..., <the row\'s columns>} '
        'per line; with task.tools or task.environment, {"turns": [<the model\'s turns>], "expected": ...} runs them '
        "for real between the turns.",
    )
    base_dir: str | None = path(
        None,
        "dir",
        help="Where relative paths and package.module references are found; null: the directory grpo-run was "
        "started from (written into the run's config, so every rank, actor and sweep job finds the same files).",
    )

    def reference_dir(self) -> Path:
        """Where relative paths and package modules are found: task.base_dir, else this process's working
        directory."""
        return Path(self.base_dir) if self.base_dir else Path.cwd()

    def user_rewards(self) -> Any:
        """task.rewards as configured."""
        return self.rewards


def reward_specs(task_cfg: CustomTaskConfig) -> dict[str, RewardSpec]:
    """task.rewards as plain data: {name: reference string or plain dict node} (one line for another value)."""
    return named_specs(task_cfg.rewards, "task.rewards")
