"""The policy model: what `model.name_or_path` names (`sources`), the embedded default's cache (`embedded`),
loading with LoRA and quantization (`loading`), and where and in what precision it runs (`runtime`).

The names below are the package's public API (`from grpo_cli.models import load_policy`).
"""

from grpo_cli.errors import ModelLoadError
from grpo_cli.models.embedded import EMBEDDED_SMOLLM2, TINY_RANDOM, embedded_model_dir
from grpo_cli.models.loading import (
    apply_lora,
    build_policy,
    check_quantization,
    load_policy,
    load_tokenizer,
    quantization_kwargs,
)
from grpo_cli.models.sources import check_model_source

__all__ = [
    "EMBEDDED_SMOLLM2",
    "TINY_RANDOM",
    "ModelLoadError",
    "apply_lora",
    "build_policy",
    "check_model_source",
    "check_quantization",
    "embedded_model_dir",
    "load_policy",
    "load_tokenizer",
    "quantization_kwargs",
]
