"""The task schemas by task name, and the check of a task config its declarations cannot make: the config's
registry, which the tasks package fills when it is imported (grpo_cli/tasks/__init__.py calls `register_tasks`).

The config reads the registry and never imports a task, so the arrow runs one way, tasks -> config: GRPOConfig's
`task` node takes one of these schemas (picked by task=<name>, registered in Hydra's ConfigStore as
`<name>_schema`), and validate_config ends with the registered check (the task's reward components, its tools
and environment). Whatever composes or validates a config imports grpo_cli.tasks first (grpo-run's cli does).

The multi-turn keys' check (loading the tools, the environment, the agent; starting the sandbox) is registered the
same way, by grpo_cli.episodes.config when it is imported: the task check calls it through `check_episodes`, so that
tasks/ never imports the episode machinery. Without it a task check raises (a caller's bug, never a skipped check).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

# task name -> its config schema (a TaskConfig subclass; Any here: the config does not import the tasks package).
# Filled in place by register_tasks, so every holder of this dict (GROUP_SCHEMAS["task"]) sees the tasks.
TASK_SCHEMAS: dict[str, type] = {}
# The one task check, a function of the task config that raises UserFacingError (tasks.validate_task_config).
_TASK_CHECKS: list[Callable[[Any], None]] = []
# The multi-turn keys' check, a function of the task config and the task's prompt styles that raises
# UserFacingError (episodes.config.validate_multiturn).
_EPISODE_CHECKS: list[Callable[[Any, tuple[str, ...]], None]] = []


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


def register_episode_check(check: Callable[[Any, tuple[str, ...]], None]) -> None:
    """Make `check` (the task config, the task's prompt styles) the multi-turn keys' check that the task check
    calls. A second registration replaces the first (a module reloaded in a test)."""
    _EPISODE_CHECKS[:] = [check]


def check_episodes(task_cfg: Any, prompt_styles: tuple[str, ...]) -> None:
    """The registered multi-turn keys' check on a task config (UserFacingError, one line); a RuntimeError (a bug
    of the caller, not the user's) when none is registered: a task's tools would go unchecked."""
    if not _EPISODE_CHECKS:
        raise RuntimeError(
            "no multi-turn check registered: import grpo_cli.episodes.config before validating a task config"
        )
    for check in _EPISODE_CHECKS:
        check(task_cfg, prompt_styles)
