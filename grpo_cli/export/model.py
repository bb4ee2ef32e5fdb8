"""Export one checkpoint: the trained policy rebuilt (source.py), written as a Hugging Face folder (folder.py) with
its generation config (generation.py) and card (card.py), pushed when asked (hub.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_cli.export.source import RunCheckpoint, find_checkpoint, trained_policy

if TYPE_CHECKING:
    from grpo_cli.config.schemas import ExportConfig


@dataclass(frozen=True)
class Exported:
    """What an export wrote: the folder, its layout ("full", "merged", "adapter"), the checkpoint, the weights'
    dtype, the note said when an adapter was merged though not asked, and the seconds it took."""

    folder: Path
    layout: str
    checkpoint: RunCheckpoint
    dtype: str
    note: str | None
    seconds: float


def check_shard_size(value: str) -> None:
    """export.max_shard_size as transformers reads it ("5GB", "500MB", bytes): a one-line UserFacingError otherwise."""
    from transformers.utils.hub import convert_file_size_to_int

    from grpo_cli.errors import UserFacingError

    try:
        convert_file_size_to_int(value)
    except ValueError as error:
        raise UserFacingError(f"export.max_shard_size={value}: {error}: give a size such as 5GB or 500MB") from None


def export_checkpoint(checkpoint: RunCheckpoint, settings: ExportConfig, out: Path | None = None) -> Exported:
    """Write `checkpoint`'s trained model to `out` (default: checkpoint.default_out()) as export.* says."""
    from grpo_cli.export.card import build_card, write_card
    from grpo_cli.export.folder import export_dtype, hub_base, layout_for, write_model
    from grpo_cli.export.generation import generation_config

    check_shard_size(settings.max_shard_size)  # before the policy is rebuilt: a typo costs nothing
    started = time.perf_counter()
    folder = Path(out) if out is not None else checkpoint.default_out()
    model_cfg = checkpoint.model_cfg
    layout = layout_for(model_cfg, settings.merge_lora)
    dtype = export_dtype(settings.dtype, model_cfg)
    model, tokenizer = trained_policy(checkpoint)
    generation = generation_config(model, tokenizer, checkpoint.config)
    write_model(model, tokenizer, folder, layout, dtype, settings.max_shard_size, generation, hub_base(model_cfg))
    dtype_name = str(dtype).removeprefix("torch.")
    write_card(build_card(checkpoint, layout, dtype_name, settings.push_to_hub, tokenizer), folder)
    return Exported(folder, layout.kind, checkpoint, dtype_name, layout.note, time.perf_counter() - started)


def export_run(settings: ExportConfig) -> Exported:
    """job=export: export.run's checkpoint (export.step, else the newest complete one) to export.out."""
    assert settings.run is not None  # jobs/export.py says so in one line first
    checkpoint = find_checkpoint(settings.run, settings.step)
    return export_checkpoint(checkpoint, settings, Path(settings.out).expanduser() if settings.out else None)
