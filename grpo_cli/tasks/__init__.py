"""Tasks by name: prompts, data and reward functions (no torch in this package)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from grpo_cli.config.task_registry import TASK_SCHEMAS, check_episodes, register_tasks
from grpo_cli.errors import UserFacingError
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
from grpo_cli.tasks.rewards import DEFAULT_WEIGHTS, Shaping, build_reward_fn, check_weights
from grpo_cli.tasks.schema import HubTaskConfig, NumericCloseOptions, RewardWeightsConfig, TaskConfig
from grpo_cli.tasks.tool_tasks import GSM8K_TOOLS_TASK, PYTHON_MATH_TASK
from grpo_cli.usercode.timelimit import RewardTimeout, call_with_time_limit

TASKS: dict[str, TaskSpec] = {
    task.name: task
    for task in (
        KEYWORD_TASK,
        MATH_TASK,
        GSM8K_TASK,
        LIPOGRAM_TASK,
        JSON_TASK,
        REGEX_SUM_TASK,
        ADDITION_TASK,
        MEDCALC_TASK,
        CUSTOM_TASK,
        GSM8K_TOOLS_TASK,
        PYTHON_MATH_TASK,
        GUESS_NUMBER_TASK,
    )
}


def load_jsonl_examples(
    path: str,
    prompt_style: str,
    n: int | None = None,
    parse_row: RowParser = parse_question_row,
    prompt_format: Callable[[str, str], Prompt] = format_prompt,
) -> list[Example]:
    """Read one JSON object per line with `parse_row` (by default {"question", "ground_truth"}) and wrap each
    question with `prompt_format`; errors name the file, the line and the field."""
    examples = []
    try:
        for line_no, row in iter_jsonl_objects(path):
            try:
                question, ground_truth, meta = parse_row(row)
            except RowError as e:
                raise TaskDataError(f"{path}:{line_no}: {e}") from None
            examples.append(Example(prompt_format(question, prompt_style), ground_truth, meta))
            if n is not None and len(examples) >= n:
                break
    except OSError as e:
        raise TaskDataError(
            f"cannot read data file {path}: {e.strerror}: check task.train_path / task.eval_path"
        ) from None
    except UnicodeDecodeError as e:
        raise TaskDataError(f"{path} is not UTF-8 text ({e.reason}): give a JSONL file") from None
    if not examples:
        raise TaskDataError(f"{path} holds no examples")
    return examples


def load_examples(task_cfg: TaskConfig, split: str) -> list[Example]:
    """The examples of one split ("train" or "eval") for a task config (local JSONL when a path is set)."""
    task = task_for(task_cfg)
    path = task_cfg.train_path if split == "train" else task_cfg.eval_path
    n = task_cfg.n_train if split == "train" else task_cfg.n_eval
    source = f"task.{split}_path={path}" if path else f"task={task_cfg.name}'s {split} split"
    if path and task.from_config is None:  # a task made from its config reads its own paths (CSV, Parquet, ...)
        examples = load_jsonl_examples(path, task_cfg.prompt, n, task.parse_row, task.make_prompt)
    else:
        options = {key: getattr(task_cfg, key) for key in task.options}
        try:
            examples = task.build(split, n, task_cfg.data_seed, task_cfg.prompt, **options)
        except ValueError as e:  # the builders' option checks ("task.min_words=0 must be ..."): one line, exit 2
            raise UserFacingError(str(e)) from None
    return with_source(examples, source)


def with_source(examples: list[Example], source: str) -> list[Example]:
    """`examples` with Example.source set to `source` (where they were read, for the errors about one of them)."""
    return [dataclasses.replace(example, source=source) for example in examples]


# Metric names under eval/ that a set name would collide with (eval/<set>/... beside eval/reward/<component>).
RESERVED_EVAL_SET_NAMES = frozenset(
    ("reward", "format_reward", "answer_reward", "unparseable_rate", "response_length_mean", "truncated_frac")
)
_EVAL_SET_NAME = re.compile(r"[A-Za-z0-9_-]+")


def eval_set_config(task_cfg: TaskConfig, name: str, source: str) -> TaskConfig:
    """The task config that reads eval set `name` as its eval split: `source` is a local JSONL file
    (`*.jsonl`, read like task.eval_path), a split of the task's hub dataset (`test`), or another hub dataset's
    split (`<dataset>:<split>` or `<dataset>:<config>:<split>`)."""
    if source.endswith(".jsonl"):
        return dataclasses.replace(task_cfg, eval_path=source)
    if not isinstance(task_cfg, HubTaskConfig):
        raise UserFacingError(
            f"task.eval_sets.{name}={source}: task={task_cfg.name} has no hub dataset, so an eval set is a local "
            "JSONL file (a path ending in .jsonl)"
        )
    parts = source.split(":")
    if len(parts) == 1:
        return dataclasses.replace(task_cfg, eval_path=None, hub_eval_split=parts[0])
    if len(parts) in (2, 3):
        hub_config = parts[1] if len(parts) == 3 else None
        return dataclasses.replace(
            task_cfg, eval_path=None, hub_dataset=parts[0], hub_config=hub_config, hub_eval_split=parts[-1]
        )
    raise UserFacingError(
        f"task.eval_sets.{name}={source}: give a .jsonl file, a split of task.hub_dataset, "
        "<dataset>:<split> or <dataset>:<config>:<split>"
    )


def load_eval_sets(task_cfg: TaskConfig) -> dict[str, list[Example]]:
    """task.eval_sets: {name: examples} of the extra held-out sets, each read by the task's own loaders
    (task.n_eval caps each); empty when none is configured."""
    sources = task_cfg.eval_sets or {}
    return {
        name: with_source(
            load_examples(eval_set_config(task_cfg, name, str(src)), "eval"), f"task.eval_sets.{name}={src}"
        )
        for name, src in sources.items()
    }


def get_task(name: str) -> TaskSpec:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}: choose one of {', '.join(sorted(TASKS))}") from None


def task_for(task_cfg: TaskConfig) -> TaskSpec:
    """The TaskSpec a task config runs: the registered one, or for a task made from its config (task=custom) the
    one built from it (the user's code imported and checked; built once per distinct config in a process)."""
    task = get_task(task_cfg.name)
    if task.from_config is None:
        return task
    key = repr(task_cfg)
    if key not in _CONFIGURED:
        _CONFIGURED[key] = task.from_config(task_cfg)
    return _CONFIGURED[key]


_CONFIGURED: dict[str, TaskSpec] = {}


def absolutize_task_paths(task_cfg: TaskConfig, base_dir: Path) -> None:
    """The file references of task.tools and task.environment (every task), and task=custom's relative paths, made
    absolute against `base_dir` (where grpo-run was started), in place, before the config is saved and sent to
    other processes."""
    if get_task(str(task_cfg.name)).from_config is not None:
        absolutize_paths(cast(CustomTaskConfig, task_cfg), base_dir)  # the one task made from its config
    absolutize_multiturn_paths(task_cfg, base_dir)


def _reward_options(task: TaskSpec, task_cfg: TaskConfig) -> dict[str, Any]:
    return {key: getattr(task_cfg, key) for key in task.reward_options}


def reward_weights(task_cfg: TaskConfig) -> dict[str, float]:
    """The components with a nonzero weight in task.reward_weights, as {name: weight} (default: correctness 1)."""
    weights = task_cfg.reward_weights
    if weights is None:
        return dict(DEFAULT_WEIGHTS)
    # RewardWeightsConfig, or task=custom's mapping of the user's reward names. `env` (the environment's step
    # rewards, multi-turn episodes only) is not one of the task's reward components: env_weight reads it.
    items = dataclasses.asdict(weights) if isinstance(weights, RewardWeightsConfig) else dict(weights)
    return {name: float(weight) for name, weight in items.items() if weight != 0 and name != ENV_COMPONENT}


def component_weights(task_cfg: TaskConfig) -> dict[str, float]:
    """The weights make_reward_fn builds the task's reward with: reward_weights(task_cfg), or for a task whose
    environment's reward is the only one weighted (guess_number: task.reward_weights.correctness=0) the task's own
    reward at weight 0, so that "correctness" is still reported (eval/pass@k) and the total is the env component."""
    weights = reward_weights(task_cfg)
    if not weights and is_multiturn(task_cfg) and env_weight(task_cfg) != 0:
        return {"correctness": 0.0}
    return weights


def validate_task_config(task_cfg: TaskConfig) -> None:
    """The task keys their declared constraints cannot check (which reward components this task has, the form of
    task.eval_sets); UserFacingError, one line. config.validate_config checks the ranges first."""
    try:
        task = get_task(task_cfg.name)
    except ValueError as e:
        raise UserFacingError(f"task.name={task_cfg.name}: {e}") from None
    if task.from_config is not None and task.schema is not None and not isinstance(task_cfg, task.schema):
        raise UserFacingError(
            f"task.name={task.name} with another task's keys: choose the task with task={task.name}, not task.name"
        )
    task = task_for(task_cfg)  # task=custom: the user's code imported and checked here, before any model loads
    # The task's schema (config.TASK_SCHEMAS, picked by task=<name>) must hold every key the task reads.
    lacking = [key for key in (*task.options, *task.reward_options) if not hasattr(task_cfg, key)]
    if lacking:
        raise UserFacingError(
            f"task.name={task.name} reads task.{lacking[0]}, which this task config does not have: "
            f"choose the task with task={task.name}, not task.name={task.name}"
        )
    if task_cfg.prompt not in task.prompt_styles:
        raise UserFacingError(
            f"task.prompt={task_cfg.prompt} does not suit task={task.name}'s prompts and reward: "
            f"use task.prompt={' or '.join(task.prompt_styles)}"
        )
    try:
        if task.from_config is None:  # a task made from its config checked its own weights
            check_weights(task, task_cfg.prompt, component_weights(task_cfg), _reward_options(task, task_cfg))
    except ValueError as e:
        raise UserFacingError(str(e)) from None
    # task.tools / task.environment / task.agent loaded here, one line each: episodes/config.py's check, registered
    # in the config's registry (tasks/ does not import the episode machinery)
    check_episodes(task_cfg, task.prompt_styles)
    for name, source in (task_cfg.eval_sets or {}).items():
        if not _EVAL_SET_NAME.fullmatch(str(name)) or name in RESERVED_EVAL_SET_NAMES:
            raise UserFacingError(
                f"task.eval_sets.{name}: a set's name prefixes its metrics (eval/<name>/...), so use letters, "
                f"digits, _ and - and none of {', '.join(sorted(RESERVED_EVAL_SET_NAMES))}"
            )
        eval_set_config(task_cfg, str(name), str(source))  # the source's form, before anything loads


# Each task's config schema (TaskSpec.schema) and the task check, registered in the config's registry
# (config/task_registry.py): grpo_cli.config registers each schema as `<name>_schema` in group `task`
# (conf/task/<name>.yaml extends it) and validate_config ends with validate_task_config.
register_tasks({name: task.schema or TaskConfig for name, task in TASKS.items()}, validate_task_config)


def make_reward_fn(task_cfg: TaskConfig, max_tokens: int | None = None, device: str | None = None) -> RewardFn:
    """The reward a run scores with: the task's reward for `task.prompt`, combined per `task.reward_weights`,
    limited to `task.reward_timeout_s` per call (a timeout raises RewardTimeout, counted by the scorer).
    `max_tokens` (rollout.max_tokens) is what the overlong shaping term measures against; `device` is where a
    reward model runs (the policy's; None: the CPU)."""
    task = task_for(task_cfg)
    if isinstance(task.reward_fn, CustomReward):  # task=custom: weights, limits and errors handled by its reward
        return task.reward_fn.for_run(max_tokens, device)
    shaping = Shaping(
        max_tokens=max_tokens,
        overlong_buffer=task_cfg.overlong_buffer,
        repetition_ngram=task_cfg.repetition_ngram,
    )
    return build_reward_fn(
        task,
        task_cfg.prompt,
        component_weights(task_cfg),
        _reward_options(task, task_cfg),
        task_cfg.reward_timeout_s,
        shaping,
    )


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
    "addition_reward_fn",
    "keyword_inclusion_reward_fn",
    "json_reward_fn",
    "lipogram_reward_fn",
    "medcalc_reward_fn",
    "question_only_reward_fn",
    "r1_zero_reward_fn",
    "regex_sum_reward_fn",
]
