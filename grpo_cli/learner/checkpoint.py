"""Checkpoints a run can be resumed from exactly: weights, optimizer, RNG states, data position, step.

Layout: <run dir>/checkpoints/step_000010/{model.safetensors, optimizer.pt, rng.pt, state.json, COMPLETE}.
A checkpoint is written into a hidden temporary directory and renamed into place, and COMPLETE (holding the
sizes of the other files) is written last: a directory without it, or whose files do not match it, is a
checkpoint that a kill interrupted, and loading falls back to the previous one.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np  # always present: torch and transformers require it
import torch
from safetensors.torch import load_file, save_file

from grpo_cli.distributed.parallel import barrier, full_tensor, shard_like, world
from grpo_cli.errors import UserFacingError, error_summary

CHECKPOINT_DIR = "checkpoints"
MARKER = "COMPLETE"
FILES = ("model.safetensors", "optimizer.pt", "rng.pt", "state.json")

# A state saved with a checkpoint (the trainer's, the RNGs', the optimizer's): values of mixed kinds (counters, the
# sampler's position, RNG tuples and tensors, nested dicts) as json / torch.save store them, hence Any.
State = dict[str, Any]


class CheckpointError(UserFacingError):
    """No usable checkpoint where the user pointed."""


class CheckpointWriteError(UserFacingError):
    """A checkpoint could not be written (a full disk, most often); the earlier ones and the metrics are kept."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    state: State  # trainer state: sampler position, counters, W&B run id, ...


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def rng_state() -> State:
    state: State = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    state["numpy"] = np.random.get_state()
    return state


def set_rng_state(state: State) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])


def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable weights: every weight in full fine-tuning, only the adapters with LoRA; whole tensors even
    when FSDP2 shards them across ranks (gathered: every rank calls this), so one process can load them.

    named_parameters lists a tied weight once, which safetensors needs (it refuses shared storage); frozen
    weights are not saved because the run rebuilds them from model.name_or_path.
    """
    return {name: full_tensor(p.detach()).contiguous().cpu() for name, p in model.named_parameters() if p.requires_grad}


def _optimizer_state(optimizer: torch.optim.Optimizer) -> State:
    """optimizer.state_dict() with sharded (FSDP2) states gathered whole: the one-process layout."""
    saved = optimizer.state_dict()
    saved["state"] = {
        index: {key: full_tensor(value).cpu() if torch.is_tensor(value) else value for key, value in per.items()}
        for index, per in saved["state"].items()
    }
    return saved


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: State,
    keep: int,
) -> Path:
    """Write a checkpoint atomically and delete all but the newest `keep`. Returns its directory.

    With several ranks every rank calls it (gathering sharded state is collective) and rank 0 writes.
    """
    tensors, optimizer_state = _model_tensors(model), _optimizer_state(optimizer)
    root = run_dir / CHECKPOINT_DIR
    final = root / checkpoint_name(step)
    if world().is_main:
        try:
            _write(root, final, step, tensors, optimizer_state, state)
        except (OSError, RuntimeError) as error:  # torch.save reports a full disk as a RuntimeError
            raise CheckpointWriteError(_write_failure(run_dir, final, tensors, error)) from None
        for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    barrier()  # no rank goes on (or resumes from it) before the checkpoint is complete
    return final


def _write_failure(run_dir: Path, final: Path, tensors: dict[str, torch.Tensor], error: BaseException) -> str:
    """The one line of a checkpoint that could not be written (its half-written files are already gone)."""
    weights = sum(t.numel() * t.element_size() for t in tensors.values())
    try:
        free = shutil.disk_usage(final.parent).free
    except OSError:
        free = None
    full = getattr(error, "errno", None) == errno.ENOSPC or (free is not None and free < 3 * weights)
    previous = list_checkpoints(run_dir)
    kept = f"checkpoint {previous[-1].name} and the metrics so far are kept" if previous else "the metrics are kept"
    if full:
        why = (
            f"no space left on the device ({_gb(free)} free; a checkpoint of this run takes about "
            f"{_gb(3 * weights)}): free space, or lower train.keep_checkpoints / raise train.checkpoint_every"
        )
    else:
        why = error_summary(error, limit=200)
    return f"could not write checkpoint {final}: {why}; {kept}: continue with: grpo-run resume={run_dir}"


def _gb(size: int | None) -> str:
    return "?" if size is None else f"{size / 1e9:.1f} GB"


def _write(
    root: Path,
    final: Path,
    step: int,
    tensors: dict[str, torch.Tensor],
    optimizer_state: State,
    state: State,
) -> None:
    root.mkdir(parents=True, exist_ok=True)
    temp = root / f".tmp_{checkpoint_name(step)}_{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    try:
        _write_files(temp, step, tensors, optimizer_state, state)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)  # a half-written checkpoint only takes the space a retry needs
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(temp, final)


def _write_files(temp: Path, step: int, tensors: dict[str, torch.Tensor], optimizer_state: State, state: State) -> None:
    save_file(tensors, str(temp / "model.safetensors"))
    torch.save(optimizer_state, temp / "optimizer.pt")
    torch.save(rng_state(), temp / "rng.pt")
    (temp / "state.json").write_text(json.dumps({"step": step, **state}, indent=1))
    sizes = {name: (temp / name).stat().st_size for name in FILES}
    _fsync_dir_files(temp)
    (temp / MARKER).write_text(json.dumps(sizes))


def _fsync_dir_files(directory: Path) -> None:
    for path in directory.iterdir():
        with path.open("rb") as f:
            os.fsync(f.fileno())


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories of a run, oldest first (complete or not)."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))


def verify_checkpoint(path: Path) -> str | None:
    """None if the checkpoint is complete, else why it is not (for a one-line report)."""
    marker = path / MARKER
    if not marker.exists():
        return "it was never completed (no COMPLETE marker)"
    try:
        sizes = json.loads(marker.read_text())
    except (OSError, ValueError):  # ValueError: not JSON, not UTF-8
        return "its COMPLETE marker is unreadable"
    if not isinstance(sizes, dict):
        return "its COMPLETE marker is unreadable"
    for name in FILES:
        file = path / name
        if not file.exists():
            return f"{name} is missing"
        if file.stat().st_size != sizes.get(name):
            return f"{name} has {file.stat().st_size} bytes, expected {sizes.get(name)} (truncated?)"
    return None


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Checkpoint:
    """Restore weights, optimizer and RNG states in place; returns the trainer state.

    Raises CheckpointError when the checkpoint does not match the model, and another error when a file is damaged
    (the caller falls back to the previous checkpoint).
    """
    state = json.loads((path / "state.json").read_text())  # first: a damaged one leaves the model untouched
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or "sampler" not in state:
        raise ValueError("state.json lacks its step or sampler position")
    copy_trained_weights(path, model, "checkpoint", "resume with the model and LoRA settings the run was trained with")
    saved = torch.load(path / "optimizer.pt", weights_only=False)
    in_order = [p for group in optimizer.param_groups for p in group["params"]]
    saved["state"] = {
        index: {
            key: shard_like(value, in_order[int(index)]) if torch.is_tensor(value) and value.dim() else value
            for key, value in per.items()
        }
        for index, per in saved["state"].items()
    }
    optimizer.load_state_dict(saved)
    set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return Checkpoint(path=path, step=int(state["step"]), state=state)


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint directory's name holds (step_000010 -> 10); -1 for another name."""
    name = path.name.removeprefix("step_")
    return int(name) if name.isdigit() else -1


