"""docs/distributed.md's refusal as written: `grpo-run distributed=fsdp distributed.nproc_per_node=4` on the
defaults stops once, with every size to change in one line, and the command with those sizes runs on 4 gloo
ranks (the tiny model and one step, so that it fits this machine)."""

from __future__ import annotations

import re

import pytest

from grpo_cli.tracking import read_metrics
from tests.conftest import run_grpo
from tests.unit.distributed.test_distributed import free_port

# torch.distributed ranks on a rendezvous port: they take the machine (tests/conftest.py, "Parallel workers")
pytestmark = [pytest.mark.machine_wide, pytest.mark.slow]


def test_the_one_refusal_names_the_sizes_that_then_run_on_four_ranks(tmp_path):
    command = ["distributed=fsdp", "distributed.nproc_per_node=4"]
    refused = run_grpo(command, cwd=tmp_path, timeout=120)
    assert refused.returncode == 2, refused.stderr[-2000:]
    line = refused.stderr.strip()
    assert line.startswith("grpo-run: error: distributed=fsdp over 4 ranks") and "\n" not in line, line
    sizes = re.findall(r"train\.\w+=\d+", line.split("run with ", 1)[1])
    assert sizes == ["train.gradient_accumulation_steps=4"], line  # 4 groups split already; 2 microbatches do not
    run_dir = tmp_path / "run"
    small = ["model=tiny_random", "train.steps=1", "task.n_eval=4", "rollout.max_tokens=8"]
    ran = run_grpo(
        [*command, *sizes, *small, f"distributed.master_port={free_port()}", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        timeout=900,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r] == [1]
