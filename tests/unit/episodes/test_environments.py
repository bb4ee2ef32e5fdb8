"""task.environment (grpo_cli/episodes/environments.py): loading a user's class, one stateful instance per episode in a
killable worker process, errors and time-outs as the episode's error, the SkyRL-gym adapter, guess_number."""

from __future__ import annotations

import functools
import textwrap
from pathlib import Path

import pytest

from grpo_cli.episodes.environments import (
    EnvironmentRunner,
    SkyRLGymEnvironment,
    check_error,
    load_environment_factory,
)
from grpo_cli.errors import EnvironmentFailed, UserFacingError
from grpo_cli.tasks.guess_number import GuessNumber, guess_number_rows
from grpo_cli.usercode.user_code import UserCodeError

# A stateful environment: counts its steps; "sleep" in the model's turn blocks in C, "boom" raises, "exit" exits,
# "bad" returns a malformed step.
COUNTER = """
import os, sys, time

class Counter:
    def __init__(self, start=0):
        self.count = start
        self.pid = os.getpid()

    def reset(self, row):
        self.turns = row["turns"]
        return [{"role": "user", "content": f"count for {row['name']}"}]

    def step(self, messages):
        said = messages[-1]["content"]
        if said == "sleep":
            time.sleep(60)
        if said == "boom":
            raise ValueError("the counter broke")
        if said == "exit":
            sys.exit(3)
        if said == "bad":
            return "five", 1.0, False
        self.count += 1
        done = self.count >= self.turns
        observation = None if done else [{"role": "user", "content": f"{self.count} from {self.pid}"}]
        return observation, float(self.count), done

def not_a_class():
    pass

class NoStep:
    pass

class NoReset:
    def step(self, messages):
        return None, None, True
"""


@pytest.fixture
def env_dir(tmp_path: Path) -> Path:
    (tmp_path / "counter.py").write_text(textwrap.dedent(COUNTER))
    return tmp_path


def conversation(opening: list[dict], *turns: str) -> list[dict]:
    return [*opening, *({"role": "assistant", "content": t} for t in turns)]


def test_an_environment_loads_from_a_file_a_module_or_a_node_with_constructor_arguments(env_dir: Path) -> None:
    assert load_environment_factory("task.environment", "counter.py:Counter", env_dir)().count == 0
    assert load_environment_factory("task.environment", "counter:Counter", env_dir)().count == 0
    assert load_environment_factory("task.environment", "counter.Counter", env_dir)().count == 0
    made = load_environment_factory("task.environment", {"_target_": "counter.py:Counter", "start": 7}, env_dir)
    assert made().count == 7 and made() is not made()  # one instance per call, so one per episode


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("counter.py:not_a_class", "task.environment=counter.py:not_a_class: not_a_class is not a class"),
        ("counter.py:NoStep", "task.environment=counter.py:NoStep: NoStep has no step(messages) method: add one"),
        # A class is looked for, and the classes of the file are listed (not its functions, not what it imports).
        (
            "counter.py:Maze",
            "task.environment=counter.py:Maze: counter.py has no class Maze (it defines Counter, NoReset",
        ),
        ("missing.py:Env", "task.environment=missing.py:Env: no such file"),
        ({"start": 1}, "task.environment={start: 1}: an environment given as a node names its class in _target_"),
        ({"_target_": "counter.py:NoStep"}, "task.environment={_target_: counter.py:NoStep}: NoStep has no step("),
    ],
)
def test_a_bad_environment_spec_is_one_line(env_dir: Path, spec: str | dict, expected: str) -> None:
    with pytest.raises(UserCodeError) as excinfo:
        load_environment_factory("task.environment", spec, env_dir)
    assert "\n" not in str(excinfo.value) and str(excinfo.value).startswith(expected)


