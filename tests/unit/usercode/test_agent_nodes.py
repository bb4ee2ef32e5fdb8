"""task.agent as a Hydra node (`{_target_: <factory>, <its arguments>}`, as task.rewards' nodes): read as plain data,
its file reference made absolute, checked at preflight (the function the factory returns), and run in a worker
process of an AgentRun, the factory called there once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_cli.episodes.config import validate_multiturn
from grpo_cli.errors import UserFacingError
from grpo_cli.rollout.agent_run import agent_settings
from grpo_cli.tasks.multiturn import absolutize_multiturn_paths, agent_value
from grpo_cli.usercode.agents import load_agent
from tests.conftest import compose_config

FACTORY = """
import itertools


def make(answer):
    calls = itertools.count()

    def agent(row, client):
        earlier = next(calls)  # this process's earlier calls of this agent (next() on a count is atomic)
        client.chat.completions.create(model="policy", messages=row["prompt"], max_tokens=1)
        return float(row["answer"] == answer) + 10 * earlier
    return agent

def make_unreachable():
    def agent(row):
        return 1.0
    return agent
"""


class OneToken:
    """An engine whose every reply is one token."""

    context_length = None

    def generate(self, prompt_ids, settings):
        from grpo_cli.engines.base import RolloutBatch

        rows = [list(ids) for ids in prompt_ids for _ in range(settings.n)]
        return RolloutBatch(rows, [[0] for _ in rows], ["" for _ in rows], [True for _ in rows])


def configured(tmp_path: Path, node: str):
    (tmp_path / "factories.py").write_text(FACTORY)
    rows = [{"prompt": [{"role": "user", "content": "2+2?"}], "answer": answer} for answer in ("4", "5")]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return compose_config(["task=custom", f"task.train_path={tmp_path / 'train.jsonl'}", f"task.agent={node}"])


def test_an_agent_node_is_plain_data_made_absolute_and_loaded(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = configured(tmp_path, "{_target_: factories.py:make, answer: '4'}")
    assert agent_value(cfg.task) == {"_target_": "factories.py:make", "answer": "4"}
    absolutize_multiturn_paths(cfg.task, tmp_path)
    spec = agent_value(cfg.task)
    assert spec == {"_target_": f"{tmp_path / 'factories.py'}:make", "answer": "4"}
    validate_multiturn(cfg.task)
    agent = load_agent(spec, tmp_path)
    assert callable(agent)
    assert agent_settings(cfg).reference == spec  # what the worker processes load


def test_an_agent_node_whose_function_cannot_reach_the_model_is_one_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = configured(tmp_path, "{_target_: factories.py:make_unreachable}")
    with pytest.raises(UserFacingError, match=r"task.agent=\{_target_: factories.py:make_unreachable\}: it takes none"):
        validate_multiturn(cfg.task)


def test_an_agent_node_runs_in_a_worker_process(tmp_path: Path, monkeypatch) -> None:
    from grpo_cli.models import TINY_RANDOM, load_tokenizer
    from grpo_cli.rollout import SamplingSettings
    from grpo_cli.rollout.agent_run import AgentRun
    from grpo_cli.tasks.base import Example

    monkeypatch.chdir(tmp_path)
    cfg = configured(tmp_path, "{_target_: factories.py:make, answer: '4'}")
    absolutize_multiturn_paths(cfg.task, tmp_path)
    cfg.task.reward_workers = 1
    run = AgentRun(agent_settings(cfg), load_tokenizer(TINY_RANDOM), lambda *a, **k: None)
    examples = [Example([{"role": "user", "content": "2+2?"}], {"answer": a}) for a in ("4", "5")]
    try:
        first = run.sample(OneToken(), SamplingSettings(n=1), examples)
        second = run.sample(OneToken(), SamplingSettings(n=1), examples[:1])
    finally:
        run.close()
    # The worker called the factory once: its agent counts the calls of both batches.
    assert sorted(e.step_reward for e in first.episodes) in ([0.0, 11.0], [1.0, 10.0])
    assert [e.step_reward for e in second.episodes] == [21.0]
