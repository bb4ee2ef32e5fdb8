"""Tasks by name: prompts, data and reward functions (no torch in this package). One job a module, re-exported
here (`from grpo_cli.tasks import ...`): registry.py (TASKS, get_task, task_for), data.py (a task's examples and
eval sets), reward_fn.py (make_reward_fn: the reward a run scores with), validation.py (validate_task_config);
base.py (TaskSpec and the shapes every task shares), schema.py (TaskConfig), one module per task."""

from __future__ import annotations

from grpo_cli.config.task_registry import TASK_SCHEMAS, check_episodes, register_tasks
from grpo_cli.tasks.addition import ADDITION_TASK, addition_reward_fn
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
    iter_jsonl_objects,
    parse_question_row,
    prompt_stop_strings,
    stop_strings,
)
from grpo_cli.tasks.custom import CUSTOM_TASK, CustomReward, CustomTaskConfig, absolutize_paths
from grpo_cli.tasks.data import (
    RESERVED_EVAL_SET_NAMES,
    eval_set_config,
    load_eval_sets,
    load_examples,
    load_jsonl_examples,
    with_source,
)
from grpo_cli.tasks.graders import question_only_reward_fn, r1_zero_reward_fn
from grpo_cli.tasks.guess_number import GUESS_NUMBER_TASK
from grpo_cli.tasks.hub import RowParser
from grpo_cli.tasks.json_extraction import JSON_TASK, json_reward_fn
from grpo_cli.tasks.keyword import KEYWORD_TASK, keyword_inclusion_reward_fn
from grpo_cli.tasks.lipogram import LIPOGRAM_TASK, lipogram_reward_fn
from grpo_cli.tasks.medcalc import MEDCALC_TASK, medcalc_reward_fn
from grpo_cli.tasks.multiturn import ENV_COMPONENT, absolutize_multiturn_paths, env_weight, is_multiturn
from grpo_cli.tasks.reasoning import GSM8K_TASK, MATH_TASK
from grpo_cli.tasks.regex_sum import REGEX_SUM_TASK, regex_sum_reward_fn
from grpo_cli.tasks.registry import TASKS, absolutize_task_paths, get_task, task_for
from grpo_cli.tasks.reward_fn import component_weights, make_reward_fn, reward_weights
from grpo_cli.tasks.rewards import DEFAULT_WEIGHTS, Shaping, build_reward_fn, check_weights
from grpo_cli.tasks.schema import HubTaskConfig, NumericCloseOptions, RewardWeightsConfig, TaskConfig
from grpo_cli.tasks.tool_tasks import GSM8K_TOOLS_TASK, PYTHON_MATH_TASK
from grpo_cli.tasks.validation import validate_task_config
from grpo_cli.usercode.timelimit import RewardTimeout, call_with_time_limit

# Each task's config schema (TaskSpec.schema) and the task check, registered in the config's registry
# (config/task_registry.py) when grpo_cli.tasks is imported: grpo_cli.config registers each schema as
# `<name>_schema` in group `task` (conf/task/<name>.yaml extends it) and validate_config ends with
# validate_task_config.
register_tasks({name: task.schema or TaskConfig for name, task in TASKS.items()}, validate_task_config)

# The first 25: importable from grpo_cli.tasks before its split by job (issue 59), kept so that a user's
# `from grpo_cli.tasks import ...` keeps working (each task's spec and the reward building blocks).
__all__ = [
    "ADDITION_TASK",
    "CUSTOM_TASK",
    "CustomReward",
    "CustomTaskConfig",
    "DEFAULT_WEIGHTS",
    "ENV_COMPONENT",
    "GSM8K_TASK",
    "GSM8K_TOOLS_TASK",
    "GUESS_NUMBER_TASK",
    "JSON_TASK",
    "KEYWORD_TASK",
    "LIPOGRAM_TASK",
    "MATH_TASK",
    "MEDCALC_TASK",
    "PYTHON_MATH_TASK",
    "REGEX_SUM_TASK",
    "RowParser",
    "Shaping",
    "absolutize_multiturn_paths",
    "absolutize_paths",
    "build_reward_fn",
    "check_episodes",
    "check_weights",
    "iter_jsonl_objects",
    "parse_question_row",
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
