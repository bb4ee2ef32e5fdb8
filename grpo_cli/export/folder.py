"""A trained policy written as a Hugging Face model folder: config.json, generation_config.json, the tokenizer and
chat template the run used, and safetensors weights (sharded at `max_shard_size`, a tied head stored once as
transformers expects), in the base model's dtype unless told otherwise.

Three layouts: the full model (full fine-tuning), the LoRA adapters merged into the base (a plain model of the
base's architecture), or the adapter alone in PEFT's format (adapter_config.json naming the base's hub id). The
merged weights are `engines.vllm_engine.export_weights`' (each adapter's delta added on the fly, the same tensors
the vLLM engine receives). The folder is written beside its destination and renamed into place: a kill halfway
leaves the previous folder, never half of one.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from grpo_cli.errors import UserFacingError

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

    from grpo_cli.config.schemas import ModelConfig

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
# The files that mark a folder as an exported model (one a previous export wrote, safe to replace).
MODEL_MARKERS = ("config.json", "adapter_config.json")


@dataclass(frozen=True)
class Layout:
    """How the weights are written: "full", "merged" (LoRA merged into the base) or "adapter" (PEFT's format),
    with the one line that says why when the adapter was merged though not asked to be."""

    kind: str
    note: str | None = None


def is_hub_name(name_or_path: str) -> bool:
    """Whether `model.name_or_path` is a hub id (org/name), by its form alone: nothing here touches the network (a
    built-in model, an existing path or a GGUF file is not one)."""
    from grpo_cli.models import EMBEDDED_SMOLLM2, TINY_RANDOM

    if name_or_path in (EMBEDDED_SMOLLM2, TINY_RANDOM) or Path(name_or_path).expanduser().exists():
        return False
    return _HUB_ID.fullmatch(name_or_path) is not None


def base_dtype(model_cfg: ModelConfig) -> torch.dtype:
    """The dtype the base model is published in: its config's `dtype` (`torch_dtype` before transformers 4.56).
    float32 for the embedded default (dequantized from its GGUF into float32), model=tiny_random, a GGUF file, and a
    config that names none or cannot be read."""
    from transformers import AutoConfig

    name = model_cfg.name_or_path
    local = Path(name).expanduser()
    if not is_hub_name(name) and not (local.is_dir() and (local / "config.json").is_file()):
        return torch.float32  # built-in, a GGUF file or a folder holding one: dequantized to float32
    try:
        config = AutoConfig.from_pretrained(str(local) if local.is_dir() else name)  # the run loaded it: cached
    except (OSError, ValueError):
        return torch.float32
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(named, str):
        named = getattr(torch, named, None)
    return named if isinstance(named, torch.dtype) and named.is_floating_point else torch.float32


def export_dtype(choice: str, model_cfg: ModelConfig) -> torch.dtype:
    """export.dtype: auto is the base's own dtype (runs train in float32; a bfloat16 base must not come out twice
    its size), else the dtype named."""
    return base_dtype(model_cfg) if choice == "auto" else cast(torch.dtype, getattr(torch, choice))


def hub_base(model_cfg: ModelConfig) -> str | None:
    """The base's hub id when it has one (what an unmerged adapter can name so that it loads elsewhere)."""
    return model_cfg.name_or_path if is_hub_name(model_cfg.name_or_path) else None


def layout_for(model_cfg: ModelConfig, merge_lora: bool) -> Layout:
    """Full fine-tuning: the full model. LoRA: merged when asked, or when the base has no hub id to name (the
    embedded default, model=tiny_random, a local folder or GGUF file: an adapter over it would name a path of this
    machine, or nothing); else the adapter in PEFT's format."""
    if not model_cfg.lora.enabled:
        return Layout("full")
    if merge_lora:
        return Layout("merged")
    if hub_base(model_cfg) is None:
        return Layout(
            "merged",
            f"the LoRA adapter is written merged into its base: the base {model_cfg.name_or_path} has no hub id an "
            "adapter could name elsewhere (export.merge_lora=true says the same)",
        )
    return Layout("adapter")


def prepare_out(out: Path) -> None:
    """Refuse to replace a folder that holds something other than an exported model (one line)."""
    if out.exists() and (
        not out.is_dir() or (any(out.iterdir()) and not any((out / m).exists() for m in MODEL_MARKERS))
    ):
        raise UserFacingError(
            f"export.out={out} exists and holds something other than an exported model: give a new folder (an "
            "earlier export's folder is replaced)"
        )


