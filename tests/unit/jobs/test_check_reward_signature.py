"""job=check_reward checks a custom reward's signature against its cases' columns as training checks it against the
data's: one line naming the parameter no column fills (it was a crash in every row of the table, and "the reward
does not do what the task's cases expect"); a task without cases says how to write one, without a stray brace."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from grpo_cli.config.schemas import GRPOConfig
from grpo_cli.errors import UserFacingError
from grpo_cli.jobs.check_reward import run as check_reward
from grpo_cli.tasks import absolutize_task_paths
from tests.conftest import compose_config

REWARDS = """
def wrong(completions, solution, **kwargs):
    return [float(s in c) for c, s in zip(completions, solution)]


def right(completions, answer, **kwargs):
    return [float(a in c) for c, a in zip(completions, answer)]
"""


def folder(tmp_path: Path) -> Path:
    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "data.jsonl").write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    case = {"question": "1+1", "answer": "2", "response": "2", "expected": 1.0}
    (tmp_path / "cases.jsonl").write_text(json.dumps(case) + "\n")
    return tmp_path


def custom(tmp_path: Path, reward: str, cases: str | None = "cases.jsonl") -> GRPOConfig:
    """The config of `grpo-run job=check_reward task=custom ...` run from tmp_path (its paths made absolute as
    cli.py makes them)."""
    cfg = compose_config(
        [
            "job=check_reward",
            "task=custom",
            f"task.base_dir={folder(tmp_path)}",
            "task.train_path=data.jsonl",
            "task.template='{question}'",
            "task.prompt=question_only",
            f"+task.rewards.r=rewards.py:{reward}",
            f"task.cases_path={cases}" if cases else "task.cases_path=null",
            "model=tiny_random",
        ]
    )
    absolutize_task_paths(cfg.task, tmp_path)
    return cfg


def console() -> Console:
    return Console(file=io.StringIO(), width=200, highlight=False)


def test_a_reward_missing_a_column_is_one_line_naming_it(tmp_path: Path) -> None:
    with pytest.raises(UserFacingError) as error:
        check_reward(custom(tmp_path, "wrong"), tmp_path, console())
    line = str(error.value)
    assert "\n" not in line and "wrong(completions, solution, **kwargs) cannot take TRL's arguments" in line
    assert f"the columns of task.cases_path={tmp_path / 'cases.jsonl'} (line 1): question, answer" in line
    assert "missing a required argument: 'solution'" in line
    # The same reward reading a column the cases have: the table, every case agreeing.
    assert check_reward(custom(tmp_path, "right"), tmp_path, console())["n_disagree"] == 0


def test_a_custom_task_without_cases_says_how_to_write_one(tmp_path: Path) -> None:
    with pytest.raises(UserFacingError) as error:
        check_reward(custom(tmp_path, "right", cases=None), tmp_path, console())
    assert str(error.value).endswith(
        'one {"response": ..., "expected": ..., <the columns your template reads>} per line'
    )
