"""task.environment_factory (TRL 1.16's environment convention, episodes/adapters/trl.py) on TRL's own files,
copied unchanged into tests/fixtures/peers/trl/: its 2048 example and its docs' environment classes. The expected
numbers come from calling TRL's classes and reward functions directly on the same actions, as GRPOTrainer does."""

from __future__ import annotations

import io
import json
import random
import sys
import textwrap
from pathlib import Path

import pytest
from rich.console import Console

from grpo_cli.episodes.adapters.trl import TRLEnvironment, load_environments, tool_methods
from grpo_cli.episodes.config import validate_multiturn
from grpo_cli.errors import UserFacingError
from grpo_cli.jobs.check_reward import run as check_reward
from grpo_cli.tasks.custom import CustomTaskConfig, absolutize_paths
from tests.conftest import REPO_ROOT, compose_config

PEERS = REPO_ROOT / "tests" / "fixtures" / "peers" / "trl"
SEED = 1234


def call(name: str, **arguments: object) -> str:
    """An assistant turn calling one tool, in the hermes format the default tool prompt teaches."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def trl_module(name: str):
    """TRL's own file, imported as itself (the same code the adapter loads)."""
    sys.path.insert(0, str(PEERS))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(PEERS))


def run_check_reward(tmp_path: Path, cases: list[dict], **task: object) -> str:
    (tmp_path / "cases.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cases))
    (tmp_path / "train.jsonl").write_text(json.dumps({k: v for k, v in cases[0].items() if k not in CASE_KEYS}) + "\n")
    cfg_task = CustomTaskConfig(
        name="custom", train_path="train.jsonl", eval_path="train.jsonl", cases_path="cases.jsonl", **task
    )  # type: ignore[arg-type]
    cfg_task.reward_workers = 0  # the instances in this process: random seeded here drives TRL's and ours alike
    cfg_task.max_turns = 8
    absolutize_paths(cfg_task, tmp_path)
    cfg = compose_config(["job=check_reward", "task=custom", f"task.base_dir={tmp_path}"])
    cfg.task = cfg_task
    out = Console(file=io.StringIO(), width=240, highlight=False)
    random.seed(SEED)
    try:
        assert check_reward(cfg, tmp_path, out) == {"n": len(cases), "n_disagree": 0}
    except UserFacingError as error:  # the table and transcripts say where
        raise AssertionError(out.file.getvalue()) from error
    return out.file.getvalue()


CASE_KEYS = ("turns", "expected", "why")


def test_trls_2048_example_scores_as_trls_own_code(tmp_path: Path) -> None:
    game = trl_module("grpo_2048")
    scripts = [
        ["left", "up", "right", "down", "left"],
        ["up", "up", "sideways"],  # an unknown direction: the board stays, as in TRL
        [],
    ]
    # TRL's scoring of the same actions: one pooled instance, reset per rollout, moves as tool calls, then its
    # reward function on the instances (GRPOTrainer: reward_kwargs["environments"]).
    random.seed(SEED)
    env = game.Game2048Env()
    expected, feedback = [], []
    for moves in scripts:
        env.reset(prompt=[{"role": "user", "content": game.PROMPT}])
        feedback += [" ".join(env.move(direction).split()) for direction in moves]
        expected.append(game.reward_score(environments=[env])[0])
    assert len(set(expected)) > 1, "the scripts must score differently for the check to mean anything"
    prompt = [{"role": "user", "content": game.PROMPT}]
    cases = [
        {"prompt": prompt, "turns": [*(call("move", direction=d) for d in moves), "Done."], "expected": value,
         "why": "TRL's Game2048Env and reward_score on these moves"}
        for moves, value in zip(scripts, expected, strict=True)
    ]  # fmt: skip
    text = run_check_reward(
        tmp_path, cases, environment_factory=str(PEERS / "grpo_2048.py") + ":Game2048Env",
        rewards={"score": str(PEERS / "grpo_2048.py") + ":reward_score"},
    )  # fmt: skip
    # The model read TRL's own feedback after each move (the transcript shows each tool message on one line).
    assert text.count("tool: ") == len(feedback) and all(f"tool: {line}\n" in text for line in feedback)
    # The opening is TRL's: the prompt's last message with reset's string appended, no separator.
    random.seed(SEED)
    observation = game.Game2048Env().reset()
    random.seed(SEED)
    adapter = TRLEnvironment(json.dumps({"": str(PEERS / "grpo_2048.py:Game2048Env")}))
    assert adapter.reset({"prompt": prompt}) == [{"role": "user", "content": game.PROMPT + observation}]


def test_the_docs_increment_env_owns_its_reward_through_get_reward(tmp_path: Path) -> None:
    docs = trl_module("docs_increment_env")
    random.seed(SEED)  # the targets reset will self-sample: scripts that reach them, overshoot, or fall short
    targets = [random.randint(1, 6) for _ in range(4)]
    steps = [[1] * targets[0], [targets[1] + 1], [targets[2]], [targets[3], 1, -1]]
    random.seed(SEED)
    env, expected = docs.IncrementEnv(), []
    for amounts in steps:
        env.reset()
        for amount in amounts:
            env.increment(amount)
        expected.append(env.get_reward())
    assert set(expected) == {0.0, 1.0}, "scripts that win and lose"
    empty = [{"role": "user", "content": ""}]
    cases = [
        {"prompt": empty, "turns": [*(call("increment", step=a) for a in amounts), "Done."], "expected": {"env": e},
         "why": "TRL's IncrementEnv.get_reward after these increments"}
        for amounts, e in zip(steps, expected, strict=True)
    ]  # fmt: skip
    text = run_check_reward(tmp_path, cases, environment_factory=str(PEERS / "docs_increment_env.py:IncrementEnv"))
    # The counter is each call's result, as TRL's tool message gives it (str of the int).
    assert all(f"tool: {i}\n" in text for i in range(1, targets[0] + 1))


def test_a_dict_of_factories_routes_by_the_environment_column_and_shows_its_tools() -> None:
    docs = trl_module("docs_multiple_environments")
    factories = {"coding": f"{PEERS}/docs_multiple_environments.py:CodingEnv",
                 "game": f"{PEERS}/docs_multiple_environments.py:GameEnv"}  # fmt: skip
    loaded = load_environments(factories, PEERS)
    assert set(loaded.tools) == set(tool_methods(docs.CodingEnv)) | set(tool_methods(docs.GameEnv))
    assert loaded.schemas["game"]["move"]["function"]["parameters"]["required"] == ["action"]
    env = TRLEnvironment(json.dumps(factories))
    opening = env.reset({"environment": "game", "prompt": [{"role": "user", "content": "Go. "}]})
    assert opening == [{"role": "user", "content": "Go. " + docs.GameEnv().reset()}]
    messages, reward, done = env.step([*opening, {"role": "assistant", "content": call("move", action="up")}])
    # GameEnv.move's body is the docs' `...`: it returns None, and TRL's tool message is str(None)
    assert (messages, reward, done) == ([{"role": "tool", "name": "move", "content": "None"}], None, False)
    # the coding environment's tool is not this episode's: an unknown tool, read back by the model
    messages, _, _ = env.step([*opening, {"role": "assistant", "content": call("run_code", code="1")}])
    assert messages is not None and "no tool named 'run_code'" in messages[0]["content"]
    with pytest.raises(Exception, match="environment='chess', which is not among"):
        TRLEnvironment(json.dumps(factories)).reset({"environment": "chess", "prompt": "x"})


ASYNC_ENV = """
import asyncio

class Counter:
    constructed = 0

    def __init__(self):
        Counter.constructed += 1

    async def reset(self, start, **kwargs):
        await asyncio.sleep(0)
        self.value = start
        return None

    async def add(self, n: int) -> int:
        '''Add to the counter.

        Args:
            n: How much.
        '''
        self.value += n
        return self.value

    def fails(self) -> str:
        '''Always raises.'''
        raise RuntimeError("no luck")

    async def get_reward(self):
        return float(self.value)

    def _hidden(self) -> None:
        pass
"""


def test_async_methods_are_awaited_errors_read_as_trls_and_instances_are_pooled(tmp_path: Path) -> None:
    (tmp_path / "counter.py").write_text(textwrap.dedent(ASYNC_ENV))
    spec = json.dumps({"": str(tmp_path / "counter.py:Counter")})
    first, second = TRLEnvironment(spec, max_turns=3), TRLEnvironment(spec, max_turns=3)
    row = {"prompt": [{"role": "user", "content": "Count."}], "start": 5}
    assert first.reset(row) == [{"role": "user", "content": "Count."}]  # reset returned None: the prompt as it is
    second.reset(row)
    assert first.instance is not second.instance  # two at once: two instances
    turn = {"role": "assistant", "content": call("add", n=2) + call("fails")}
    messages, _, done = first.step([*row["prompt"], turn])
    assert messages == [
        {"role": "tool", "name": "add", "content": "7"},
        {"role": "tool", "name": "fails", "content": "{'error': 'no luck'}"},  # TRL's {"error": str(e)}
    ]
    assert not done
    # the turn that reaches max_turns ends the episode without running its calls (TRL's last iteration)
    last = [*row["prompt"], turn, *messages, turn, *messages, turn]
    assert first.step(last) == (None, None, True)
    held = first.instance
    result = first.close()
    assert result is not None and result.reward == 7.0 and not result.errors  # async get_reward, awaited
    third = TRLEnvironment(spec)
    third.reset({**row, "start": 1})
    assert third.instance is held  # reused from the pool, reset, not constructed again
    assert type(held).constructed == 2
    assert set(tool_methods(type(held))) == {"add", "fails"}


def test_environment_factory_is_checked_before_the_model_loads(tmp_path: Path) -> None:
    (tmp_path / "counter.py").write_text(textwrap.dedent(ASYNC_ENV))
    (tmp_path / "bad.py").write_text("class NoReset:\n    def go(self) -> None:\n        '''Go.'''\n")
    (tmp_path / "r.py").write_text("def by_env(environments, **kwargs):\n    return [0.0 for _ in environments]\n")
    counter = str(tmp_path / "counter.py:Counter")

    def check(**values: object) -> str:
        task = CustomTaskConfig(name="custom", train_path="t.jsonl", **values)  # type: ignore[arg-type]
        with pytest.raises(UserFacingError) as error:
            validate_multiturn(task)
        assert "\n" not in str(error.value)
        return str(error.value)

    assert "task.environment_factory and task.environment together" in check(
        environment_factory=counter, environment=counter
    )
    assert "task.environment_factory and task.tools together" in check(
        environment_factory=counter, tools={"t": "grpo_cli.episodes.builtin_tools:calculator"}
    )
    assert "NoReset has no reset method" in check(environment_factory=str(tmp_path / "bad.py:NoReset"))
    # the docs' second IncrementEnv leaves out increment's docstring ("see the full docstring above")
    (tmp_path / "nodoc.py").write_text(
        "class E:\n    def reset(self, **kw):\n        pass\n\n    def go(self, n: int):\n        return n\n"
    )
    assert "task.environment_factory method go" in check(environment_factory=str(tmp_path / "nodoc.py:E"))
    assert "takes environments=, which only task.environment_factory gives" in check(
        rewards={"by_env": str(tmp_path / "r.py:by_env")}, environment=counter
    )
