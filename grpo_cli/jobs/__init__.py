"""The jobs `job=<name>` runs, found by name. Each module has `run(cfg: GRPOConfig, output_dir: Path, console:
Console) -> summary dict`, cfg being the typed config cli.py built.

Modules are imported only when their job runs: importing this package loads no job's dependencies.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from grpo_cli.config.schemas import GRPOConfig


@dataclass(frozen=True)
class Job:
    module: str
    # Splits of the task's data the job reads; None: it loads no model and no data (no preflight, no
    # run_info.json).
    splits: tuple[str, ...] | None
    # Runs on distributed.* ranks (the other jobs run in one process whatever distributed.* says).
    distributed: bool = False
    # Ends by writing <run>/model/ from the newest checkpoint (export.at_end; grpo_cli/export/run_end.py).
    model_at_end: bool = False


JOBS: dict[str, Job] = {
    "train": Job("grpo_cli.jobs.train", ("train", "eval"), distributed=True, model_at_end=True),
    "baseline_eval": Job("grpo_cli.jobs.baseline_eval", ("eval",)),
    "eval": Job("grpo_cli.jobs.eval", ("eval",)),
    "benchmark": Job("grpo_cli.jobs.benchmark", ("train", "eval")),
    "export": Job("grpo_cli.jobs.export", None),
    "report": Job("grpo_cli.jobs.report", None),
    "check_reward": Job("grpo_cli.jobs.check_reward", None),
}


def run_job(name: str, cfg: GRPOConfig, output_dir: Path, console: Console, overrides: list[str]) -> dict[str, Any]:
    """Run job `name`: for jobs that load a model, everything checkable is checked first (preflight)."""
    job = JOBS[name]
    if job.splits is not None:
        from grpo_cli.jobs.preflight import preflight

        for warning in preflight(cfg, job.splits, output_dir, overrides):
            console.print(f"warning: {warning}", highlight=False, markup=False)

    def launch() -> dict[str, Any]:
        if job.distributed and cfg.distributed.strategy != "none":
            from grpo_cli.distributed.launch import run_distributed  # torch.distributed's launcher, only when asked

            return run_distributed(job.module, cfg, output_dir, console)
        return importlib.import_module(job.module).run(cfg, output_dir, console)

    if job.model_at_end:  # in this process, after the ranks ended or the loop closed
        from grpo_cli.export.run_end import with_model_at_end

        return with_model_at_end(launch, cfg, output_dir, console)
    return launch()
