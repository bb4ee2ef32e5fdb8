"""The task keys their declared constraints cannot check (`validate_task_config`, which config.validate_config ends
with: registered in config/task_registry.py by tasks/__init__.py)."""

from __future__ import annotations

import re

from grpo_cli.config.task_registry import check_episodes
from grpo_cli.errors import UserFacingError
from grpo_cli.tasks.data import RESERVED_EVAL_SET_NAMES, eval_set_config
from grpo_cli.tasks.registry import get_task, task_for
from grpo_cli.tasks.reward_fn import component_weights, reward_options
from grpo_cli.tasks.rewards import check_weights
from grpo_cli.tasks.schema import TaskConfig

_EVAL_SET_NAME = re.compile(r"[A-Za-z0-9_-]+")


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
            check_weights(task, task_cfg.prompt, component_weights(task_cfg), reward_options(task, task_cfg))
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
