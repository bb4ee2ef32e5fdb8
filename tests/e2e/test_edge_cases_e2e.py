"""The edges of a run through grpo-run (issue 58): a run whose every episode is skipped says so at each step, takes
no optimizer step, and stops in one line after train.max_empty_steps such steps (it ended in an IndexError in
core/prompt_sharing.distinct_prompts before)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import read_metrics, run_grpo

# An agent that fails before it calls the model: under task.on_reward_error=skip each of its episodes is skipped.
FAILING_AGENT = "def solve(row, prompt, base_url, api_key):\n    raise RuntimeError('the agent always fails')\n"


def agent_task(folder: Path, agent: str, *extra: str) -> list[str]:
    """An agent task in `folder` (my_agent.py holding `agent`, eight chat rows in train.jsonl): the grpo-run
    overrides of a debug=smoke run of it, with `extra` after them."""
    (folder / "my_agent.py").write_text(agent)
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"} for _ in range(8)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = ["task=custom", "task.train_path=train.jsonl", "task.eval_path=train.jsonl", "task.agent=my_agent.py:solve"]
    return ["debug=smoke", *task, "rollout.max_tokens=8", "train.eval_every=0", *extra]


@pytest.mark.slow
def test_a_run_whose_every_episode_is_skipped_says_it_and_stops_in_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    extra = ["task.on_reward_error=skip", "train.steps=4", "train.max_empty_steps=2", f"hydra.run.dir={run_dir}"]
    args = agent_task(tmp_path, FAILING_AGENT, *extra)
    result = run_grpo(args, cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "internal error" not in result.stderr and "Traceback" not in result.stderr
    # Each empty step said in one line, then the stop in one line naming the key.
    notes = [line for line in result.stdout.splitlines() if "nothing to train in its update" in line]
    assert [note.split(":")[0] for note in notes] == ["step 1", "step 2"], result.stdout[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("grpo-run: error:")]
    assert len(errors) == 1 and "nothing to train in 2 consecutive steps" in errors[0], result.stderr[-2000:]
    assert "train.max_empty_steps" in errors[0] and f"resume={run_dir}" in errors[0]
    steps = [row for row in read_metrics(run_dir / "metrics.jsonl") if "train/empty_steps" in row]
    assert [row["step"] for row in steps] == [1, 2]
    assert all(row["train/empty_steps"] == 1 and row["train/optimizer_steps"] == 0 for row in steps)
    assert all(row["train/skipped_episodes"] == 1.0 for row in steps)


PARITY = "def parity(completions, **kwargs):\n    return [float(len(c) % 2) for c in completions]\n"


@pytest.mark.slow
def test_the_same_command_line_plus_resume_continues_a_custom_task_and_a_changed_file_is_named(tmp_path: Path) -> None:
    """The saved config holds the reward's resolved absolute path, the command line the relative one: compared as
    what they resolve to, they are the same; another file is refused naming task.rewards.p, not the whole task."""
    (tmp_path / "parity.py").write_text(PARITY)
    (tmp_path / "other.py").write_text(PARITY)
    rows = [{"prompt": f"Say a word #{i}", "answer": "x"} for i in range(8)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        "model=tiny_random",
        "train.rollout_batch_size=4",
        "train.group_size=2",
        "train.train_batch_size=4",
        "rollout.max_tokens=8",
        "task=custom",
        "task.train_path=train.jsonl",
        "task.eval_path=train.jsonl",
        "+task.rewards.p=parity.py:parity",
        "train.eval_every=0",
    ]
    run_dir = tmp_path / "run"
    first = run_grpo([*args, "train.steps=1", f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_grpo([*args, "train.steps=2", "resume=run", f"hydra.run.dir={tmp_path / 'r'}"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r] == [1, 2]
    changed = [a.replace("parity.py", "other.py") for a in args]
    refused = run_grpo([*changed, "train.steps=3", "resume=run", f"hydra.run.dir={tmp_path / 'r2'}"], cwd=tmp_path)
    line = refused.stderr.strip()
    assert refused.returncode == 2 and "\n" not in line, refused.stderr[-3000:]
    assert f"task.rewards.p cannot change on resume (the run continues with its saved task.rewards.p={tmp_path}" in line
    assert f"this command gives {tmp_path / 'other.py'}:parity" in line and "'n_train'" not in line


@pytest.mark.slow
def test_an_eval_prompt_past_the_context_is_refused_naming_its_set_and_row_on_every_job_that_evaluates(
    tmp_path: Path,
) -> None:
    """A held-out prompt longer than the model's context (tiny_random: 2048 tokens) was scored on an empty completion
    and counted wrong without a word; now job=baseline_eval (an eval set) and training (task.eval_path) refuse it
    in one line naming where it was read and its row (job=eval shares baseline_eval's evaluation)."""
    (tmp_path / "parity.py").write_text(PARITY)
    short = [{"prompt": f"Say a word #{i}", "answer": "x"} for i in range(4)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in short))
    long = [short[0], {"prompt": "word " * 2500, "answer": "x"}, short[1]]
    (tmp_path / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in long))
    task = ["model=tiny_random", "rollout.max_tokens=8", "task=custom", "task.train_path=train.jsonl"]
    task += ["+task.rewards.p=parity.py:parity"]
    baseline = run_grpo(
        ["job=baseline_eval", *task, "task.eval_path=train.jsonl", "+task.eval_sets.long=long.jsonl"],
        cwd=tmp_path,
        timeout=300,
    )
    training = run_grpo(["debug=smoke", *task, f"task.eval_path={tmp_path / 'long.jsonl'}"], cwd=tmp_path, timeout=300)
    for result, source in ((baseline, "task.eval_sets.long=long.jsonl"), (training, "task.eval_path=")):
        errors = [line for line in result.stderr.splitlines() if line.startswith("grpo-run: error:")]
        assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
        assert f"eval example 1 of {source}" in errors[0], errors[0]
        assert "is a 25" in errors[0] and "the model's context is 2048 tokens" in errors[0], errors[0]


