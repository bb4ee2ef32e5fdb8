"""The grpo-run end-to-end half of tests/unit/jobs/test_check_reward.py: grpo-run as a subprocess."""

from __future__ import annotations

import pytest

from grpo_cli.tasks import TASKS
from tests.conftest import run_grpo


@pytest.mark.parametrize("task", sorted(set(TASKS) - {"custom"}))  # custom's: tests/unit/tasks/test_custom_task.py
def test_grpo_run_check_reward_end_to_end(tmp_path, task):
    result = run_grpo(
        ["job=check_reward", f"task={task}", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"reward sanity cases: task={task}" in result.stdout and "cases agree" in result.stdout
    assert "Traceback" not in result.stderr


def test_grpo_run_check_reward_plays_guess_number_against_the_environment(tmp_path):
    result = run_grpo(
        ["job=check_reward", "task=guess_number", "task.reward_workers=2", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    # the environment's answers, run in its worker processes between the scripted guesses
    assert "assistant: 50\n  user: Lower.\n  assistant: 25\n  user: Higher.\n  assistant: 37\n  ended: done" in (
        result.stdout
    )
    assert "all 5 cases agree with task=guess_number's reward rule" in result.stdout
