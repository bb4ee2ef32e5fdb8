"""TRL's own agent example trains through grpo-run (#42): its tool (query_biogrid) and its docs' sync and async
tools as task.tools, its three reward functions and its docs' async reward as task.rewards, copied unchanged into
tests/fixtures/peers/trl. Tiny random model, 2 steps; the transcripts are TRL's message shapes."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import episodes_of, train_to_the_end
from tests.unit.episodes.test_trl_peer import PEERS, PROMPT, biogrid_db


def test_trls_agent_example_trains_two_steps(tmp_path: Path) -> None:
    biogrid_db(tmp_path)  # the example's tool reads biogrid.db in the working directory
    rows = [{"prompt": PROMPT, "answer": ["yes", "no"][i % 2]} for i in range(4)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    agent, docs = PEERS / "grpo_agent.py", PEERS / "docs_tools.py"
    run_dir = tmp_path / "run"
    args = [
        "debug=smoke",
        "task=custom",
        "task.train_path=train.jsonl",
        "task.eval_path=train.jsonl",
        f"+task.tools.query_biogrid={agent}:query_biogrid",
        f"+task.tools.multiply={docs}:multiply",
        f"+task.tools.async_add={docs}:async_add",
        f"+task.rewards.correctness={agent}:correctness_reward",
        f"+task.rewards.structure={agent}:structure_reward",
        f"+task.rewards.query={agent}:query_reward",
        f"+task.rewards.async_nonempty={docs}:async_reward_func",
        "task.max_turns=2",
        "rollout.max_tokens=6",
        "model.mixed_precision=no",
        "train.steps=2",
        "train.eval_every=0",
    ]
    trained = train_to_the_end(args, tmp_path, run_dir)
    assert [r["step"] for r in trained] == [1, 2]
    episodes = episodes_of(run_dir, 2)
    for episode in episodes:  # each of TRL's rewards (and the docs' async one, awaited) scored every episode
        for key in ("correctness", "structure", "query", "async_nonempty"):
            assert isinstance(episode["rewards"][f"reward/{key}"], float), key
        for message in episode["messages"]:
            if message["role"] == "assistant" and "tool_calls" in message:
                assert all(c["type"] == "function" and "name" in c["function"] for c in message["tool_calls"])
