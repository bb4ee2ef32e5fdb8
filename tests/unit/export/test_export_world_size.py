"""The same trained weights checkpointed by two FSDP2 ranks (gloo, this CPU) and by one process export to the same
files, byte for byte: the checkpoint gathers FSDP2's shards when it is written, so the export never sees a world
size."""

from __future__ import annotations

import hashlib
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from grpo_cli.config.schemas import ExportConfig
from grpo_cli.export import export_checkpoint, find_checkpoint
from grpo_cli.learner.checkpoint import save_checkpoint
from grpo_cli.models import build_policy
from tests.conftest import compose_config
from tests.unit.distributed.test_distributed import free_port

# torch.distributed ranks on a rendezvous port, a resource of the machine (tests/conftest.py, "Parallel workers")
pytestmark = pytest.mark.machine_wide

SHIFT = 0.05  # the "training": every weight moved by the same amount on every rank's shard and in one process


def overrides(strategy: str) -> list[str]:
    return ["model=tiny_random", "model.mixed_precision=no", f"distributed={strategy}", "train.rollout_batch_size=8"]


def write_config(run_dir: Path, strategy: str) -> None:
    cfg = compose_config(overrides(strategy), output_dir=str(run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), run_dir / "config.yaml")


def _fsdp_rank(rank: int, port: int, run_dir: str) -> None:
    """build_policy's model sharded by FSDP2 as the learner shards it (parallel.wrap_for_training), shifted, and
    checkpointed by save_checkpoint (which gathers the shards)."""
    from torch.distributed.tensor import DTensor

    from grpo_cli.distributed.parallel import wrap_for_training

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(minutes=3))
    torch.set_num_threads(1)
    try:
        model, _ = build_policy(compose_config(overrides("fsdp"), output_dir=run_dir).model, torch.device("cpu"))
        wrap_for_training(model, "fsdp", torch.device("cpu"), None)
        assert isinstance(next(model.parameters()), DTensor)  # each rank holds its shard only
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(SHIFT)
        save_checkpoint(Path(run_dir), 2, model, torch.optim.AdamW(model.parameters()), {"sampler": {}}, keep=1)
    finally:
        dist.destroy_process_group()


def digests(folder: Path) -> dict[str, str]:
    return {
        file.name: hashlib.sha256(file.read_bytes()).hexdigest()
        for file in folder.iterdir()
        if file.name != "README.md"
    }


def test_a_two_rank_fsdp_checkpoint_and_a_one_process_one_export_to_equal_files(tmp_path):
    fsdp_run, one_run = tmp_path / "fsdp", tmp_path / "one"
    write_config(fsdp_run, "fsdp")
    mp.spawn(_fsdp_rank, args=(free_port(), str(fsdp_run)), nprocs=2)
    write_config(one_run, "none")
    model, _ = build_policy(compose_config(overrides("none")).model, torch.device("cpu"))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(SHIFT)
    save_checkpoint(one_run, 2, model, torch.optim.AdamW(model.parameters()), {"sampler": {}}, keep=1)

    exported = [export_checkpoint(find_checkpoint(run), ExportConfig()).folder for run in (fsdp_run, one_run)]
    fsdp_files, one_files = (digests(folder) for folder in exported)
    assert "model.safetensors" in fsdp_files and fsdp_files == one_files
    # and the weights are the trained ones, not the base's
    base, _ = build_policy(compose_config(overrides("none")).model, torch.device("cpu"))
    from safetensors.torch import load_file

    stored = load_file(str(exported[0] / "model.safetensors"))
    embed = "model.embed_tokens.weight"
    torch.testing.assert_close(stored[embed], base.get_parameter(embed).detach() + SHIFT, rtol=0, atol=1e-6)
