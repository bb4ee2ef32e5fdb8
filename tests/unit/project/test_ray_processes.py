"""The no-Ray-left check of the Ray tests (tests/ray_processes.py): it sees the processes of the run under test and
no other, so another Ray on the machine cannot fail it and a process of the run left alive does."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests.ray_processes import (
    RUN_TAG,
    ProcessInfo,
    assert_no_ray_left,
    free_port,
    kill_run_processes,
    run_processes,
)

TAG = "/tmp/grpo-ray-abc123"
OTHER = "/tmp/ray"  # a developer's `ray start`, in Ray's default temp dir


def listing(*extra: ProcessInfo) -> list[ProcessInfo]:
    """Another Ray beside the run: every kind of its process, none tagged or under the run's dir."""
    session = f"{OTHER}/session_2026-12-06_10-00-00_000000_1"
    return [
        ProcessInfo(10, "S", f"gcs_server --log_dir={session}/logs", ("HOME=/root",), (f"{session}/logs/gcs.out",)),
        ProcessInfo(11, "S", f"raylet --temp_dir={OTHER}", ("HOME=/root",), ()),
        ProcessInfo(12, "S", "ray::DashboardAgent", (), (f"{session}/logs/dashboard_agent.log",)),
        ProcessInfo(13, "S", "ray::IDLE", ("RAY_TMPDIR=/tmp/other",), ("socket:[1234]",)),
        ProcessInfo(14, "S", "python -m grpo_cli.drivers.ray_reaper 9", (f"{RUN_TAG}=/tmp/grpo-ray-zzz",), ()),
        *extra,
    ]


def test_a_run_s_processes_are_found_by_tag_command_line_or_open_file_and_no_other():
    ours = [
        ProcessInfo(20, "S", "python -m grpo_cli.drivers.ray_reaper 19", ("A=1", f"{RUN_TAG}={TAG}"), ()),
        ProcessInfo(21, "S", f"raylet --temp_dir={TAG}", (), ()),
        # retitled by setproctitle, its environment written over: its open log file still names the session
        ProcessInfo(22, "S", "ray::DashboardAgent", ("",), (f"{TAG}/session_x/logs/dashboard_agent.log",)),
        ProcessInfo(23, "Z", f"raylet --temp_dir={TAG}", (), ()),  # a zombie is gone
        ProcessInfo(24, "S", "ray::IDLE", (), (f"{TAG}-other/file",)),  # a sibling dir's name is not ours
    ]
    assert run_processes(TAG, listing(*ours)) == {20, 21, 22}
    assert run_processes(TAG, listing()) == set()


def test_the_check_fails_on_a_process_of_the_run_left_alive_and_passes_beside_another_ray():
    leaked = ProcessInfo(30, "S", "ray::Hosted", (f"{RUN_TAG}={TAG}",), ())
    with pytest.raises(AssertionError, match="outlived the run: 30"):
        assert_no_ray_left(TAG, timeout_s=0, processes=lambda: listing(leaked))
    assert_no_ray_left(TAG, timeout_s=0, processes=listing)


@pytest.mark.slow
def test_a_real_ray_start_beside_the_run_passes_and_a_real_leak_fails(ray_installed):
    # Another Ray on this machine, started during the test (Ray's own CLI, its own temp dir, no tag), stays up
    # while the check runs; a process of the run (it inherits the tag) left alive fails it.
    other = tempfile.mkdtemp(prefix="grpo-ray-other-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k not in (RUN_TAG, "RAY_TMPDIR")}
    env[RUN_TAG] = other  # its own tag, so that this test can stop exactly it (never `ray stop`: every Ray)
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    head = [ray, "start", "--head", f"--port={free_port()}", "--num-cpus=1", "--include-dashboard=false"]
    try:
        started = subprocess.run(
            [*head, "--disable-usage-stats", f"--temp-dir={other}"], env=env, capture_output=True, text=True
        )
        assert started.returncode == 0, started.stderr[-2000:]
        assert run_processes(other), "the other Ray did not start"
        leak = subprocess.Popen(["bash", "-c", "exec -a ray::Leaked sleep 60"])  # inherits this test's tag
        try:
            time.sleep(0.2)
            assert run_processes(ray_installed) == {leak.pid}
            with pytest.raises(AssertionError, match=f"outlived the run: {leak.pid} "):
                assert_no_ray_left(timeout_s=1)
        finally:
            leak.send_signal(signal.SIGKILL)
            leak.wait()
        assert_no_ray_left(timeout_s=1)  # the other Ray is still up
        assert run_processes(other)
    finally:
        kill_run_processes(other)
        shutil.rmtree(other, ignore_errors=True)
