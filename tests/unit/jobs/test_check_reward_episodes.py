"""job=check_reward on multi-turn cases: the given assistant turns are played as the model's, the task's tools or
environment run for real between them, and the finished episode is scored as a run scores it (the default model's
tokenizer; no model)."""

from __future__ import annotations

import dataclasses
import io
import json
import textwrap

import pytest
from rich.console import Console

from grpo_cli.errors import UserFacingError
from grpo_cli.jobs.check_reward import run as check_reward
from grpo_cli.tasks import TASKS
from grpo_cli.tasks.custom import CustomTaskConfig, absolutize_paths
from tests.conftest import compose_config, write_my_tools

REWARDS_PY = """
def used_the_tool_then_answered(completions, completion_ids, answer, **kwargs):
    # the whole episode: a tool message with the right sum, then the answer in the last turn; one id list per turn
    out = []
    for messages, ids, truth in zip(completions, completion_ids, answer):
        tool = [m["content"] for m in messages if m["role"] == "tool"]
        n_turns = sum(m["role"] == "assistant" for m in messages)
        ok = tool == [truth] and truth in messages[-1]["content"] and len(ids) == n_turns
        out.append(float(ok))
    return out
"""


def console() -> Console:
    return Console(file=io.StringIO(), width=220, highlight=False)


def test_a_users_tool_runs_between_the_scripted_turns_and_the_reward_sees_the_episode(tmp_path):
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 40, "b": 2}}\n</tool_call>'
    cases = [
        {"prompt": [{"role": "user", "content": "40 + 2?"}], "answer": "42", "turns": [call, "It is 42."],
         "expected": 1.0, "why": "the tool answers 42"},
        {"prompt": [{"role": "user", "content": "40 + 2?"}], "answer": "42", "turns": ["It is 42."],
         "expected": 0.0, "why": "no tool call: no tool message"},
    ]  # fmt: skip
    (tmp_path / "cases.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cases))
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": cases[0]["prompt"], "answer": "42"}) + "\n")
    write_my_tools(tmp_path)
    (tmp_path / "rewards.py").write_text(textwrap.dedent(REWARDS_PY))
    task = CustomTaskConfig(
        name="custom", train_path="train.jsonl", eval_path="train.jsonl", cases_path="cases.jsonl",
        rewards={"episode": "rewards.py:used_the_tool_then_answered"}, tools={"add": "my_tools.py:add"},
    )  # fmt: skip
    absolutize_paths(task, tmp_path)
    cfg = compose_config(["job=check_reward", "task=custom", f"task.base_dir={tmp_path}"])
    cfg.task = task
    out = console()
    assert check_reward(cfg, tmp_path, out) == {"n": 2, "n_disagree": 0}
    text = out.file.getvalue()
    assert "tool: 42" in text and "assistant: It is 42." in text and "episode=1" in text and "episode=0" in text


def test_guess_number_runs_the_environment_and_shows_the_transcript(tmp_path):
    out = console()
    assert check_reward(compose_config(["job=check_reward", "task=guess_number"]), tmp_path, out)["n_disagree"] == 0
    text = out.file.getvalue()
    # case 1: 50, 25, 37 against the target 37: the environment's own answers, then the win
    assert "assistant: 50\n  user: Lower.\n  assistant: 25\n  user: Higher.\n  assistant: 37\n  ended: done" in text
    # out of turns, each turn ended by the model: turn-limited, not truncated (no turn was cut mid-generation)
    assert "ended: max_turns (turn-limited)\n" in text and "env=1" in text


def test_a_multi_turn_case_that_disagrees_fails_the_job(monkeypatch, tmp_path):
    spec = TASKS["guess_number"]
    wrong = dataclasses.replace(spec.sanity_cases[0], expected_reward=0.0, why="deliberately wrong expectation")
    monkeypatch.setitem(TASKS, "guess_number", dataclasses.replace(spec, sanity_cases=(wrong,)))
    out = console()
    with pytest.raises(UserFacingError, match=r"1 of 1 reward sanity cases of task=guess_number disagree"):
        check_reward(compose_config(["job=check_reward", "task=guess_number"]), tmp_path, out)
    assert "DIFFERS" in out.file.getvalue()


def test_max_turns_cuts_a_script_longer_than_it(tmp_path):
    out = console()
    cfg = compose_config(["job=check_reward", "task=guess_number", "task.max_turns=2"])
    with pytest.raises(UserFacingError, match=r"task=guess_number disagree \(rows 1, 3\)"):
        check_reward(cfg, tmp_path, out)  # the games won on the 3rd guess are lost at 2 turns


BROKEN_ENV_PY = """
class Broken:
    def reset(self, row):
        return [{"role": "user", "content": "Guess."}]

    def step(self, messages):
        if "boom" in messages[-1]["content"]:
            raise RuntimeError("the board caught fire")
        return None, 1.0, True
"""


@pytest.mark.parametrize("on_error", ["stop", "skip"])
def test_an_environment_that_fails_follows_on_reward_error(tmp_path, on_error):
    from grpo_cli.errors import EnvironmentFailed
    from grpo_cli.jobs.check_reward import scripted_turns
    from grpo_cli.models import EMBEDDED_SMOLLM2, load_tokenizer
    from grpo_cli.rollout.multiturn import episode_setup, score_episodes
    from grpo_cli.tasks import make_reward_fn
    from grpo_cli.tasks.base import Example

    (tmp_path / "envs.py").write_text(textwrap.dedent(BROKEN_ENV_PY))
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    task = CustomTaskConfig(
        name="custom", train_path="train.jsonl", eval_path="train.jsonl", prompt="chat", reward_workers=0,
        environment="envs.py:Broken", on_reward_error=on_error,
    )  # fmt: skip
    absolutize_paths(task, tmp_path)
    setup = episode_setup(task, load_tokenizer(EMBEDDED_SMOLLM2), 16)
    assert setup is not None
    example = Example([{"role": "user", "content": "x"}], {"prompt": "x"})
    try:
        if on_error == "stop":
            with pytest.raises(
                EnvironmentFailed, match=r"^task.environment: the environment raised RuntimeError: the board"
            ):
                setup.run([example], scripted_turns(setup.template, ["boom"]))
            return
        episodes = setup.run([example], scripted_turns(setup.template, ["boom"]))
        assert episodes[0].stop_reason == "error" and "the board caught fire" in str(episodes[0].error)
        reward = score_episodes(make_reward_fn(task), episodes, setup.env_weight).rewards[0]
        assert "reward/env" not in reward and reward["reward"] == 0.0  # skip: no env reward for that episode
    finally:
        setup.close()
