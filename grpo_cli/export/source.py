"""What is exported: a run directory's checkpoint, and the trained policy rebuilt from it.

The run's own config.yaml gives `model.*` (the base, LoRA, quantization); `models.build_policy` builds that policy
and `learner.checkpoint.copy_trained_weights` puts the checkpoint's trained tensors in it. A checkpoint holds whole
tensors whatever the run's world size (the FSDP2 gather happens when it is written), so one process rebuilds the
same model from a checkpoint of one rank or of many.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from grpo_cli.errors import UserFacingError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from grpo_cli.config.schemas import ModelConfig


@dataclass(frozen=True)
class RunCheckpoint:
    """One complete checkpoint of a run directory, with the run's saved config."""

    run_dir: Path
    path: Path
    step: int
    newest: bool  # the run's newest complete checkpoint (its model/ folder is exported from it)
    config: DictConfig  # the run's config.yaml under the schemas (config.saved.load_saved_config)

    @property
    def model_cfg(self) -> ModelConfig:
        """The run's `model.*`, as the typed schema; gradient checkpointing off: it would write use_cache=false
        into the exported config.json, and exporting runs no backward pass."""
        from grpo_cli.config.schemas import ModelConfig

        model = OmegaConf.to_object(self.config.model)
        assert isinstance(model, ModelConfig)  # load_saved_config merged config.yaml into the schema
        return dataclasses.replace(model, gradient_checkpointing=False)

    def default_out(self) -> Path:
        """<run>/model for the newest complete checkpoint, <run>/model_step_N for an older one."""
        return self.run_dir / ("model" if self.newest else f"model_step_{self.step}")


def find_checkpoint(run: str | Path, step: int | None = None, key: str = "export.run") -> RunCheckpoint:
    """The checkpoint of run directory `run` to export: step `step`'s, or the newest complete one. A one-line
    UserFacingError naming the directory and the fix when it is no run, has no such checkpoint, or it is damaged."""
    from grpo_cli.config.saved import load_saved_config
    from grpo_cli.learner.checkpoint import checkpoint_step, chosen_checkpoint, list_checkpoints

    run_dir = Path(run).expanduser().resolve()
    if not run_dir.is_dir():
        raise UserFacingError(f"{key}={run}: no such directory: give a run directory (outputs/train/<time>)")
    if not (run_dir / "config.yaml").is_file():
        raise UserFacingError(
            f"{key}={run} has no config.yaml, so it is no grpo-run run directory: give the directory a training "
            "run wrote (outputs/train/<time>)"
        )
    chosen = chosen_checkpoint(run_dir, step, "export.step", str(run))
    if chosen is None:
        checkpoints = list_checkpoints(run_dir)
        found = f" ({len(checkpoints)} incomplete, the newest {checkpoints[-1].name})" if checkpoints else ""
        raise UserFacingError(
            f"{key}={run} has no complete checkpoint{found}: the run stopped before its first one; continue it "
            f"with grpo-run resume={run} (a checkpoint is written at the end and every train.checkpoint_every steps)"
        )
    newest = chosen_checkpoint(run_dir, None, "export.step", str(run))
    config = load_saved_config(run_dir / "config.yaml")
    return RunCheckpoint(run_dir, chosen, checkpoint_step(chosen), chosen == newest, config)


def export_device(model_cfg: ModelConfig) -> torch.device:
    """CPU, where the export needs no accelerator; CUDA for a QLoRA run (bitsandbytes' 4-bit base lives there)."""
    import torch

    return torch.device("cuda" if model_cfg.quantization != "none" else "cpu")


def trained_policy(checkpoint: RunCheckpoint) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """The run's policy (`model.*` of its config: LoRA, quantization) with the checkpoint's trained weights."""
    from grpo_cli.learner.checkpoint import copy_trained_weights
    from grpo_cli.models import build_policy

    model_cfg = checkpoint.model_cfg
    model, tokenizer = build_policy(model_cfg, export_device(model_cfg))
    copy_trained_weights(
        checkpoint.path,
        model,
        "checkpoint",
        f"it is not a checkpoint of the model {checkpoint.run_dir / 'config.yaml'} names (was config.yaml edited?)",
    )
    model.eval()
    return model, tokenizer


def saved_value(config: DictConfig, dotted: str, default: Any = None) -> Any:
    """A key of the run's saved config (None-safe, for keys an older config.yaml may lack)."""
    value = OmegaConf.select(config, dotted, default=default)
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig | ListConfig) else value
