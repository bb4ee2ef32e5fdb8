"""sync=async on a Ray cluster started as users start one (docs/sync.md, "On a Ray cluster"): a head with Ray's own
`ray start --head`, a second node process on this machine with a custom resource, the run joining it with
sync.ray_address and its learner placed on the second node by that resource; the second node killed mid-run ends
the run in one line with its last checkpoint intact (a resume on the restored cluster finishes it), and no actor of
the run is left on the cluster. The cluster is the test's: its teardown kills its own processes (never `ray stop`,
which stops every Ray on the machine)."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from grpo_cli.learner.checkpoint import list_checkpoints, verify_checkpoint
from tests.conftest import run_grpo
from tests.e2e.test_reliability_e2e import start_grpo, wait_for
from tests.ray_processes import free_port, kill_run_processes, read_processes, run_processes
from tests.unit.drivers.test_sync_strategies import train_rows

RAY = os.path.join(os.path.dirname(sys.executable), "ray")


@dataclass
class Cluster:
    """The test's two-node Ray cluster: the head's GCS address and each node's temp dir."""

    address: str
    head: Path
    node: Path

    def start_node(self) -> None:
        """The second node: one CPU and the custom resource `node2` that the learner asks for."""
        ray_start(f"--address={self.address}", "--num-cpus=1", '--resources={"node2": 1}', f"--temp-dir={self.node}")

    def actors_on(self, temp_dir: Path) -> list[int]:
        """The live actor processes (grpo-cli's Hosted actors) of the node whose temp dir is `temp_dir`: the
        workers its raylet started."""
        raylets = self.raylets(temp_dir)
        return [p.pid for p in read_processes() if "ray::Hosted" in p.cmdline and parent(p.pid) in raylets]

    def raylets(self, temp_dir: Path) -> list[int]:
        return [
            p.pid
            for p in read_processes()
            if "raylet/raylet" in p.cmdline and f"--temp_dir={temp_dir}" in p.cmdline and p.state != "Z"
        ]


def parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def ray_start(*args: str) -> None:
    """Ray's own CLI, as a user runs it (the test's environment: its tag, RAY_AUTH_MODE)."""
    import subprocess

    done = subprocess.run([RAY, "start", *args, "--disable-usage-stats"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]


@pytest.fixture
def cluster(ray_installed, monkeypatch) -> Iterator[Cluster]:
    # Ray 2.60's `ray start --head` turns on token authentication; the nodes and drivers that join must say so.
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    root = Path(ray_installed)  # the test's own Ray temp dir: every process below it is this test's
    port = free_port()
    made = Cluster(f"127.0.0.1:{port}", root / "head", root / "node2")
    try:
        ray_start("--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false", f"--temp-dir={made.head}")
        made.start_node()
        yield made
    finally:
        # The cluster is the user's (here the test's): stop exactly its processes, then ray_installed checks.
        kill_run_processes(ray_installed)
        deadline = time.monotonic() + 20
        while run_processes(ray_installed) and time.monotonic() < deadline:
            time.sleep(0.5)


@pytest.mark.slow
def test_async_on_a_two_node_cluster_places_the_learner_and_survives_losing_its_node(tmp_path, cluster):
    run_dir = tmp_path / "run"
    args = [
        "debug=smoke",
        "model.mixed_precision=no",
        "loss=grpo_clip",
        "sync=async",
        f"sync.ray_address={cluster.address}",
        "sync.actor_cpus=1",
        "+sync.learner_resources={node2: 1}",
        "train.steps=4",
        "train.checkpoint_every=1",
        "train.eval_every=0",
    ]
    process = start_grpo([*args, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "step_000001" / "COMPLETE").exists(), timeout=300)
        # Placed by Ray's resources: the learner (which writes the checkpoints) on the second node, the generator
        # on the head (the only other CPU).
        assert len(cluster.actors_on(cluster.node)) == 1 and len(cluster.actors_on(cluster.head)) == 1
        (raylet,) = cluster.raylets(cluster.node)
        os.kill(raylet, signal.SIGKILL)  # the node dies mid-run
        stdout, stderr = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 2, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert "a Ray actor of this run is gone" in lines[0] and f"grpo-run resume={run_dir}" in lines[0]
    complete = [p for p in list_checkpoints(run_dir) if verify_checkpoint(p) is None]
    assert complete, "no intact checkpoint"
    saved = int(complete[-1].name.split("_")[1])
    assert 1 <= saved < 4
    # Nothing of the run is left on the cluster: the generator on the head was killed, the learner died with
    # its node (the cluster's own daemons stay: they are the user's).
    wait_for(lambda: not cluster.actors_on(cluster.head) and not cluster.actors_on(cluster.node), timeout=30)

    # The node back, the same command line resumes from the last checkpoint and finishes on the cluster.
    cluster.start_node()
    resumed = run_grpo([f"resume={run_dir}", f"hydra.run.dir={tmp_path / 'resumer'}"], cwd=tmp_path, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"from step_{saved:06d}" in resumed.stdout
    assert [r["step"] for r in train_rows(run_dir)] == [1, 2, 3, 4]
    wait_for(lambda: not cluster.actors_on(cluster.head) and not cluster.actors_on(cluster.node), timeout=30)
