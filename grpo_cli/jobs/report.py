"""`job=report`: compare finished runs (tables of final/best eval reward and time per phase, reward plots).
Reads run directories only: no model, no torch."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from grpo_cli.tracking.report import write_report

if TYPE_CHECKING:
    from grpo_cli.config.schemas import GRPOConfig


def run(cfg: GRPOConfig, output_dir: Path, console: Console) -> dict[str, Any]:
    return write_report(cfg.report.runs, Path(cfg.report.out or output_dir), console)