@pytest.mark.parametrize("n_workers", [2, 0])
def test_each_episode_keeps_its_own_instance_across_steps(env_dir: Path, n_workers: int) -> None:
    runner = EnvironmentRunner("task.environment", "counter.py:Counter", env_dir, n_workers, time_limit_s=30)
    try:
        rows = [{"name": "a", "turns": 2}, {"name": "b", "turns": 3}, {"name": "c", "turns": 1}]
        sessions = runner.reset(rows)
        assert [s.opening for s in sessions] == [[{"role": "user", "content": f"count for {n}"}] for n in "abc"]
        first = runner.step(sessions, [conversation(s.opening, "one") for s in sessions])
        assert [(s.reward, s.done) for s in first] == [(1.0, False), (1.0, False), (1.0, True)]
        second = runner.step(sessions[:2], [conversation(s.opening, "one", "two") for s in sessions[:2]])
        assert [(s.reward, s.done) for s in second] == [(2.0, True), (2.0, False)]
        pids = {int(str(s.messages[0]["content"]).split()[-1]) for s in first if s.messages}
        assert len(pids) == (2 if n_workers == 2 else 1)  # the episodes of two workers ran in both
        runner.close(sessions)
    finally:
        runner.shutdown()


def test_errors_and_time_outs_are_the_episodes_and_a_killed_workers_other_episodes_replay(env_dir: Path) -> None:
    runner = EnvironmentRunner("task.environment", "counter.py:Counter", env_dir, 1, time_limit_s=1.0)
    try:
        sessions = runner.reset([{"name": n, "turns": 9} for n in ("slow", "steady", "raises", "exits", "bad")])
        steady = sessions[1]
        assert runner.step([steady], [conversation(steady.opening, "one")])[0].reward == 1.0
        said = ["sleep", "two", "boom", "exit", "bad"]
        steps = runner.step(sessions, [conversation(s.opening, w) for s, w in zip(sessions, said, strict=True)])
        assert steps[0].error == "took longer than 1s: its worker process was killed" and steps[0].done
        assert steps[1].reward == 2.0 and steps[1].error is None
        assert steps[2].error == "raised ValueError: the counter broke"
        assert steps[3].error == "called sys.exit(3)"
        assert steps[4].error is not None and "step's observation must be a list of" in steps[4].error
        # The time-out and the exit killed the worker that held "steady": its next step replays its episode in the
        # new worker (reset, then the two earlier steps), so its count goes on from 2.
        assert runner.step([steady], [conversation(steady.opening, "one", "two", "three")])[0].reward == 3.0
    finally:
        runner.shutdown()


def test_without_reset_an_episode_opens_with_the_rows_prompt(env_dir: Path) -> None:
    runner = EnvironmentRunner("task.environment", "counter.py:NoReset", env_dir, 0, time_limit_s=None)
    text, chat, none = runner.reset([{"prompt": "hi"}, {"prompt": [{"role": "system", "content": "s"}]}, {"x": 1}])
    assert text.opening == [{"role": "user", "content": "hi"}] and chat.opening == [{"role": "system", "content": "s"}]
    assert none.opening == [] and none.error is not None and "has no reset(row) and the row has no prompt" in none.error


def test_on_reward_error_stop_is_one_line_and_skip_goes_on() -> None:
    check_error("task.environment", "skip", "raised ValueError: x", {"name": "a"})
    check_error("task.environment", "stop", None, {"name": "a"})
    with pytest.raises(EnvironmentFailed) as excinfo:
        check_error("task.environment", "stop", "raised ValueError: x", {"name": "a"})
    assert isinstance(excinfo.value, UserFacingError) and "\n" not in str(excinfo.value)
    assert str(excinfo.value).startswith("task.environment: the environment raised ValueError: x on the row (name='a')")


def test_guess_number_answers_higher_or_lower_and_pays_for_the_number() -> None:
    (row,) = guess_number_rows(1, seed=3, low=1, high=10)
    assert guess_number_rows(1, seed=3, low=1, high=10) == [row] and 1 <= row["target"] <= 10
    env = GuessNumber()
    opening = env.reset(row)
    assert "between 1 and 10" in opening[0]["content"]
    target = row["target"]
    assert env.step(conversation(opening, f"I guess {target - 1}")) == (
        [{"role": "user", "content": "Higher."}],
        0.0,
        False,
    )
    assert env.step(conversation(opening, f"{target + 1}")) == ([{"role": "user", "content": "Lower."}], 0.0, False)
    assert env.step(conversation(opening, "no idea"))[1:] == (0.0, False)
    assert env.step(conversation(opening, f"It is {target}.")) == (None, 1.0, True)


