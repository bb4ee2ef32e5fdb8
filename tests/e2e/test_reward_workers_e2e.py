"""The grpo-run end-to-end half of tests/unit/usercode/test_reward_workers.py: grpo-run as a subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import OFFLINE_ENV
from tests.e2e.test_custom_task_e2e import experiment_folder
from tests.unit.tasks.test_custom_task import write


def start_grpo(args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, **OFFLINE_ENV}
    exe = os.path.join(os.path.dirname(sys.executable), "grpo-run")
    command = [exe] if os.path.exists(exe) else [sys.executable, "-m", "grpo_cli.cli"]
    return subprocess.Popen(
        [*command, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


STUCK_PY = """
import time
from pathlib import Path

calls = []

def reward(completions, **kwargs):
    calls.append(1)
    if len(calls) == 3:  # eval at step 0, step 1, then step 2's batch: stuck in C
        (Path(__file__).parent / "stuck.flag").touch()
        time.sleep(600)
    return [1.0 for _ in completions]
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("timeout_s", "code", "said"),
    [
        ("3", 2, "stuck.py:reward ran past task.reward_timeout_s=3s on a batch of 4"),
        ("0", 143, "stopped by SIGTERM during step 2: reward task.rewards.stuck="),
    ],
    ids=["at_the_time_limit", "no_time_limit_after_the_grace"],
)
def test_sigterm_while_a_reward_is_stuck_ends_the_run_keeping_the_last_checkpoint(tmp_path, timeout_s, code, said):
    folder = experiment_folder(tmp_path)
    write(folder, {"stuck.py": STUCK_PY})
    run = start_grpo(
        [
            "--config-dir",
            "conf",
            "experiment=reviews_smoke",
            "train.steps=3",
            "train.eval_every=0",
            "train.checkpoint_every=1",
            "+task.rewards.stuck=stuck.py:reward",
            f"task.reward_timeout_s={timeout_s}",
            "output_dir=run",
        ],
        cwd=folder,
    )
    try:
        deadline = time.monotonic() + 400
        while not (folder / "stuck.flag").exists():
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
            time.sleep(0.2)
        run.send_signal(signal.SIGTERM)
        stdout, stderr = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == code, stderr[-3000:]
    line = stderr.strip().splitlines()[-1]
    assert said in line, line
    checkpoints = sorted(p.name for p in (folder / "run" / "checkpoints").iterdir())
    assert checkpoints == ["step_000001"] and (folder / "run" / "checkpoints" / "step_000001" / "COMPLETE").is_file()
