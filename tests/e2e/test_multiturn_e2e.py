"""Multi-turn episodes through grpo-run (docs/multi-turn.md#training-and-evaluating-on-episodes): a user's own
environment in a file of theirs, trained under data parallelism and the Ray sync strategies, with the transcripts
and the episode metrics in the run directory, and in a sweep. Tiny random model, 1-2 steps each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_cli.tracking import read_metrics
from tests.conftest import REPO_ROOT, run_grpo
from tests.unit.distributed.test_distributed import free_port

# Rewards a random model's turns differ in (the parity of a turn's length in characters), so groups have signal
# and gradients are not 0; the episode ends after the second turn.
ENVIRONMENT = """
class Parity:
    def step(self, messages):
        turn = messages[-1]["content"]
        done = sum(m["role"] == "assistant" for m in messages) >= 2
        return [{"role": "user", "content": "Again."}], float(len(turn) % 2), done
"""
EPISODE_METRICS = ("train/turns", "train/env_tokens", "train/truncated_episodes", "train/reward/env")


def episode_args(tmp_path: Path, *extra: str) -> list[str]:
    """A tiny multi-turn run's overrides: the Parity environment (written into tmp_path), no evaluation."""
    (tmp_path / "parity_env.py").write_text(ENVIRONMENT)
    return [
        "debug=smoke",
        "task=guess_number",
        f"task.environment={tmp_path / 'parity_env.py'}:Parity",
        "task.max_turns=3",
        "task.n_eval=2",
        "rollout.max_tokens=6",
        "model.mixed_precision=no",
        "train.eval_every=0",
        *extra,
    ]


def run(tmp_path: Path, name: str, *extra: str) -> Path:
    run_dir = tmp_path / name
    args = [*episode_args(tmp_path, *extra), f"hydra.run.dir={run_dir}"]
    result = run_grpo(args, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def train_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r]


def episodes_of(run_dir: Path, step: int) -> list[dict]:
    lines = (run_dir / "episodes" / f"step_{step:05d}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.slow
@pytest.mark.machine_wide
def test_episodes_train_alike_in_one_process_and_on_two_ddp_ranks(tmp_path) -> None:
    single = run(tmp_path, "single", "train.steps=1")
    ddp = run(tmp_path, "ddp", "train.steps=1", "distributed=ddp", f"distributed.master_port={free_port()}")
    (one,), (two,) = train_rows(single), train_rows(ddp)
    for key in ("train/reward", "train/loss", "train/grad_norm", *EPISODE_METRICS):
        assert two[key] == pytest.approx(one[key], rel=1e-3, abs=1e-6), key
    assert one["train/grad_norm"] > 0 and one["train/turns"] > 1  # episodes of several turns, with signal
    episodes = episodes_of(single, 1)
    assert len(episodes) == 4 and all(e["turns"] == 2 and e["stop_reason"] == "done" for e in episodes)
    for episode in episodes:  # the env component is the summed step rewards, as the environment gives them
        turns = [m["content"] for m in episode["messages"] if m["role"] == "assistant"]
        assert episode["rewards"]["reward/env"] == sum(len(t) % 2 for t in turns)
    # Each rank's share: the main rank logs its own two episodes, the first two of the one-process step.
    assert [e["messages"] for e in episodes_of(ddp, 1)] == [e["messages"] for e in episodes[:2]]
    evaluated = [json.loads(line) for line in (single / "eval" / "step_00001.jsonl").read_text().splitlines()]
    assert len(evaluated) == 2 and all(r["turns"] == len(r["messages"]) // 2 for r in evaluated)


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["one_behind", "replay_buffer", "async"])
def test_episodes_train_under_the_ray_sync_strategies(tmp_path, ray_installed, sync) -> None:
    run_dir = run(tmp_path, sync, f"sync={sync}", "loss=grpo_clip", "train.steps=2")
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    # A step's episode metrics and transcripts are those of the batches that arrived in it (docs/sync.md): every
    # step under one_behind and async; under replay_buffer the first step (it waits for a batch) and any later step
    # a batch arrived in, while a step that trained on the buffer alone has none (how fast the generator is decides).
    arrived = [sync != "replay_buffer" or r["step"] == 1 or r["sync/new_batches"] > 0 for r in rows]
    assert arrived[0]
    for row, has_episodes in zip(rows, arrived, strict=True):
        assert (set(EPISODE_METRICS) <= row.keys() and row["train/turns"] > 1) == has_episodes, row
        assert (run_dir / "episodes" / f"step_{row['step']:05d}.jsonl").exists() == has_episodes
        assert not has_episodes or episodes_of(run_dir, row["step"])


@pytest.mark.slow
def test_a_sweep_runs_each_jobs_episodes(tmp_path) -> None:
    (tmp_path / "parity_env.py").write_text(ENVIRONMENT)
    sweep_dir = tmp_path / "sweep"
    args = [
        "-m",
        "debug=smoke",
        "task=guess_number",
        f"task.environment={tmp_path / 'parity_env.py'}:Parity",
        "task.n_eval=2",
        "rollout.max_tokens=6",
        "train.steps=1",
        "train.eval_every=0",
        "seed=0,1",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    result = run_grpo(args, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = sorted(path.parent.parent for path in sweep_dir.glob("*/episodes/step_00001.jsonl"))
    assert len(jobs) == 2
    first, second = (episodes_of(job, 1) for job in jobs)
    assert len(first) == len(second) == 4 and first != second  # each job its own seed's episodes


def test_the_examples_own_environment_plays_its_cases_as_its_readme_says(tmp_path) -> None:
    # examples/multiturn_guess is a user's folder: its environment, data and task YAML, run with --config-dir.
    folder = REPO_ROOT / "examples" / "multiturn_guess"
    result = run_grpo(
        ["--config-dir", "conf", "task=guess8", "job=check_reward", f"hydra.run.dir={tmp_path / 'check'}"], cwd=folder
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "all 4 cases agree with task=custom's reward rule" in result.stdout
    assert "user: Higher." in result.stdout and "ended: max_turns (turn-limited)\n" in result.stdout
