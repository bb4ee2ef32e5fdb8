"""sync=async through grpo-run, with Ray actors (docs/sync.md): the bound on every trained sample, kill -9 and
resume without a prompt skipped or trained twice, the lockstep schedule against one_behind's metrics.jsonl, drop's
counting, several generators, and no Ray process left."""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path

import pytest

from grpo_cli.tracking import read_metrics
from tests.conftest import run_grpo
from tests.e2e.test_multiturn_e2e import episode_args, episodes_of
from tests.e2e.test_reliability_e2e import start_grpo, wait_for
from tests.e2e.test_sync_strategies_e2e import MOVING_TASK
from tests.ray_processes import assert_no_ray_left
from tests.unit.drivers.test_sync_strategies import train_rows
from tests.unit.engines.test_vllm_engine import needs_vllm

ASYNC_KEYS = {
    "sync/lag",
    "sync/lag_mean",
    "sync/staleness_token_mean",
    "sync/partial_frac",
    "sync/version_span_mean",
    "sync/dropped_stale",
    "sync/wasted_row_frac",
    "time/generator_idle_s",
    "time/generator_paced_s",
    "time/update_pause_s",
    "time/recompute_s",
    "time/waiting_s",
}


def episode_run(tmp_path: Path, *extra: str) -> list[str]:
    return episode_args(tmp_path, "sync=async", "loss=grpo_clip", *extra)


def prompts_by_step(run_dir: Path, steps: int) -> dict[int, Counter]:
    """The opening user message of each episode trained at each step."""
    return {
        step: Counter(
            next(m["content"] for m in e["messages"] if m["role"] == "user") for e in episodes_of(run_dir, step)
        )
        for step in range(1, steps + 1)
    }


@pytest.mark.slow
def test_async_keeps_the_bound_and_resumes_after_kill_9_with_each_steps_prompts(tmp_path, ray_installed):
    args = episode_run(
        tmp_path, "sync.max_staleness=2", "sync.partial_rollouts=true", "train.steps=8", "train.checkpoint_every=2"
    )
    reference = tmp_path / "reference"
    result = run_grpo([*args, f"hydra.run.dir={reference}"], cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]

    killed = tmp_path / "killed"
    process = start_grpo([*args, f"hydra.run.dir={killed}"], cwd=tmp_path)
    wait_for(lambda: (killed / "checkpoints" / "step_000004" / "COMPLETE").exists(), timeout=600)
    process.send_signal(signal.SIGKILL)
    process.wait()
    resumed = run_grpo([f"resume={killed}", f"hydra.run.dir={tmp_path / 'resumer'}"], cwd=tmp_path, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    rows = train_rows(killed)
    assert [r["step"] for r in rows] == list(range(1, 9))
    for row in rows:
        assert ASYNC_KEYS <= row.keys()
        assert 0 <= row["sync/lag"] <= 2 and row["sync/policy_version"] >= row["step"] - 1 - 2
    # on_stale=wait trains each step on its own batch: the same prompts as the uninterrupted run, so none was
    # skipped or trained twice across the kill (the batches in flight were sampled again after the resume).
    assert prompts_by_step(killed, 8) == prompts_by_step(reference, 8)
    assert_no_ray_left()


# The keys whose values depend on timing rather than on what was trained.
TIMED = ("time/", "throughput/", "perf/")


@pytest.mark.slow
def test_lockstep_async_at_k_1_with_the_behaviour_policy_as_proximal_trains_as_one_behind(tmp_path, ray_installed):
    common = ["debug=smoke", "model.mixed_precision=no", "loss=grpo_clip", *MOVING_TASK, "train.eval_every=3"]
    common += ["train.steps=5"]
    one_behind = tmp_path / "one_behind"
    lockstep = tmp_path / "lockstep"
    for run_dir, sync in (
        (one_behind, ["sync=one_behind"]),
        (lockstep, ["sync=async", "sync.max_staleness=1", "sync.lockstep=true", "sync.proximal=behaviour"]),
    ):
        result = run_grpo([*common, *sync, f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
    expected, got = read_metrics(one_behind / "metrics.jsonl"), read_metrics(lockstep / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    compared = 0
    for want, have in zip(expected, got, strict=True):
        shared = {k for k in want.keys() & have.keys() if not k.startswith(TIMED)}
        assert len(shared) > 5
        for key in shared:
            assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (want["step"], key)
            compared += 1
    assert compared > 100
    assert any(r.get("train/old_policy_kl", 0) != 0 for r in train_rows(lockstep))  # lag 1: the policy moved


@pytest.mark.slow
def test_drop_counts_stale_groups_and_two_generators_share_the_work(tmp_path, ray_installed):
    run_dir = tmp_path / "drop"
    args = [
        "debug=smoke",
        "model.mixed_precision=no",
        "loss=grpo_clip",
        # a reward that varies: a flat step trains nothing, so it has no train step's diagnostics to log
        "task=lipogram",
        "task.reward_weights.correctness=0",
        "task.reward_weights.answer=1",
        "sync=async",
        "sync.on_stale=drop",
        "sync.max_staleness=1",
        "sync.generators=2",
        "sync.partial_rollouts=true",
        "rollout.max_tokens=24",
        "train.steps=6",
        "train.eval_every=3",
        f"hydra.run.dir={run_dir}",
    ]
    result = run_grpo(args, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["sync/lag"] <= 1 for r in rows)
    totals = [r["sync/dropped_stale_total"] for r in rows]
    assert totals == sorted(totals) and totals[-1] == sum(r["sync/dropped_stale"] for r in rows)
    assert "2 generator" in result.stdout
    # Decoupled PPO with no correction: the default sync.behaviour_weight_cap acts, its share of tokens is logged on
    # every step that trains (a flat one computes no row) and shown in the end-of-run table (issue 57).
    trained = [r for r in rows if not r.get("train/flat_steps", 0)]
    assert trained and all(0.0 <= r["train/behaviour_capped_frac"] <= 1.0 for r in trained)
    assert "tokens over sync.behaviour_weight_cap" in result.stdout
    assert_no_ray_left()


@needs_vllm
@pytest.mark.vllm
@pytest.mark.slow
def test_async_on_vllm_continues_rows_across_updates_and_keeps_the_bound(tmp_path, ray_installed):
    """vLLM's step loop as the generator's stream (engines/vllm_stream.py), through grpo-run: a learner that sleeps
    less than generation takes, so updates land while rows run, and every sample keeps the bound."""
    run_dir = tmp_path / "vllm"
    args = [
        "debug=smoke",
        "model.mixed_precision=no",
        "rollout=vllm",
        "loss=grpo_clip",
        "sync=async",
        "sync.max_staleness=2",
        "sync.partial_rollouts=true",
        "sync.simulated_update_s=0.05",
        "rollout.max_tokens=48",
        "train.steps=6",
        "train.eval_every=3",
        f"hydra.run.dir={run_dir}",
    ]
    result = run_grpo(args, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "time/step_s" in r]  # no update: no train/loss
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(ASYNC_KEYS <= r.keys() and r["sync/lag"] <= 2 for r in rows)
    assert sum(r["sync/updates_mid_generation"] for r in rows) > 0
