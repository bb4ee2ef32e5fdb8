"""job=check_reward: the sanity-case table of every task, no model; a disagreement fails the job."""

import dataclasses
import io

import pytest
from rich.console import Console

from grpo_cli.errors import UserFacingError
from grpo_cli.jobs.check_reward import run as run_check_reward_job
from grpo_cli.tasks import TASKS
from tests.conftest import compose_config

TASK_PROMPTS = [
    ("keyword", "chat"),
    ("math", "r1_zero"),
    ("math", "question_only"),
    ("gsm8k", "r1_zero"),
    ("gsm8k", "question_only"),
    ("lipogram", "chat"),
    ("json", "chat"),
    ("regex_sum", "chat"),
    ("addition", "chat"),
    ("addition", "question_only"),
    ("medcalc", "question_only"),
    ("medcalc", "chat"),
    # multi-turn: the tools and the environment run for real between the scripted turns (test_check_reward_episodes)
    ("gsm8k_tools", "chat"),
    ("python_math", "chat"),
    ("guess_number", "chat"),
]


def console() -> Console:
    return Console(file=io.StringIO(), width=200, highlight=False)


def test_every_registered_task_is_covered():
    # task=custom runs the user's own cases (task.cases_path): tests/unit/tasks/test_custom_task.py
    assert {task for task, _ in TASK_PROMPTS} | {"custom"} == set(TASKS)


@pytest.mark.parametrize(("task", "prompt"), TASK_PROMPTS)
def test_every_task_and_prompt_style_agrees_with_its_cases(task, prompt, tmp_path):
    out = console()
    summary = run_check_reward_job(
        compose_config(["job=check_reward", f"task={task}", f"task.prompt={prompt}"]), tmp_path, out
    )
    text = out.file.getvalue()
    assert summary["n_disagree"] == 0 and summary["n"] >= 4
    assert f"all {summary['n']} cases agree" in text and "DIFFERS" not in text


def test_a_disagreeing_case_fails_the_job_and_is_marked_in_the_table(monkeypatch, tmp_path):
    spec = TASKS["regex_sum"]
    wrong = dataclasses.replace(spec.sanity_cases[0], expected_reward=0.0, why="deliberately wrong expectation")
    monkeypatch.setitem(TASKS, "regex_sum", dataclasses.replace(spec, sanity_cases=(wrong, *spec.sanity_cases[1:])))
    out = console()
    with pytest.raises(UserFacingError, match=r"1 of 9 reward sanity cases of task=regex_sum disagree \(rows 1\)"):
        run_check_reward_job(compose_config(["job=check_reward", "task=regex_sum"]), tmp_path, out)
    assert "DIFFERS" in out.file.getvalue() and "deliberately wrong expectation" in out.file.getvalue()


def test_a_crashing_reward_is_shown_as_an_error_row(monkeypatch, tmp_path):
    def crash(response, truth):
        raise RuntimeError("reward bug")

    monkeypatch.setitem(TASKS, "json", dataclasses.replace(TASKS["json"], reward_fn=crash))
    out = console()
    with pytest.raises(UserFacingError, match="9 of 9"):
        run_check_reward_job(compose_config(["job=check_reward", "task=json"]), tmp_path, out)
    assert "RuntimeError: reward bug" in out.file.getvalue()


def test_custom_weights_add_a_weighted_total_column(tmp_path):
    out = console()
    run_check_reward_job(
        compose_config(["job=check_reward", "task=gsm8k", "task.reward_weights.format=0.1"]), tmp_path, out
    )
    text = out.file.getvalue()
    assert "weighted total" in text and "1.1" in text
