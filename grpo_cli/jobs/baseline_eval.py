"""`job=baseline_eval`: the untrained policy on the held-out set (and task.eval_sets), loaded and sampled exactly as
training would (model.lora.*, model.quantization, rollout.*, eval.n_samples), with generations and rewards as
JSONL, its eval/* metrics as one metrics.jsonl line at step 0, and a summary. The evaluation and its files are
job=eval's (jobs/eval.py, `evaluate_and_write`): a trained run is evaluated with job=eval eval.model=<run dir>."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from grpo_cli.jobs.eval import evaluate_and_write
from grpo_cli.rollout.worker import RolloutWorker

if TYPE_CHECKING:
    from grpo_cli.config.schemas import GRPOConfig


def run(cfg: GRPOConfig, output_dir: Path, console: Console) -> dict[str, Any]:
    title = f"baseline eval of {cfg.model.name}"
    return evaluate_and_write(cfg, RolloutWorker(cfg), output_dir, console, title=title, stem="baseline_eval", step=0)
