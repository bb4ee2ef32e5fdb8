"""benchmarks/gpu_check.py runs on a machine without CUDA too: the CUDA-only rows say why they are skipped, the
decode row runs on the CPU, and the table is written where --out says (so the script cannot rot unnoticed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import OFFLINE_ENV

from tests.conftest import REPO_ROOT


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine run the script itself")
def test_gpu_check_runs_on_the_cpu_skipping_the_cuda_rows_with_a_reason(tmp_path: Path) -> None:
    out = tmp_path / "table.md"
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "gpu_check.py"), "--out", str(out), "--workdir", str(tmp_path)],
        env={**os.environ, **OFFLINE_ENV, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {line.split(" | ")[0].strip("| "): line for line in out.read_text().splitlines() if line.startswith("| ")}
    assert "| ok |" in rows["decode loop (eager) vs generate"]
    for check in (
        "fp32 master weights + bf16 autocast",
        "4-bit QLoRA step",
        "rollout=vllm, 2 steps, probe every push",
        "prompt tree on CUDA sdpa (4D mask)",
    ):
        assert "| skipped |" in rows[check] and rows[check].rstrip(" |").split("| ")[-1]  # with its reason
    assert out.read_text() in done.stdout
