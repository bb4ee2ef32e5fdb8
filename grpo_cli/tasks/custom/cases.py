"""job=check_reward's cases for task=custom (task.cases_path): each line a response (or a multi-turn episode's
model turns), the row's columns, and the reward it should get."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grpo_cli.tasks.base import SanityCase, TaskDataError
from grpo_cli.tasks.custom.data import examples_of, renamed
from grpo_cli.tasks.custom.schema import CustomTaskConfig
from grpo_cli.tasks.custom.trl_convention import value_problem
from grpo_cli.tasks.sources import file_rows

# Keys of a case line that are not columns of the row.
CASE_KEYS = ("response", "turns", "expected", "why", "completion_ids")


def read_cases(task_cfg: CustomTaskConfig, names: Sequence[str] = ()) -> tuple[SanityCase, ...]:
    """task.cases_path: {"response", "expected", <columns>} per line -> sanity cases (job=check_reward). "expected"
    is the weighted total (a number), or {reward name: value} for each reward it names (null: that reward gives
    this sample none); `names` are the rewards a case may name. "completion_ids" (optional) are the response's
    token ids, for rewards that read them."""
    if not task_cfg.cases_path:
        return ()
    rows = file_rows("task.cases_path", task_cfg.cases_path, None)
    cases = []
    for line, row in enumerate(rows, start=1):
        where = f"{task_cfg.cases_path}:{line}"
        turns = row.get("turns")
        if turns is not None and (
            not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns)
        ):
            raise TaskDataError(
                f'{where}: "turns" must be a non-empty list of the model\'s turns (strings), got {turns!r:.60}'
            )
        if ("response" not in row and turns is None) or "expected" not in row:
            raise TaskDataError(
                f'{where}: each case needs "response" (or "turns", a multi-turn episode\'s model turns) and '
                '"expected" (and the columns the prompt reads)'
            )
        columns = renamed(task_cfg, {k: v for k, v in row.items() if k not in CASE_KEYS})
        example = examples_of(task_cfg, [columns], where)[0]
        total, each = _expected_of(row["expected"], where, names)
        ids = row.get("completion_ids")
        if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, int) for i in ids)):
            raise TaskDataError(f'{where}: "completion_ids" must be a list of token ids (integers), got {ids!r:.60}')
        why = str(row.get("why", where))
        cases.append(
            SanityCase(
                example.ground_truth,
                str(turns[-1] if turns is not None else row["response"]),
                total,
                why,
                expected_each=each,
                completion_ids=tuple(ids) if ids is not None else None,
                turns=tuple(turns) if turns is not None else None,
                prompt=example.prompt if turns is not None else None,
            )
        )
    return tuple(cases)


def _expected_of(
    expected: Any, where: str, names: Sequence[str]
) -> tuple[float | None, dict[str, float | None] | None]:
    """(the weighted total, {reward: value}) a case expects: a number is the total, a dict each named reward."""
    if isinstance(expected, dict):
        if not expected:
            raise TaskDataError(f'{where}: "expected" names no reward: give {{"<name>": value, ...}} or a number')
        each: dict[str, float | None] = {}
        for name, value in expected.items():
            if names and name not in names:
                raise TaskDataError(
                    f'{where}: "expected" names {name!r}, which is no reward of this task: use {", ".join(names)}'
                )
            if value is not None and value_problem(value) is not None:
                raise TaskDataError(f'{where}: "expected" of {name!r} must be a number or null, got {value!r}')
            each[str(name)] = None if value is None else float(value)
        return None, each
    if expected is None or value_problem(expected) is not None:
        raise TaskDataError(
            f'{where}: "expected" must be a number (the weighted total) or {{"<reward name>": value, ...}}, '
            f"got {expected!r}"
        )
    return float(expected), None
