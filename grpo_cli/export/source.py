"""What is exported: a run directory's checkpoint, and the trained policy rebuilt from it.

The run's own config.yaml gives `model.*` (the base, LoRA, quantization); `models.build_policy` builds that policy
and `learner.checkpoint.copy_trained_weights` puts the checkpoint's trained tensors in it. A checkpoint holds whole
tensors whatever the run's world size (the FSDP2 gather happens when it is written), so one process rebuilds the
same model from a checkpoint of one rank or of many.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from grpo_cli.errors import UserFacingError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from grpo_cli.config.schemas import ModelConfig

_STEP = re.compile(r"step_(\d+)$")


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


def _step_of(path: Path) -> int:
    match = _STEP.search(path.name)
    return int(match.group(1)) if match else -1


def find_checkpoint(run: str | Path, step: int | None = None, key: str = "export.run") -> RunCheckpoint:
    """The checkpoint of run directory `run` to export: step `step`'s, or the newest complete one. A one-line
    UserFacingError naming the directory and the fix when it is no run, has no such checkpoint, or it is damaged."""
    from grpo_cli.config.saved import load_saved_config
    from grpo_cli.learner.checkpoint import list_checkpoints, verify_checkpoint

    run_dir = Path(run).expanduser().resolve()
    if not run_dir.is_dir():
        raise UserFacingError(f"{key}={run}: no such directory: give a run directory (outputs/train/<time>)")
    if not (run_dir / "config.yaml").is_file():
        raise UserFacingError(
            f"{key}={run} has no config.yaml, so it is no grpo-run run directory: give the directory a training "
            "run wrote (outputs/train/<time>)"
        )
    checkpoints = list_checkpoints(run_dir)
    complete = [path for path in checkpoints if verify_checkpoint(path) is None]
    steps = ", ".join(str(_step_of(path)) for path in complete) or "none complete"
    if step is not None:
        named = [path for path in checkpoints if _step_of(path) == step]
        if not named:
            raise UserFacingError(f"export.step={step}: {run} has no checkpoint of step {step}: its steps are {steps}")
        problem = verify_checkpoint(named[0])
        if problem is not None:
            raise UserFacingError(
                f"export.step={step}: checkpoint {named[0]} is damaged ({problem}): export another step ({steps}) "
                "or drop export.step for the newest complete one"
            )
        chosen = named[0]
    elif complete:
        chosen = complete[-1]
    else:
        found = f" ({len(checkpoints)} incomplete, the newest {checkpoints[-1].name})" if checkpoints else ""
        raise UserFacingError(
            f"{key}={run} has no complete checkpoint{found}: the run stopped before its first one; continue it "
            f"with grpo-run resume={run} (a checkpoint is written at the end and every train.checkpoint_every steps)"
        )
    config = load_saved_config(run_dir / "config.yaml")
    return RunCheckpoint(run_dir, chosen, _step_of(chosen), bool(complete) and chosen == complete[-1], config)


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
