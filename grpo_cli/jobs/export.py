"""`job=export`: a run's checkpoint as a Hugging Face model folder (docs/after-training.md), pushed to the Hub when
export.push_to_hub names a repo."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from grpo_cli.errors import UserFacingError
from grpo_cli.export import export_run
from grpo_cli.export.run_end import describe

if TYPE_CHECKING:
    from grpo_cli.config.schemas import GRPOConfig


def run(cfg: GRPOConfig, output_dir: Path, console: Console) -> dict[str, Any]:
    settings = cfg.export
    if settings.run is None:
        raise UserFacingError(
            "job=export needs export.run=<run directory>: grpo-run job=export export.run=outputs/train/<time>"
        )
    exported = export_run(settings)
    if exported.note:
        console.print(exported.note, highlight=False, markup=False)
    console.print(describe(exported), highlight=False, markup=False, soft_wrap=True)
    summary: dict[str, Any] = {
        "folder": str(exported.folder),
        "layout": exported.layout,
        "step": exported.checkpoint.step,
    }
    if settings.push_to_hub:
        from grpo_cli.export.hub import push_folder

        url = push_folder(exported.folder, settings.push_to_hub, settings.private)
        console.print(f"pushed: {url} ({'private' if settings.private else 'public'})", highlight=False, markup=False)
        summary["url"] = url
    return summary
