"""Tasks by name: prompts, data and reward functions (no torch in this package)."""

from __future__ import annotations

import json
from typing import Any

from grpo_cli.errors import UserFacingError
from grpo_cli.tasks.base import REWARD_KEYS, Example, Prompt, RewardFn, SanityCase, TaskSpec, format_prompt
from grpo_cli.tasks.keyword import KEYWORD_TASK, keyword_inclusion_reward_fn


class TaskDataError(UserFacingError):
    """A data file that cannot be read or parsed."""


TASKS: dict[str, TaskSpec] = {task.name: task for task in (KEYWORD_TASK,)}


def load_jsonl_examples(path: str, prompt_style: str, n: int | None = None) -> list[Example]:
    """Read {"question": str, "ground_truth": ...} lines; errors name the file, the line and the field."""
    examples = []
    try:
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TaskDataError(
                        f"{path}:{line_no}: not valid JSON ({e.msg}): fix or remove that line"
                    ) from None
                if not isinstance(row, dict):
                    raise TaskDataError(f"{path}:{line_no}: expected a JSON object per line")
                for key in ("question", "ground_truth"):
                    if key not in row:
                        raise TaskDataError(
                            f'{path}:{line_no}: missing field {key!r} (each line needs "question" and "ground_truth")'
                        )
                examples.append(
                    Example(
                        prompt=format_prompt(row["question"], prompt_style),
                        ground_truth=row["ground_truth"],
                        meta={"question": row["question"]},
                    )
                )
                if n is not None and len(examples) >= n:
                    break
    except OSError as e:
        raise TaskDataError(
            f"cannot read data file {path}: {e.strerror}: check task.train_path / task.eval_path"
        ) from None
    if not examples:
        raise TaskDataError(f"{path} holds no examples")
    return examples


def load_examples(task_cfg: Any, split: str) -> list[Example]:
    """The examples of one split ("train" or "eval") for a task config (local JSONL when a path is set)."""
    task = get_task(task_cfg.name)
    path = task_cfg.train_path if split == "train" else task_cfg.eval_path
    n = task_cfg.n_train if split == "train" else task_cfg.n_eval
    if path:
        return load_jsonl_examples(path, task_cfg.prompt, n)
    options = {key: getattr(task_cfg, key) for key in task.options}
    return task.build(split, n, task_cfg.data_seed, task_cfg.prompt, **options)


def get_task(name: str) -> TaskSpec:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}: choose one of {', '.join(sorted(TASKS))}") from None


__all__ = [
    "REWARD_KEYS",
    "TASKS",
    "Example",
    "Prompt",
    "RewardFn",
    "SanityCase",
    "TaskSpec",
    "format_prompt",
    "TaskDataError",
    "get_task",
    "load_examples",
    "load_jsonl_examples",
    "keyword_inclusion_reward_fn",
]
