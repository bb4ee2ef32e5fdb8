"""What a run checks of a Ray cluster it joins (grpo_cli/drivers/ray_cluster.py and the executor's use of it):
the CPUs said, the actors placed, the run directory shared, the task's files there, the environment shipped, a
lost actor in one line. The cluster itself runs in tests/e2e/test_ray_cluster_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_cli.drivers.ray_actors import LearnerHandle
from grpo_cli.drivers.ray_cluster import actor_lost, node_files, node_problem, reply_problem, shipped_env
from grpo_cli.drivers.ray_reaper import stop_sentinel
from grpo_cli.drivers.ray_run import RayRun, actor_options, actor_resources
from grpo_cli.errors import UserFacingError
from tests.conftest import compose_config


def test_joining_a_cluster_needs_the_actor_cpus_said_and_one_machine_takes_half_its_cores(tmp_path):
    cluster = compose_config(["sync=async", "sync.ray_address=127.0.0.1:6379"], str(tmp_path))
    with pytest.raises(UserFacingError, match=r"^sync.actor_cpus: set it when joining a Ray cluster"):
        actor_resources(cluster, local_cpus=64, has_cuda=False)
    said = compose_config(["sync=async", "sync.ray_address=auto", "sync.actor_cpus=3"], str(tmp_path))
    assert actor_resources(said, local_cpus=64, has_cuda=False) == (3, 0.0)
    local = compose_config(["sync=async"], str(tmp_path))
    assert actor_resources(local, local_cpus=8, has_cuda=False) == (4, 0.0)


def test_each_actor_asks_for_its_own_custom_resources(tmp_path):
    cfg = compose_config(
        ["sync=async", "+sync.learner_resources={trainer: 1}", "+sync.generator_resources={sampler: 0.5}"],
        str(tmp_path),
    )
    learner, generator = actor_options(cfg, "learner", 2, 0.0), actor_options(cfg, "generator", 2, 1.0)
    assert learner == {"num_cpus": 2, "num_gpus": 0.0, "max_restarts": 0, "resources": {"trainer": 1.0}}
    assert generator == {"num_cpus": 2, "num_gpus": 1.0, "max_restarts": 0, "resources": {"sampler": 0.5}}
    assert "resources" not in actor_options(compose_config(["sync=async"], str(tmp_path)), "learner", 2, 0.0)


def test_the_files_a_config_names_are_what_each_node_must_see(tmp_path):
    rewards = tmp_path / "task" / "parity.py"
    rewards.parent.mkdir()
    rewards.write_text("def parity(completion, answer):\n    return 1.0\n")
    data = tmp_path / "task" / "train.jsonl"
    data.write_text("{}\n")
    cfg = compose_config(
        [
            "task=custom",
            f"task.train_path={data}",
            f"+task.rewards.p={rewards}:parity",
            "task.reward_weights={p: 1}",
        ],
        str(tmp_path / "run"),
    )
    found = dict(node_files(cfg))
    assert found["task.train_path"] == str(data)
    assert found["task.rewards.p"] == str(rewards)  # a user-code reference names its file
    assert all(Path(path).is_absolute() and Path(path).exists() for path in found.values())


def test_a_node_that_does_not_share_the_run_directory_or_lacks_a_file_is_refused_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    marker = run_dir / ".ray_storage_x"
    marker.write_text("token")
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    files = [("task.train_path", str(data))]
    # The node sees the marker and the file: no problem, and its reply reaches the driver.
    assert node_problem(str(marker), "token", files, "learner") is None
    assert reply_problem(marker, "token", "learner") is None
    # A node with its own disk: the driver's marker is not there (another token: another run's marker).
    unshared = node_problem(str(marker), "other", files, "learner")
    assert unshared is not None and "\n" not in unshared
    assert unshared.startswith("sync.ray_address: the learner actor's node") and str(run_dir) in unshared
    # Its reply never reached this machine.
    assert "does not reach this machine" in (reply_problem(marker, "token", "generator 0") or "")
    # The run directory shared, a task file missing on the node.
    data.unlink()
    missing = node_problem(str(marker), "token", files, "generator 0")
    assert missing is not None and missing.startswith(f"sync.ray_address: task.train_path={data} does not exist")
    assert "generator 0 actor's node" in missing


def test_the_hub_and_logging_settings_and_pythonpath_travel_to_the_actors():
    environ = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "off", "PYTHONPATH": "/x", "HOME": "/"}
    assert shipped_env(environ) == {k: v for k, v in environ.items() if k != "HOME"}


def test_a_lost_actor_names_the_checkpoints_kept_and_the_resume(tmp_path):
    assert actor_lost(RuntimeError("x"), tmp_path).endswith("no checkpoint was written yet")
    (tmp_path / "checkpoints" / "step_000002").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000002" / "COMPLETE").write_text("")
    line = actor_lost(RuntimeError("x"), tmp_path)
    assert line.startswith("a Ray actor of this run is gone (RuntimeError: its node died")
    assert line.endswith(
        f"the checkpoints in {tmp_path / 'checkpoints'} are kept; continue with: grpo-run resume={tmp_path}"
    )


class UnreachableRay:
    """Stands in for the ray module where ray.init cannot reach the cluster (as Ray 2.60 says after ~20 s when the
    address is wrong or token authentication rejects the driver)."""

    @staticmethod
    def is_initialized() -> bool:
        return False

    @staticmethod
    def init(address=None, **kwargs):
        raise ConnectionError(f"Failed to connect to Ray cluster at {address}")


def test_a_cluster_that_cannot_be_joined_is_one_line_naming_the_address(tmp_path):
    address = "127.0.0.1:6390"
    cfg = compose_config(["sync=async", f"sync.ray_address={address}", "sync.actor_cpus=1"], str(tmp_path))
    run = RayRun(UnreachableRay(), tmp_path, LearnerHandle(None), [])  # no actors: only its start of Ray
    with pytest.raises(UserFacingError) as raised:
        run.start_ray(cfg, actors=2, cpus=1)
    line = str(raised.value)
    assert line.startswith(f"sync.ray_address={address}: could not join the Ray cluster (Failed to connect")
    assert "RAY_AUTH_MODE=token" in line and "\n" not in line
    # A local Ray that fails to start is not a cluster's address: the error stays what it is.
    try:
        with pytest.raises(ConnectionError):
            run.start_ray(compose_config(["sync=async"], str(tmp_path)), actors=2, cpus=1)
    finally:
        stop_sentinel(run.sentinel)  # the local path starts its sentinel first
