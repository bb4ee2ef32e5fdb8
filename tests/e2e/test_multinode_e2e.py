"""The grpo-run end-to-end half of tests/unit/distributed/test_multinode.py: grpo-run as a subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import OFFLINE_ENV
from tests.e2e.test_distributed_e2e import COMPARED, train_rows
from tests.unit.distributed.test_distributed import free_port
from tests.unit.distributed.test_multinode import node_args

# torch.distributed ranks on a rendezvous port, a resource of the machine (tests/conftest.py, "Parallel workers")
pytestmark = pytest.mark.machine_wide


def start_node(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    exe = os.path.join(os.path.dirname(sys.executable), "grpo-run")
    with log.open("w") as out:  # files, not pipes: two processes at once must never block on a full pipe
        return subprocess.Popen([exe, *args], cwd=cwd, env={**os.environ, **OFFLINE_ENV}, stdout=out, stderr=out)


def wait_or_kill(process: subprocess.Popen, timeout: float) -> int | None:
    """The exit code, or None after killing a process still running at `timeout` (its ranks die with it)."""
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        return None


@pytest.mark.slow
def test_two_nodes_on_loopback_take_the_same_steps_as_one_process(tmp_path, one_process_rows):
    # Before the fix each node's launcher joined with its own random run id: both waited for each other forever.
    single = one_process_rows
    port, run_dir = free_port(), tmp_path / "nodes"  # one run directory, as on a shared file system
    nodes = [start_node(node_args(i, port, run_dir), tmp_path, tmp_path / f"node{i}.log") for i in (0, 1)]
    codes = [wait_or_kill(node, timeout=600) for node in nodes]
    logs = [(tmp_path / f"node{i}.log").read_text()[-2000:] for i in (0, 1)]
    assert codes == [0, 0], (codes, logs)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]  # each step logged once, by the run's rank 0
    for one, two in zip(single, rows, strict=True):
        for key in COMPARED:
            assert two[key] == pytest.approx(one[key], rel=1e-3, abs=1e-6), (one["step"], key)
    assert any(r["train/grad_norm"] > 0 for r in single)  # the comparison is not of zeros


@pytest.mark.slow
def test_a_node_left_alone_stops_after_the_rendezvous_timeout_with_one_line(tmp_path):
    port, run_dir = free_port(), tmp_path / "node0"
    node = start_node(node_args(0, port, run_dir, ["distributed.rdzv_timeout_s=5"]), tmp_path, tmp_path / "node0.log")
    code = wait_or_kill(node, timeout=300)
    output = (tmp_path / "node0.log").read_text()
    assert code == 2, output[-2000:]
    (line,) = [text for text in output.splitlines() if text.startswith("grpo-run: ")]
    assert line.startswith("grpo-run: error: node 0 of distributed.nnodes=2 waited 5 s at the rendezvous ")
    assert f"127.0.0.1:{port}" in line and "for all 2 nodes to join" in line and "Traceback" not in output
