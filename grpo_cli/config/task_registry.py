"""The task schemas by task name, and the check of a task config its declarations cannot make: the config's
registry, which the tasks package fills when it is imported (grpo_cli/tasks/__init__.py calls `register_tasks`).

The config reads the registry and never imports a task, so the arrow runs one way, tasks -> config: GRPOConfig's
`task` node takes one of these schemas (picked by task=<name>, registered in Hydra's ConfigStore as
`<name>_schema`), and validate_config ends with the registered check (the task's reward components, its tools
and environment). Whatever composes or validates a config imports grpo_cli.tasks first (grpo-run's cli does).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

# task name -> its config schema (a TaskConfig subclass; Any here: the config does not import the tasks package).
# Filled in place by register_tasks, so every holder of this dict (GROUP_SCHEMAS["task"]) sees the tasks.
TASK_SCHEMAS: dict[str, type] = {}
# The one task check, a function of the task config that raises UserFacingError (tasks.validate_task_config).
_TASK_CHECKS: list[Callable[[Any], None]] = []


def register_tasks(schemas: Mapping[str, type], check: Callable[[Any], None]) -> None:
    """Make the tasks `schemas` ({name: schema}) known to the config, and `check` the validation of a task config
    that validate_config ends with. A second registration replaces the first (a module reloaded in a test)."""
    TASK_SCHEMAS.clear()
    TASK_SCHEMAS.update(schemas)
    _TASK_CHECKS[:] = [check]


def task_names() -> tuple[str, ...]:
    """The registered tasks' names (task.name's allowed values)."""
    return tuple(TASK_SCHEMAS)


def require_tasks() -> dict[str, type]:
    """TASK_SCHEMAS, or a RuntimeError (a bug of the caller, not the user's) when no task registered yet."""
    if not TASK_SCHEMAS:
        raise RuntimeError("no task schemas registered: import grpo_cli.tasks before composing or validating a config")
    return TASK_SCHEMAS


def check_task(task_cfg: Any) -> None:
    """The registered task check on a task config (UserFacingError, one line)."""
    require_tasks()
    for check in _TASK_CHECKS:
        check(task_cfg)
