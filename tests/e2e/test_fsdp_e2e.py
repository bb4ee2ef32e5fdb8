"""The grpo-run end-to-end half of tests/unit/distributed/test_fsdp.py: grpo-run as a subprocess."""

from __future__ import annotations

import shutil

import pytest

from tests.e2e.test_distributed_e2e import run_setting
from tests.unit.distributed.test_distributed import free_port

# torch.distributed ranks on a rendezvous port, a resource of the machine (tests/conftest.py, "Parallel workers")
pytestmark = pytest.mark.machine_wide


@pytest.mark.slow
def test_an_fsdp_run_resumed_after_its_step_2_checkpoint_takes_the_uninterrupted_steps(tmp_path, fsdp_run):
    trained, uninterrupted = fsdp_run
    assert [r["step"] for r in uninterrupted] == [1, 2, 3]
    # Stopped after the step-2 checkpoint: the step-3 one never written, then resumed from step 2 (in a copy of
    # the run directory, the shared run's own left as it ended).
    run_dir = tmp_path / "fsdp"
    shutil.copytree(trained, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_000003")
    resumed = run_setting(tmp_path, "fsdp", [f"resume={run_dir}", f"distributed.master_port={free_port()}"])
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for key in ("train/reward", "train/loss", "train/grad_norm", "train/entropy"):
        assert resumed[2][key] == uninterrupted[2][key], key