# The OpenAI SDK's async pattern, as a user writes it: one AsyncOpenAI client kept for the worker's life (never
# closed) and, per episode, a throwaway one left for the garbage collector (whose aclose() then needs a live loop).
ASYNC_AGENT = """
from openai import AsyncOpenAI

_kept = {}


async def solve(row, prompt, base_url, api_key):
    client = _kept.get(base_url)
    if client is None:
        client = _kept[base_url] = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = await client.chat.completions.create(model="policy", messages=list(prompt), max_tokens=8)
    throwaway = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    again = await throwaway.chat.completions.create(model="policy", messages=list(prompt), max_tokens=4)
    text = (reply.choices[0].message.content or "") + (again.choices[0].message.content or "")
    return float(len(text) % 2)
"""


@pytest.mark.slow
def test_an_async_agent_keeping_an_asyncopenai_client_across_episodes_trains_with_a_clean_console(
    tmp_path: Path,
) -> None:
    """usercode/awaiting.resolved awaits every call on the process's one long-lived loop: a client made in one
    episode is used and garbage-collected on the loop that made it (a fresh asyncio.run loop per call ended each
    episode with "Task exception was never retrieved ... Event loop is closed" and a traceback)."""
    pytest.importorskip("openai")
    run_dir = tmp_path / "run"
    # Two steps: the client kept from the first step's episodes serves the second's (a third step added nothing).
    args = agent_task(tmp_path, ASYNC_AGENT, "train.steps=2", f"hydra.run.dir={run_dir}")
    result = run_grpo(args, cwd=tmp_path, timeout=400)
    console = result.stdout + result.stderr
    assert result.returncode == 0, console[-3000:]
    for noise in ("Task exception was never retrieved", "Event loop is closed", "Traceback", "unclosed event loop"):
        assert noise not in console, console[-3000:]
    steps = [row for row in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in row]
    assert [row["step"] for row in steps] == [1, 2]
    assert all(row["train/skipped_episodes"] == 0 for row in steps if "train/skipped_episodes" in row)
