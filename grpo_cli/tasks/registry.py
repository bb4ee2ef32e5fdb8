"""The built-in tasks by name (TASKS) and the TaskSpec a task config runs (`task_for`: the registered one, or
task=custom's, built from its config). Adding a built-in task: its module here and its entry in TASKS
(docs/architecture.md#tasks-and-rewards)."""

from __future__ import annotations

from pathlib import Path
from typing import cast

from grpo_cli.tasks.addition import ADDITION_TASK
from grpo_cli.tasks.base import TaskSpec
from grpo_cli.tasks.custom import CUSTOM_TASK, CustomTaskConfig, absolutize_paths
from grpo_cli.tasks.guess_number import GUESS_NUMBER_TASK
from grpo_cli.tasks.json_extraction import JSON_TASK
from grpo_cli.tasks.keyword import KEYWORD_TASK
from grpo_cli.tasks.lipogram import LIPOGRAM_TASK
from grpo_cli.tasks.medcalc import MEDCALC_TASK
from grpo_cli.tasks.multiturn import absolutize_multiturn_paths
from grpo_cli.tasks.reasoning import GSM8K_TASK, MATH_TASK
from grpo_cli.tasks.regex_sum import REGEX_SUM_TASK
from grpo_cli.tasks.schema import TaskConfig
from grpo_cli.tasks.tool_tasks import GSM8K_TOOLS_TASK, PYTHON_MATH_TASK

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
