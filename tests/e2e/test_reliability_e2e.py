"""The grpo-run end-to-end half of tests/unit/drivers/test_reliability.py: grpo-run as a subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_cli.learner.checkpoint import list_checkpoints, verify_checkpoint
from grpo_cli.tracking import read_metrics
from tests.conftest import OFFLINE_ENV, run_grpo

# A run long enough to be killed mid-way: 12 tiny steps (killed after step 6: 6 steps still to run, and to
# resume), a checkpoint every 2.
RUN = [
    "debug=smoke",
    "train.steps=12",
    "train.checkpoint_every=2",
    "train.keep_checkpoints=2",
    "train.eval_every=5",
    "optim.lr=1e-3",
    "rollout.max_tokens=16",
    "kl.monitor=true",
]


# Wall-clock figures differ between runs by nature; everything else must match.
TIMING_PREFIXES = ("time/", "throughput/")


def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)} for row in rows]


def start_grpo(args: list[str], cwd: Path) -> subprocess.Popen:
    exe = os.path.join(os.path.dirname(sys.executable), "grpo-run")
    return subprocess.Popen(
        [exe, *args],
        cwd=cwd,
        env={**os.environ, **OFFLINE_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(predicate, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.05)


@pytest.mark.slow
def test_sigkill_then_resume_matches_the_uninterrupted_run(tmp_path):
    reference = tmp_path / "reference"
    result = run_grpo([*RUN, f"hydra.run.dir={reference}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]

    killed = tmp_path / "killed"
    process = start_grpo([*RUN, f"hydra.run.dir={killed}"], cwd=tmp_path)
    wait_for(lambda: (killed / "checkpoints" / "step_000006" / "COMPLETE").exists())
    process.send_signal(signal.SIGKILL)
    process.wait()
    steps_before = [r["step"] for r in read_metrics(killed / "metrics.jsonl") if "train/loss" in r]
    assert 6 <= max(steps_before) < 12  # really killed mid-training

    resumed = run_grpo(["resume=" + str(killed), f"hydra.run.dir={tmp_path / 'resumer'}"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed" in resumed.stdout
    expected = comparable(read_metrics(reference / "metrics.jsonl"))
    got = comparable(read_metrics(killed / "metrics.jsonl"))
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for want, have in zip(expected, got, strict=True):
        assert have.keys() == want.keys()
        for key in want:
            assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (want["step"], key)
    # only the newest K checkpoints are kept
    assert [p.name for p in list_checkpoints(killed)] == ["step_000010", "step_000012"]


@pytest.mark.slow
def test_sigterm_stops_at_a_safe_point_with_a_checkpoint_and_the_resume_command(tmp_path):
    run_dir = tmp_path / "run"
    process = start_grpo([*RUN, "train.steps=200", "train.checkpoint_every=0", f"hydra.run.dir={run_dir}"], tmp_path)
    wait_for(
        lambda: (
            (run_dir / "metrics.jsonl").exists()
            and sum(1 for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "train/loss" in line) >= 2
        )
    )
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 143
    assert f"grpo-run resume={run_dir}" in stderr and "Traceback" not in stderr
    (checkpoint,) = list_checkpoints(run_dir)
    assert verify_checkpoint(checkpoint) is None
    last_step = max(r["step"] for r in read_metrics(run_dir / "metrics.jsonl"))
    assert checkpoint.name == f"step_{last_step:06d}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["optim.lrr=1e-5"], "Key 'lrr' not in 'OptimConfig'"),
        (["train.steps=ten"], "train.steps=ten"),
        (["loss=ppo"], "no such loss choice, use one of cispo, grpo_clip, gspo, no_baseline, reinforce_with_baseline"),
        (["resume=/no/such/run"], "resume=/no/such/run: no run with checkpoints there"),
    ],
)
def test_config_errors_are_one_line_with_exit_code_2(tmp_path, args, message):
    result = run_grpo(args, cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_unwritable_output_dir_and_malformed_data_fail_fast(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = run_grpo(["debug=smoke", f"hydra.run.dir={tmp_path / 'run'}", f"output_dir={blocker}/sub"], cwd=tmp_path)
    assert result.returncode == 2 and str(blocker) in result.stderr
    data = tmp_path / "eval.jsonl"
    data.write_text('{"question": "q", "ground_truth": ["a"]}\n{not json\n')
    result = run_grpo(["debug=smoke", f"hydra.run.dir={tmp_path / 'run2'}", f"task.eval_path={data}"], cwd=tmp_path)
    assert result.returncode == 2 and f"{data}:2" in result.stderr
