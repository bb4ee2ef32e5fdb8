"""The grpo-run end-to-end half of tests/unit/drivers/test_sync_strategies.py: grpo-run as a subprocess."""

from __future__ import annotations

import os
import signal

import pytest

from tests.conftest import run_grpo
from tests.e2e.test_reliability_e2e import start_grpo, wait_for
from tests.unit.drivers.test_sync_strategies import TIME_KEYS, train_rows

# A signal a random model can climb from its first step: lipogram's answer_reward is the share of words
# without an e, so groups differ, advantages are not 0 and the policy moves (ratios leave 1 when data lags).
MOVING_TASK = ["task=lipogram", "task.reward_weights.correctness=0", "task.reward_weights.answer=1", "optim.lr=1e-2"]


@pytest.mark.slow
def test_one_behind_overlaps_at_lag_at_most_1_and_resumes_after_sigterm(tmp_path, ray_installed):
    run_dir = tmp_path / "run"
    # fp32 on every CPU (mixed_precision=auto is bf16 on AVX-512 BF16 ones), so a ratio at lag 0 is 1 to 1e-6.
    args = [
        "debug=smoke",
        "model.mixed_precision=no",
        "sync=one_behind",
        "loss=grpo_clip",
        *MOVING_TASK,
        "train.eval_every=4",
        "train.steps=8",
    ]
    process = start_grpo([*args, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(train_rows(run_dir)) >= 3)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 143, stderr[-2000:]
    stopped_at = max(r["step"] for r in train_rows(run_dir))
    assert 3 <= stopped_at < 8

    resumed = run_grpo([f"resume={run_dir}", f"hydra.run.dir={tmp_path / 'resumer'}"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 9))
    for row in rows:
        assert TIME_KEYS <= row.keys() and 0.0 <= row["time/overlap_frac"] <= 1.0
        assert row["sync/lag"] <= 1
        assert row["sync/policy_version"] == row["step"] - 1 - row["sync/lag"]
    # The first step (and the first after the resume) has nothing prefetched: it trains at lag 0. Every other
    # batch was sampled while the learner trained on the one before it.
    lags = {r["step"]: r["sync/lag"] for r in rows}
    assert lags[1] == 0 and lags[stopped_at + 1] == 0
    assert all(lag == 1 for step, lag in lags.items() if step not in (1, stopped_at + 1))
    # grpo_clip's ratios use the generator's own log-probs: exactly 1 at lag 0, away from 1 at lag 1
    assert rows[0]["train/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert any(abs(r["train/old_policy_kl"]) > 1e-4 for r in rows if r["sync/lag"] == 1)
    assert all(r["time/old_log_probs_s"] > 0 for r in rows)


@pytest.mark.slow
def test_replay_buffer_never_trains_on_data_older_than_max_staleness(tmp_path, ray_installed):
    run_dir = tmp_path / "run"
    result = run_grpo(
        [
            "debug=smoke",
            "sync=replay_buffer",
            "loss=grpo_clip",
            *MOVING_TASK,
            "sync.buffer_size=8",
            "sync.max_staleness=1",
            "train.steps=8",
            "train.eval_every=0",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "time per step" in result.stdout and "generation hidden behind training" in result.stdout
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 9))
    for row in rows:
        assert row["sync/lag"] <= 1 and row["sync/lag_mean"] <= row["sync/lag"]
        assert row["sync/buffer_trajectories"] <= 8 and row["train/optimizer_steps"] == 1
    assert sum(r["sync/new_batches"] for r in rows) >= 2
    assert max(r["sync/lag"] for r in rows) == 1  # the generator ran ahead of the learner at least once


@pytest.mark.slow
def test_an_error_inside_an_actor_is_one_line_and_leaves_no_ray_process(tmp_path, ray_installed):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama", ')  # cut off mid-write
    (broken / "model.safetensors").write_bytes(b"not weights")
    result = run_grpo(
        ["debug=smoke", "sync=one_behind", "model=hf", f"model.name_or_path={broken}", f"hydra.run.dir={tmp_path}/r"],
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert "could not load model.name_or_path" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_missing_ray_stops_the_cli_with_one_line(tmp_path, monkeypatch):
    # A `ray` package that cannot be imported, first on the path: as if the extra were not installed.
    fake = tmp_path / "fake" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(fake.parent), os.environ.get("PYTHONPATH")])))
    result = run_grpo(["debug=smoke", "sync=one_behind", f"hydra.run.dir={tmp_path}/r"], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == 'grpo-run: error: sync=one_behind needs Ray: pip install -e ".[ray]"'


@pytest.mark.slow
def test_a_killed_run_leaves_no_ray_process(tmp_path, ray_installed):
    # SIGKILL gives the run no chance to shut Ray down: its sentinel (grpo_cli/drivers/ray_reaper.py) must.
    run_dir = tmp_path / "run"
    process = start_grpo(["debug=smoke", "sync=one_behind", "train.steps=200", f"hydra.run.dir={run_dir}"], tmp_path)
    wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(train_rows(run_dir)) >= 2)
    process.kill()
    process.communicate(timeout=60)
    # the ray_installed fixture then checks that every Ray process (and the sentinel) is gone within 20 s