# ---------------------------------------------------------------------------------------- the SkyRL-gym adapter

GSM8K_ROW = {
    "prompt": [{"role": "user", "content": "What is 6 times 7? End with #### ANSWER."}],
    "reward_spec": {"method": "rule", "ground_truth": "42"},
    "extra_info": {"max_turns": 2},
}


def test_a_skyrl_gym_environment_runs_unchanged() -> None:
    # skyrl-gym is in the [dev] extra: the adapter is tested against the real package, never skipped.
    env = SkyRLGymEnvironment("gsm8k_multi_turn")
    opening = env.reset(dict(GSM8K_ROW))
    assert opening == GSM8K_ROW["prompt"]
    observation, reward, done = env.step(conversation(opening, "It is 41.\n#### 41"))
    assert observation is not None and "#### ANSWER" in observation[0]["content"] and not done
    assert reward is not None and 0 < reward < 1  # SkyRL's format score for a well-formed wrong answer
    assert env.step(conversation(opening, "#### 41", "#### 42")) == (None, 1.0, True)
    env.close()


def test_a_skyrl_gym_environment_runs_in_the_workers_from_a_target_node(tmp_path: Path) -> None:
    spec = {
        "_target_": "grpo_cli.episodes.environments.SkyRLGymEnvironment",
        "env": "skyrl_gym.envs.gsm8k.multi_turn_env:GSM8kMultiTurnEnv",
    }
    runner = EnvironmentRunner("task.environment", spec, tmp_path, 1, time_limit_s=60)
    try:
        (session,) = runner.reset([GSM8K_ROW])
        (step,) = runner.step([session], [conversation(session.opening, "#### 42")])
        assert (step.messages, step.reward, step.done, step.error) == (None, 1.0, True, None)
    finally:
        runner.shutdown()


RECORDER_PY = """
class Recorder:
    made = []

    def __init__(self, env_config, extras):
        Recorder.made.append((env_config, extras))
        self.db_path = env_config.db_path  # SkyRL's text2sql reads its env_config by attribute

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        return {"observations": [], "reward": float(self.db_path == "/data"), "done": True, "metadata": {}}

    def close(self):
        pass
"""


def test_the_skyrl_adapter_passes_what_skyrls_generator_passes(tmp_path: Path) -> None:
    from omegaconf import DictConfig

    from grpo_cli.episodes.environments import skyrl_extras, with_run_limits

    (tmp_path / "recorder.py").write_text(RECORDER_PY)
    (tmp_path / "envs.py").write_text(
        "class Maze:\n    def step(self, messages):\n        return None, None, True\n"
        "class Limited(Maze):\n    def __init__(self, max_turns=None):\n        self.max_turns = max_turns\n"
    )
    spec = {"_target_": "grpo_cli.episodes.environments.SkyRLGymEnvironment", "env": "recorder.py:Recorder",
            "env_config": {"db_path": "/data"}, "base_dir": str(tmp_path)}  # fmt: skip
    # task.max_turns reaches the adapter (SkyRL's generator.max_turns), as any class taking max_turns; other
    # environments' specs, and a node that sets it, are left alone
    limited = functools.partial(with_run_limits, "task.environment", base_dir=tmp_path, max_turns=3)
    assert limited(spec=spec) == {**spec, "max_turns": 3}
    assert limited(spec="envs.py:Maze") == "envs.py:Maze"
    assert limited(spec={"_target_": "envs.py:Maze"}) == {"_target_": "envs.py:Maze"}
    assert limited(spec={"_target_": "envs.py:Limited"}) == {"_target_": "envs.py:Limited", "max_turns": 3}
    assert limited(spec={**spec, "max_turns": 5}) == {**spec, "max_turns": 5}
    env = SkyRLGymEnvironment(**{k: v for k, v in limited(spec=spec).items() if k != "_target_"})
    row = {**GSM8K_ROW, "data_source": "gsm8k", "max_turns": 9}
    assert env.reset(row) == GSM8K_ROW["prompt"]
    assert env.step(conversation(GSM8K_ROW["prompt"], "x")) == (None, 1.0, True)
    recorder = env._instance.__class__
    env_config, extras = recorder.made[-1]
    # env_config a DictConfig; extras: the row's columns but the prompt, max_turns from the task over the row's
    assert isinstance(env_config, DictConfig) and env_config.db_path == "/data"
    assert extras == {"reward_spec": GSM8K_ROW["reward_spec"], "extra_info": GSM8K_ROW["extra_info"],
                      "data_source": "gsm8k", "max_turns": 3}  # fmt: skip
    assert skyrl_extras({"prompt": "p", "env_class": "gsm8k", "a": 1}, None) == {"a": 1}
    # a row's env_class names the environment, as SkyRL's dataset column does (here skyrl_gym's registered gsm8k)
    env.reset({**GSM8K_ROW, "env_class": "gsm8k"})
    assert type(env._instance).__name__ == "GSM8kEnv"
    assert env.step(conversation(GSM8K_ROW["prompt"], "#### 42")) == (None, 1.0, True)


