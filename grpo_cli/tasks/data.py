"""A task's examples: a split read from local JSONL (task.train_path / task.eval_path) or built by the task, and
the extra held-out sets of task.eval_sets; each example says where it was read (Example.source)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from grpo_cli.errors import UserFacingError
from grpo_cli.tasks.base import (
    Example,
    Prompt,
    RowError,
    TaskDataError,
    format_prompt,
    iter_jsonl_objects,
    parse_question_row,
)
from grpo_cli.tasks.hub import RowParser
from grpo_cli.tasks.registry import task_for
from grpo_cli.tasks.schema import HubTaskConfig, TaskConfig


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
