"""Everything a model-loading job can check without loading a model: a bad data file, model path or missing
extra (vLLM, TensorBoard) must fail in a second, not after a minute of loading. Then run_info.json is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpo_cli.models import check_model_source, check_quantization
from grpo_cli.runtime import resolve_device
from grpo_cli.tasks import load_examples
from grpo_cli.tracking.run_info import build_run_info, write_run_info


def preflight(cfg: Any, splits: tuple[str, ...], output_dir: Path, overrides: list[str]) -> None:
    check_model_source(cfg.model.name_or_path)
    check_quantization(cfg.model.quantization, resolve_device(cfg.model.device))
    if cfg.rollout.engine == "vllm":
        from grpo_cli.rollout.vllm_engine import require_vllm

        require_vllm()
    if cfg.logger.backend == "tensorboard":
        from grpo_cli.tracking.tensorboard_sink import require_tensorboard

        require_tensorboard()
    examples = {split: load_examples(cfg.task, split) for split in splits}
    write_run_info(output_dir, build_run_info(cfg, examples, overrides), resumed=bool(cfg.resume))