def test_numpy_scalars_are_taken_where_python_numbers_are() -> None:
    import numpy as np

    from grpo_cli.episodes.environments import check_step

    observation = [{"role": "user", "content": "Higher."}]
    # As the SkyRL adapter casts them: an np.float32 reward and an np.bool_ done are the numbers they hold.
    assert check_step((observation, np.float32(0.5), np.bool_(False))) == (observation, 0.5, False)
    assert check_step((None, np.int64(1), np.bool_(True))) == (None, 1.0, True)
    messages, reward, done = check_step((None, np.float64(0.25), True))
    assert (reward, done) == (0.25, True) and type(reward) is float and type(done) is bool
    # What is not a number still is not: an array of several values, a bool reward, NaN.
    for bad in ((None, np.array([1.0, 2.0]), True), (None, np.bool_(True), True), (None, np.float32("nan"), True)):
        with pytest.raises(Exception, match="step's reward must be a finite number or None"):
            check_step(bad)
    with pytest.raises(Exception, match="step's done must be True or False"):
        check_step((None, 1.0, np.array([True, False])))


def test_the_environment_failure_line_cuts_the_row_between_words() -> None:
    row = {"question": "How many clips did Natalia sell altogether in April and May this year?", "id": 7}
    with pytest.raises(EnvironmentFailed) as excinfo:
        check_error("task.environment", "stop", "raised ValueError: x", row)
    line = str(excinfo.value)
    # the question is shown up to a whole word, then "...": 'How many clips did Natalia sell...'
    shown = line.split("question=", 1)[1].split(", id=")[0]
    assert shown.endswith("...") and row["question"].startswith(shown.removesuffix("...").removeprefix("'"))
    assert row["question"][len(shown.removesuffix("...").removeprefix("'"))] == " "  # the cut falls on a space
    assert "id=7" in line and len(shown) <= 43


# The same counter with async methods (TRL's and OpenRLHF's environments may be written so).
ASYNC_COUNTER = """
import asyncio

class AsyncCounter:
    async def reset(self, row):
        await asyncio.sleep(0)
        self.count, self.turns = 0, row["turns"]
        return [{"role": "user", "content": "count"}]

    async def step(self, messages):
        await asyncio.sleep(0)
        self.count += 1
        return [{"role": "user", "content": str(self.count)}], float(self.count), self.count >= self.turns

    async def close(self):
        await asyncio.sleep(0)
"""


@pytest.mark.parametrize("n_workers", [1, 0])
def test_an_environments_async_methods_are_awaited_where_they_run(tmp_path: Path, n_workers: int) -> None:
    (tmp_path / "async_counter.py").write_text(textwrap.dedent(ASYNC_COUNTER))
    runner = EnvironmentRunner("task.environment", "async_counter.py:AsyncCounter", tmp_path, n_workers, 30)
    try:
        (session,) = runner.reset([{"turns": 2}])
        assert session.error is None and session.opening == [{"role": "user", "content": "count"}]
        (first,) = runner.step([session], [conversation(session.opening, "one")])
        (second,) = runner.step([session], [conversation(session.opening, "one", "two")])
        assert (first.reward, first.done, second.reward, second.done) == (1.0, False, 2.0, True)
        runner.close([session])
    finally:
        runner.shutdown()
