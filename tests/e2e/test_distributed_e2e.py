"""The grpo-run end-to-end half of tests/unit/distributed/test_distributed.py: grpo-run as a subprocess."""

from __future__ import annotations

import signal
from pathlib import Path

import psutil
import pytest

from grpo_cli.tracking import read_metrics
from tests.conftest import run_grpo
from tests.e2e.test_reliability_e2e import start_grpo, wait_for
from tests.unit.distributed.test_distributed import SETTING, free_port

# torch.distributed ranks on a rendezvous port, a resource of the machine (tests/conftest.py, "Parallel workers")
pytestmark = pytest.mark.machine_wide

COMPARED = ("train/reward", "train/loss", "train/grad_norm")


def train_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r]


def run_setting(tmp_path: Path, name: str, extra: list[str]) -> list[dict]:
    run_dir = tmp_path / name
    result = run_grpo([*SETTING, *extra, f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    return train_rows(run_dir)


@pytest.mark.slow
def test_ddp_and_fsdp_take_the_same_steps_as_one_process(tmp_path, one_process_rows, fsdp_run):
    single = one_process_rows
    for strategy in ("ddp", "fsdp"):
        if strategy == "fsdp":  # its checkpoints (for the resume test) change no step
            rows = fsdp_run[1]
        else:
            rows = run_setting(tmp_path, strategy, ["distributed=ddp", f"distributed.master_port={free_port()}"])
        assert [r["step"] for r in rows] == [1, 2, 3]  # each step logged once, by rank 0
        for one, many in zip(single, rows, strict=True):
            for key in COMPARED:
                assert many[key] == pytest.approx(one[key], rel=1e-3, abs=1e-6), (strategy, one["step"], key)
            # Throughput counts every rank's tokens: over the step's wall time they are the batch's response
            # tokens (one epoch), which the one process generates alone.
            generated = many["throughput/tokens_per_s"] * many["time/step_s"]
            assert generated == pytest.approx(many["throughput/response_tokens"], rel=1e-6), (strategy, one["step"])
        one_step = single[0]["throughput/tokens_per_s"] * single[0]["time/step_s"]
        assert rows[0]["throughput/response_tokens"] == pytest.approx(one_step, rel=1e-6), strategy
    assert any(r["train/grad_norm"] > 0 for r in single)  # the comparison is not of zeros


def children_of(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.slow
def test_a_killed_two_rank_run_resumes_on_one_rank_and_leaves_no_process(tmp_path):
    run_dir = tmp_path / "run"
    args = [*SETTING, "train.steps=4", "train.checkpoint_every=1", "distributed=ddp", f"hydra.run.dir={run_dir}"]
    process = start_grpo([*args, f"distributed.master_port={free_port()}"], cwd=tmp_path)
    try:
        wait_for(lambda: (run_dir / "checkpoints" / "step_000002" / "COMPLETE").exists(), timeout=600)
        ranks = children_of(process.pid)
        assert len([p for p in ranks if "python" in p.name().lower()]) >= 2
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        gone, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, f"ranks outlived the killed run: {[p.pid for p in alive]}"
    finally:
        if process.poll() is None:
            process.kill()
    # A full, one-process checkpoint: resume it without distributed (a different number of ranks).
    result = run_grpo(["resume=" + str(run_dir), "distributed=none"], cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    steps = [r["step"] for r in train_rows(run_dir)]
    assert steps == [1, 2, 3, 4]
