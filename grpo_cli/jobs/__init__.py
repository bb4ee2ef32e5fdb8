"""The jobs `job=<name>` runs, found by name. Each module has `run(cfg, output_dir, console) -> summary dict`.

Modules are imported only when their job runs, so `job=report` and `job=check_reward` never import torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Job:
    module: str
    # Splits of the task's data the job reads; None: it loads no model and no data (no preflight, no
    # run_info.json).
    splits: tuple[str, ...] | None


JOBS: dict[str, Job] = {
    "train": Job("grpo_cli.jobs.train", ("train", "eval")),
    "baseline_eval": Job("grpo_cli.jobs.baseline_eval", ("eval",)),
    "benchmark": Job("grpo_cli.jobs.benchmark", ("train", "eval")),
    "report": Job("grpo_cli.jobs.report", None),
    "check_reward": Job("grpo_cli.jobs.check_reward", None),
}


def run_job(name: str, cfg: Any, output_dir: Path, console: Any, overrides: list[str]) -> dict[str, Any]:
    """Run job `name`: for jobs that load a model, everything checkable is checked first (preflight)."""
    job = JOBS[name]
    if job.splits is not None:
        from grpo_cli.jobs.preflight import preflight

        preflight(cfg, job.splits, output_dir, overrides)
    return importlib.import_module(job.module).run(cfg, output_dir, console)