def write_model(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    out: Path,
    layout: Layout,
    dtype: torch.dtype,
    max_shard_size: str,
    generation: GenerationConfig,
    hub_id: str | None = None,
) -> None:
    """Write the policy as `layout` says into `out` (replacing an earlier export there), weights in `dtype`."""
    prepare_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if layout.kind == "adapter":
            _write_adapter(model, tokenizer, temp, dtype, generation, hub_id)
        else:
            plain = _plain_model(model, dtype) if layout.kind == "merged" else cast("PreTrainedModel", model.to(dtype))
            plain.generation_config = generation
            _write_skeleton(plain, tokenizer, temp)
            with _no_progress_bar():
                plain.save_pretrained(temp, max_shard_size=max_shard_size)  # safetensors: 4.57's and 5.x's default
        readable_by_older_transformers(temp)
        # mkdtemp and safetensors make private files; a model folder is for others to read (and serve).
        for path in [temp, *temp.iterdir()]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        _replace(temp, out)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    """transformers' "Writing model shards" bar: the export says its one line itself."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _write_skeleton(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    from grpo_cli.engines.vllm_engine import write_model_skeleton

    write_model_skeleton(model, tokenizer, directory)


def _plain_model(model: torch.nn.Module, dtype: torch.dtype) -> PreTrainedModel:
    """The base architecture holding the merged weights (no peft layers, no quantization): built on the meta
    device, then given export_weights' tensors cast to `dtype` (merged in the trained dtype first)."""
    from transformers import AutoModelForCausalLM

    from grpo_cli.engines.hf_internals import base_model
    from grpo_cli.engines.vllm_engine import export_weights
    from grpo_cli.models.pretrained import dtype_kwargs

    config = copy.deepcopy(base_model(model).config)
    if hasattr(config, "quantization_config"):  # QLoRA: the merged weights are dequantized, a plain model
        del config.quantization_config
    tensors = {name: tensor.detach().to("cpu", dtype) for name, tensor in export_weights(model)}
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, **dtype_kwargs(dtype))
    expected = set(plain.state_dict())
    plain.load_state_dict({name: tensors[name] for name in expected if name in tensors}, strict=True, assign=True)
    plain.tie_weights()
    plain.generation_config = copy.deepcopy(base_model(model).generation_config)
    return plain


def _write_adapter(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    directory: Path,
    dtype: torch.dtype,
    generation: GenerationConfig,
    hub_id: str | None,
) -> None:
    """PEFT's own format: adapter_config.json (naming `hub_id`, the base to load it against) and
    adapter_model.safetensors, plus the tokenizer and generation config the run used (no config.json: a folder
    with one would be read as a whole model)."""
    from peft import PeftModel

    peft_model = cast(PeftModel, model.to(dtype))
    for config in peft_model.peft_config.values():
        config.base_model_name_or_path = hub_id
    peft_model.save_pretrained(str(directory))
    tokenizer.save_pretrained(directory)
    generation.save_pretrained(directory)


def readable_by_older_transformers(directory: Path) -> None:
    """The folder as transformers 4.57 (the lowest version grpo-cli supports) reads it too, when 5.x wrote it.

    5.x names its tokenizer class `TokenizersBackend`, which 4.57 refuses to load, where `PreTrainedTokenizerFast`
    (the same tokenizer.json) loads in both; and it keeps the rotary base only in `rope_parameters`, which 4.57 does
    not read: it would silently use its default rope_theta (10000, where SmolLM2's is 100000) and compute another
    model. The legacy `rope_theta` / `rope_scaling` keys beside it are read by 4.57 and agree with 5.x's."""
    tokenizer_config = directory / "tokenizer_config.json"
    if tokenizer_config.is_file():
        saved = json.loads(tokenizer_config.read_text())
        if saved.get("tokenizer_class") == "TokenizersBackend":
            saved["tokenizer_class"] = "PreTrainedTokenizerFast"
        for leaked in ("is_local", "local_files_only"):  # loading arguments 5.x writes back; no tokenizer setting
            saved.pop(leaked, None)
        tokenizer_config.write_text(json.dumps(saved, indent=2, ensure_ascii=False) + "\n")
    config_file = directory / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        rope = config.get("rope_parameters")
        if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in config:
            config["rope_theta"] = rope["rope_theta"]
            if rope.get("rope_type", "default") != "default" and config.get("rope_scaling") is None:
                config["rope_scaling"] = {key: value for key, value in rope.items() if key != "rope_theta"}
            config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _replace(temp: Path, out: Path) -> None:
    """`temp` renamed to `out`; an earlier export at `out` moved aside first and removed after."""
    aside = None
    if out.exists():
        aside = out.with_name(f".{out.name}.old-{os.getpid()}")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(out, aside)
    os.replace(temp, out)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
