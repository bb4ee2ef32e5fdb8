"""Tasks by name: prompts, data and reward functions (no torch in this package). One job a module, re-exported
here (`from grpo_cli.tasks import ...`): registry.py (TASKS, get_task, task_for), data.py (a task's examples and
eval sets), reward_fn.py (make_reward_fn: the reward a run scores with), validation.py (validate_task_config);
base.py (TaskSpec and the shapes every task shares), schema.py (TaskConfig), one module per task."""

from __future__ import annotations

from grpo_cli.config.task_registry import TASK_SCHEMAS, register_tasks
from grpo_cli.tasks.addition import addition_reward_fn
from grpo_cli.tasks.base import (
    OPTIONAL_REWARD_KEYS,
    PROMPT_STYLES,
    REWARD_KEYS,
    Example,
    Prompt,
    RewardComponent,
    RewardFn,
    RowError,
    SanityCase,
    TaskDataError,
    TaskSpec,
    format_prompt,
    prompt_stop_strings,
    stop_strings,
)
from grpo_cli.tasks.data import (
    RESERVED_EVAL_SET_NAMES,
    eval_set_config,
    load_eval_sets,
    load_examples,
    load_jsonl_examples,
    with_source,
)
from grpo_cli.tasks.graders import question_only_reward_fn, r1_zero_reward_fn
from grpo_cli.tasks.json_extraction import json_reward_fn
from grpo_cli.tasks.keyword import keyword_inclusion_reward_fn
from grpo_cli.tasks.lipogram import lipogram_reward_fn
from grpo_cli.tasks.medcalc import medcalc_reward_fn
from grpo_cli.tasks.multiturn import env_weight, is_multiturn
from grpo_cli.tasks.regex_sum import regex_sum_reward_fn
from grpo_cli.tasks.registry import TASKS, absolutize_task_paths, get_task, task_for
from grpo_cli.tasks.reward_fn import component_weights, make_reward_fn, reward_weights
from grpo_cli.tasks.schema import HubTaskConfig, NumericCloseOptions, RewardWeightsConfig, TaskConfig
from grpo_cli.tasks.validation import validate_task_config
from grpo_cli.usercode.timelimit import RewardTimeout, call_with_time_limit

# Each task's config schema (TaskSpec.schema) and the task check, registered in the config's registry
# (config/task_registry.py) when grpo_cli.tasks is imported: grpo_cli.config registers each schema as
# `<name>_schema` in group `task` (conf/task/<name>.yaml extends it) and validate_config ends with
# validate_task_config.
register_tasks({name: task.schema or TaskConfig for name, task in TASKS.items()}, validate_task_config)

__all__ = [
    "OPTIONAL_REWARD_KEYS",
    "PROMPT_STYLES",
    "TASK_SCHEMAS",
    "HubTaskConfig",
    "NumericCloseOptions",
    "RewardWeightsConfig",
    "TaskConfig",
    "REWARD_KEYS",
    "TASKS",
    "Example",
    "Prompt",
    "RewardComponent",
    "RewardFn",
    "RewardTimeout",
    "RowError",
    "SanityCase",
    "TaskSpec",
    "format_prompt",
    "TaskDataError",
    "call_with_time_limit",
    "absolutize_task_paths",
    "env_weight",
    "is_multiturn",
    "get_task",
    "task_for",
    "load_eval_sets",
    "load_examples",
    "load_jsonl_examples",
    "make_reward_fn",
    "reward_weights",
    "prompt_stop_strings",
    "stop_strings",
    "validate_task_config",
    "RESERVED_EVAL_SET_NAMES",
    "component_weights",
    "eval_set_config",
    "with_source",
    "addition_reward_fn",
    "keyword_inclusion_reward_fn",
    "json_reward_fn",
    "lipogram_reward_fn",
    "medcalc_reward_fn",
    "question_only_reward_fn",
    "r1_zero_reward_fn",
    "regex_sum_reward_fn",
]