def chosen_checkpoint(run_dir: Path, step: int | None, step_key: str, run_text: str) -> Path | None:
    """The checkpoint of `run_dir` a job reads (job=eval's eval.step, job=export's export.step): step `step`'s, or
    the newest complete one (None when there is none). A one-line UserFacingError naming `step_key` when the step
    has no checkpoint or its checkpoint is damaged (a kill cut it short)."""
    checkpoints = list_checkpoints(run_dir)
    complete = [path for path in checkpoints if verify_checkpoint(path) is None]
    if step is None:
        return complete[-1] if complete else None
    steps = ", ".join(str(checkpoint_step(path)) for path in complete) or "none complete"
    named = [path for path in checkpoints if checkpoint_step(path) == step]
    if not named:
        raise UserFacingError(f"{step_key}={step}: {run_text} has no checkpoint of step {step}: its steps are {steps}")
    problem = verify_checkpoint(named[0])
    if problem is not None:
        raise UserFacingError(
            f"{step_key}={step}: checkpoint {named[0]} is damaged ({problem}): use another step ({steps}) or drop "
            f"{step_key} for the newest complete one"
        )
    return named[0]


def init_from_checkpoint(init_from: str) -> Path:
    """The checkpoint `init_from=` names: that directory if it is a checkpoint, else the newest complete one of the
    run directory it names. A one-line CheckpointError otherwise."""
    path = Path(init_from).expanduser()
    if (path / MARKER).exists() or path.name.startswith("step_"):
        problem = verify_checkpoint(path)
        if problem is not None:
            raise CheckpointError(f"init_from={init_from}: {problem}: give a complete checkpoint or its run directory")
        return path
    for candidate in reversed(list_checkpoints(path)):
        if verify_checkpoint(candidate) is None:
            return candidate
    raise CheckpointError(f"init_from={init_from} has no complete checkpoint: give a run directory with checkpoints/")


def copy_trained_weights(path: Path, model: torch.nn.Module, label: str, fix: str) -> None:
    """Copy a checkpoint's trained weights (model.safetensors) into `model`, into this rank's shard under FSDP2;
    a one-line CheckpointError, "<label> <path> does not match the model (...): <fix>", when the names differ."""
    tensors = load_file(str(path / "model.safetensors"), device=str(next(model.parameters()).device))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    if set(tensors) != trainable:
        raise CheckpointError(
            f"{label} {path} does not match the model (missing {sorted(trainable - set(tensors))[:3]}, "
            f"unexpected {sorted(set(tensors) - trainable)[:3]}): {fix}"
        )
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in tensors.items():
            parameters[name].copy_(shard_like(value, parameters[name]))


def load_weights(path: Path, model: torch.nn.Module) -> None:
    """Copy a checkpoint's trained weights into `model` (nothing else: not the optimizer, step or RNG states)."""
    copy_trained_weights(path, model, "init_from: checkpoint", "use the model and LoRA settings it was trained with")
