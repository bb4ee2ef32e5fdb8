"""<run>/model/ at the end of a training run, and the lines that say where the model is and what to do next.

Written once, in the process that launched the run, after its ranks ended (distributed) or its loop closed (one
process), from the newest complete checkpoint: at a normal end and at every stop that saved one (SIGINT/SIGTERM, a
reward error, non-finite steps, a failed weight sync: a `RunStopped`). Not after a bug, a second Ctrl-C, or a
user error that saved nothing new (the run's checkpoints are still there: `grpo-run job=export`). export.at_end=false
skips it (the newest checkpoint already holds the weights).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_cli.errors import EXIT_INTERNAL_ERROR, RunStopped, UserFacingError, error_summary, write_traceback

if TYPE_CHECKING:
    from rich.console import Console

    from grpo_cli.config.schemas import GRPOConfig
    from grpo_cli.export.model import Exported

MODEL_DIR = "model"


def next_commands(run_dir: Path, exported: Exported | None) -> list[str]:
    """What to run next: evaluate, export and push, serve (with vLLM)."""
    folder = exported.folder if exported is not None else run_dir / MODEL_DIR
    if exported is not None and exported.layout == "adapter":
        base = exported.checkpoint.model_cfg.name_or_path
        serve = f"vllm serve {base} --enable-lora --lora-modules policy={folder}"
    else:
        serve = f"vllm serve {folder}"
    return [
        f"  evaluate: grpo-run job=eval eval.model={run_dir}",
        f"  export:   grpo-run job=export export.run={run_dir} export.push_to_hub=<you>/<name>",
        f"  serve:    {serve}",
    ]


def describe(exported: Exported) -> str:
    """One line: the folder, what it holds, from which checkpoint, and the time it took."""
    what = {"full": "the full model", "merged": "LoRA merged into the base", "adapter": "the LoRA adapter (PEFT)"}
    return (
        f"model: {exported.folder} ({what[exported.layout]}, {exported.dtype}, checkpoint step "
        f"{exported.checkpoint.step}; {exported.seconds:.1f}s)"
    )


def _wanted(cfg: GRPOConfig) -> bool:
    """export.at_end, in the one process that writes: node 0's launcher (a rank started by torchrun itself runs
    this too: only global rank 0 does)."""
    return cfg.export.at_end and cfg.distributed.node_rank == 0 and os.environ.get("RANK", "0") == "0"


def write_model_at_end(cfg: GRPOConfig, run_dir: Path, console: Console) -> None:
    """Export the newest complete checkpoint to <run>/model/ and print where it is and the next commands. A
    failure is one line and leaves the run's own outcome as it was (the checkpoints are the weights)."""
    from grpo_cli.export.model import export_checkpoint
    from grpo_cli.export.source import find_checkpoint

    def say(line: str) -> None:
        console.print(line, highlight=False, markup=False, soft_wrap=True)

    retry = f"grpo-run job=export export.run={run_dir}"
    try:
        checkpoint = find_checkpoint(run_dir, None, key="run")
        exported = export_checkpoint(checkpoint, cfg.export, run_dir / MODEL_DIR)
    except UserFacingError as error:
        say(f"model/ not written: {error}")
        return
    except KeyboardInterrupt:
        say(f"model/ not written (interrupted); the checkpoints hold the weights: {retry}")
        return
    except Exception as error:  # noqa: BLE001 - a bug in the export must not hide how the run itself ended
        log = write_traceback(error, run_dir / "export.log")
        say(f"model/ not written ({error_summary(error, limit=200)}; traceback in {log}); retry with: {retry}")
        return
    if exported.note:
        say(exported.note)
    say(describe(exported))
    for line in next_commands(run_dir, exported):
        say(line)


def with_model_at_end(
    launch: Callable[[], dict[str, Any]], cfg: GRPOConfig, run_dir: Path, console: Console
) -> dict[str, Any]:
    """Run the training job (`launch`), then write <run>/model/ when it ended normally or stopped after saving."""
    try:
        summary = launch()
    except RunStopped as stopped:
        if stopped.exit_code != EXIT_INTERNAL_ERROR and _wanted(cfg):  # a rank's crash is a bug, not a stop
            write_model_at_end(cfg, run_dir, console)
        raise
    if _wanted(cfg):
        write_model_at_end(cfg, run_dir, console)
    return summary
