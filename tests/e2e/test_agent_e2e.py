"""task.agent through grpo-run (docs/multi-turn.md#agents): an OpenAI-client agent loop of a few lines, in the
user's folder, is checked by job=check_reward against its own scoring of scripted replies, then trains for 2 steps
on the tiny random model, its episodes the agent's conversations."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.conftest import episodes_of, read_metrics, run_grpo, train_to_the_end

# The user's agent: asks, and when the reply lacks the answer says so once and asks again; its reward is its own
# judgement (1 when a reply holds the row's answer), which task.rewards.brevity judges beside it.
AGENT = """
from openai import OpenAI

def solve(row, prompt, base_url, api_key):
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(prompt)
    for attempt in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
        text = reply.choices[0].message.content or ""
        if row["answer"] in text:
            return 1.0
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "No. Try again."}]
    return 0.0
"""
# brevity: 1 / the episode's messages after the prompt; parity: a reward the random model's replies differ in.
REWARDS = (
    "def brevity(completions, **kwargs):\n    return [1.0 / len(c) for c in completions]\n"
    "def parity(completions, **kwargs):\n    return [float(len(c[-1]['content']) % 2) for c in completions]\n"
)


def user_folder(folder: Path) -> None:
    (folder / "my_agent.py").write_text(textwrap.dedent(AGENT))
    (folder / "my_rewards.py").write_text(REWARDS)
    prompt = [{"role": "user", "content": "What is 2 + 2?"}]
    rows = [{"prompt": prompt, "answer": "4", "id": i} for i in range(8)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cases = [  # the agent's own scoring of these replies: env 1 (found at once), 1 (second try), 0 (never)
        {"turns": ["It is 4."], "expected": {"env": 1.0, "brevity": 1.0}, "answer": "4", "prompt": prompt},
        {"turns": ["It is 5.", "Then 4."], "expected": {"env": 1.0, "brevity": 1 / 3}, "answer": "4", "prompt": prompt},
        {"turns": ["5", "6"], "expected": {"env": 0.0}, "answer": "4", "prompt": prompt},
    ]
    (folder / "cases.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cases))


ARGS = [
    "task=custom",
    "task.train_path=train.jsonl",
    "task.agent=my_agent.py:solve",
    "+task.rewards.brevity=my_rewards.py:brevity",
]


def test_check_reward_plays_the_agent_against_scripted_replies(tmp_path: Path) -> None:
    user_folder(tmp_path)
    result = run_grpo(
        ["job=check_reward", *ARGS, "task.cases_path=cases.jsonl", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "all 3 cases agree" in result.stdout
    # The transcript is the agent's conversation, its second call answered with the case's second turn.
    assert "assistant: It is 5.\n  user: No. Try again.\n  assistant: Then 4.\n  ended: done" in result.stdout
    wrong = tmp_path / "wrong.jsonl"
    case = {"turns": ["5"], "expected": {"env": 1.0}, "answer": "4", "prompt": [{"role": "user", "content": "2+2?"}]}
    wrong.write_text(json.dumps(case) + "\n")
    result = run_grpo(
        ["job=check_reward", *ARGS, f"task.cases_path={wrong}", f"hydra.run.dir={tmp_path / 'run2'}"],
        cwd=tmp_path,
        timeout=180,
    )
    assert result.returncode == 2 and "1 of 1 reward sanity cases" in result.stderr, result.stderr[-2000:]


@pytest.mark.slow
def test_an_openai_client_agent_trains_for_two_steps(tmp_path: Path) -> None:
    user_folder(tmp_path)
    run_dir = tmp_path / "run"
    args = [
        "debug=smoke",
        *ARGS,
        "+task.rewards.parity=my_rewards.py:parity",
        "task.eval_path=train.jsonl",
        "rollout.max_tokens=8",
        "model.mixed_precision=no",
        "train.eval_every=0",
    ]
    rows = train_to_the_end(args, tmp_path, run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all("train/reward/env" in r and "train/reward/parity" in r for r in rows)
    assert all(1 <= r["train/turns"] <= 2 and r["train/rewritten_turns"] == 0 for r in rows)
    assert any(r["train/grad_norm"] > 0 for r in rows)
    episodes = episodes_of(run_dir, 1)
    assert episodes and all(e["messages"][0]["content"] == "What is 2 + 2?" for e in episodes)
    assert all(e["messages"][-1]["role"] == "assistant" for e in episodes)


@pytest.mark.slow
@pytest.mark.vllm
def test_the_agent_trains_through_vllms_own_openai_server(tmp_path: Path) -> None:
    """rollout=vllm rollout.openai_server=vllm: the same agent, unchanged, answered by vLLM's own server (AsyncLLM
    in its own process, weights synced through a file and probed after each push)."""
    pytest.importorskip("vllm")
    user_folder(tmp_path)
    run_dir = tmp_path / "run"
    args = [
        "debug=smoke",
        *ARGS,
        "task.eval_path=train.jsonl",
        "rollout=vllm",
        "rollout.openai_server=vllm",
        "rollout.sync_probe_every=1",
        "rollout.max_tokens=8",
        "model.mixed_precision=no",
        "train.eval_every=0",
    ]
    result = run_grpo([*args, f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    # The run's console stays the run's: its step lines (vLLM's server once set the root logger to ERROR at import)
    # and none of the front's in-process requests to vLLM's app (httpx logs each at INFO) or vLLM's progress bars.
    console = result.stdout + result.stderr
    assert "step    2" in console and "http://vllm/" not in console, console[-3000:]
    assert "Loading safetensors checkpoint shards" not in console  # the file reloaded at every sync
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in row]
    assert [r["step"] for r in rows] == [1, 2]
    assert all("train/reward/env" in r and 1 <= r["train/turns"] <= 2 for r in rows)
    assert all(r["sync/logprob_max_diff"] < 1e-3 for r in rows)  # the file-synced weights are the policy's
    assert any(r["train/grad_norm"] > 0 for r in rows)
    episodes = episodes_of(run_dir, 1)  # the agent's conversation, as it sent it to vLLM
    assert episodes and all(e["messages"][0] == {"role": "user", "content": "What is 2 + 2?"} for e in episodes)
    assert all(e["messages"][-1]["role"] == "assistant" for e in episodes)
