"""Everything a model-loading job can check without loading a model: a bad data file, model path or missing
extra (vLLM, TensorBoard) must fail in a second, not after a minute of loading. Then run_info.json is written."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from grpo_cli.errors import UserFacingError
from grpo_cli.models import check_model_source, check_quantization
from grpo_cli.models.runtime import pure_half_precision_warning, resolve_device
from grpo_cli.tasks import load_eval_sets, load_examples
from grpo_cli.tasks.multiturn import agent_value
from grpo_cli.tracking.run_info import build_run_info, write_run_info

if TYPE_CHECKING:
    from grpo_cli.config.schemas import GRPOConfig
    from grpo_cli.tasks.base import Example


def preflight(cfg: GRPOConfig, splits: tuple[str, ...], output_dir: Path, overrides: list[str]) -> list[str]:
    """Raise UserFacingError for what cannot work; return warning lines for what works worse than it could (and
    for a damaged run_info.json that was rewritten)."""
    warnings: list[str | None] = []
    check_model_source(cfg.model.name_or_path)
    check_quantization(cfg.model.quantization, resolve_device(cfg.model.device))
    if cfg.rollout.engine == "vllm":
        from grpo_cli.engines.vllm_engine import require_vllm

        require_vllm()
    if cfg.logger.backend == "tensorboard":
        from grpo_cli.tracking.tensorboard_sink import require_tensorboard

        require_tensorboard()
    if agent_value(cfg.task) is not None:
        from grpo_cli.endpoint.server import require_endpoint

        require_endpoint()
    check_tools_in_workers(cfg)
    examples = load_splits(cfg, splits)
    if "eval" in splits:
        load_eval_sets(cfg.task)  # a bad file or split of task.eval_sets fails here, before the model loads
    check_devices_for_ranks(cfg)
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank runs this; one run_info.json is written
        repaired = write_run_info(output_dir, build_run_info(cfg, examples, overrides), resumed=bool(cfg.resume))
        warnings.append(repaired)
    warnings.append(pure_half_precision_warning(cfg.model.dtype))
    return [warning for warning in warnings if warning is not None]


def load_splits(cfg: GRPOConfig, splits: tuple[str, ...]) -> dict[str, list[Example]]:
    """Every split's examples. The splits that cannot load are said together in one line (offline, task=math's
    train and test splits both need the hub: one run, one line, not a second run to find the second)."""
    examples, failures = {}, []
    for split in splits:
        try:
            examples[split] = load_examples(cfg.task, split)
        except UserFacingError as e:
            failures.append(e)
    if len(failures) == 1:
        raise failures[0]
    if failures:
        raise UserFacingError("; ".join(str(e) for e in failures))
    return examples


def check_tools_in_workers(cfg: GRPOConfig) -> None:
    """task.tools, each loaded in a worker process as its calls will be (episodes/tools.py): a tool that cannot run
    there is one line now, not an error at the first call after the model loaded."""
    from grpo_cli.episodes.config import base_dir_of_task, tool_specs

    specs = tool_specs(cfg.task)
    if not specs or not cfg.task.reward_workers:
        return
    from grpo_cli.episodes.tools import check_tools_load_in_worker, load_tools

    check_tools_load_in_worker(load_tools(specs, base_dir_of_task(cfg.task)))


def check_devices_for_ranks(cfg: GRPOConfig) -> None:
    """On CUDA each rank of a node takes one GPU: more ranks per node than GPUs is a one-line error; so is NCCL
    (GPU-to-GPU only) for ranks on the CPU."""
    d = cfg.distributed
    if d.strategy == "none":
        return
    device = resolve_device(cfg.model.device)
    if device.type != "cuda":
        if d.backend == "nccl":
            raise UserFacingError(
                f"distributed.backend=nccl connects GPUs, and the ranks run on {device.type} "
                f"(model.device={cfg.model.device}): use distributed.backend=gloo (or auto)"
            )
        return
    import torch

    available = torch.cuda.device_count()
    if d.nproc_per_node > available:
        raise UserFacingError(
            f"distributed.nproc_per_node={d.nproc_per_node} ranks need as many GPUs on each node, and this node "
            f"has {available}: use distributed.nproc_per_node={available}"
        )
