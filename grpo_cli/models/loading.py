"""Loading the policy model and its tokenizer from what `model.name_or_path` names (`grpo_cli.models.sources`),
with LoRA adapters, quantization, gradient checkpointing and the pad token every sampler relies on."""

from __future__ import annotations

import importlib.util
import logging
import warnings
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from grpo_cli.errors import ModelLoadError
from grpo_cli.models.embedded import EMBEDDED_SMOLLM2, TINY_RANDOM, load_from_embedded_cache
from grpo_cli.models.pretrained import (
    align_special_tokens,
    dequantizing_gguf_kwargs,
    drop_quantization_config,
    dtype_kwargs,
    ensure_pad_token,
)
from grpo_cli.models.runtime import resolve_dtype
from grpo_cli.models.sources import Source, hub_unavailable_message, resolve_source

if TYPE_CHECKING:
    from grpo_cli.config.schemas import ModelConfig

logger = logging.getLogger(__name__)


def _load_error(name_or_path: str, source: Source, error: Exception) -> ModelLoadError:
    """Turn an exception from `from_pretrained` into a one-line user-facing error.

    Broken or foreign files surface from transformers as OSError, ValueError, KeyError, JSON or safetensors
    errors and more, so callers catch every Exception here; the type and first 300 characters of the original
    message are kept so that a genuine bug is still recognisable.
    """
    if source.is_hub_id and isinstance(error, OSError):
        return ModelLoadError(hub_unavailable_message(name_or_path))
    detail = " ".join(str(error).split())[:300]
    return ModelLoadError(
        f"could not load model.name_or_path={name_or_path!r} ({type(error).__name__}: {detail}): "
        "check that it is a complete causal language model in Hugging Face or GGUF format"
    )


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """Load the tokenizer for `name_or_path`, with left padding and a pad token.

    Left padding lines up the ends of a batch of prompts, which is what batched generation needs.
    """
    source = resolve_source(name_or_path)
    try:
        if name_or_path in (EMBEDDED_SMOLLM2, TINY_RANDOM):
            tokenizer = load_from_embedded_cache(AutoTokenizer.from_pretrained)
        else:
            tokenizer = AutoTokenizer.from_pretrained(source.location, gguf_file=source.gguf_file)
    except Exception as error:  # see _load_error: any failure here means "cannot load this model"
        raise _load_error(name_or_path, source, error) from None
    ensure_pad_token(tokenizer)
    tokenizer.padding_side = "left"
    return tokenizer


def _build_tiny_random(
    tokenizer: PreTrainedTokenizerBase, seed: int, attn_implementation: str | None
) -> LlamaForCausalLM:
    """A 2-layer, 64-wide Llama over the SmolLM2 vocabulary, initialised from `seed` alone."""
    # attn_implementation goes through the config's **kwargs, which transformers 5's typed signature does not list.
    attention: dict[str, Any] = {"attn_implementation": attn_implementation}
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        # head_dim 32: the smallest head size vLLM's CPU attention kernels accept (rollout=vllm tests use it).
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **attention,
    )
    # fork_rng: the weights depend on `seed` only, and the caller's global RNG stream is left untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.config._name_or_path = TINY_RANDOM
    model.name_or_path = TINY_RANDOM
    return model


def _load_pretrained(
    name_or_path: str,
    source: Source,
    dtype: torch.dtype,
    attn_implementation: str | None,
    extra_kwargs: dict[str, Any] | None = None,
) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained` with our error messages; GGUF weights come out dequantized."""
    kwargs: dict[str, Any] = {**dtype_kwargs(dtype), **(extra_kwargs or {})}
    if source.gguf_file is not None:
        kwargs.update(dequantizing_gguf_kwargs(source.gguf_file))
    if attn_implementation is not None:  # None lets transformers pick (sdpa wherever the model supports it)
        kwargs["attn_implementation"] = attn_implementation
    try:
        if name_or_path == EMBEDDED_SMOLLM2:
            model = load_from_embedded_cache(lambda location: AutoModelForCausalLM.from_pretrained(location, **kwargs))
        else:
            model = AutoModelForCausalLM.from_pretrained(source.location, **kwargs)
    except Exception as error:  # see _load_error
        raise _load_error(name_or_path, source, error) from None
    drop_quantization_config(model)
    return model


def _enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Recompute activations in the backward pass; the KV cache is useless (and warned about) in training."""
    kwargs = {"use_reentrant": False}  # the reentrant variant needs inputs that require grad
    enable = getattr(model, "activation_checkpointing_enable", None)  # the name since transformers 5.x
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def load_policy(
    name_or_path: str,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    gradient_checkpointing: bool = False,
    attn_implementation: str | None = None,
    quantization: str = "none",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the policy model and its tokenizer, on `device` in `dtype`, in eval mode (the trainer switches).

    Args:
        name_or_path: any form listed in the module docstring.
        device, dtype: from `grpo_cli.models.runtime.resolve_device` / `resolve_dtype`.
        seed: initialises the weights of `TINY_RANDOM`; pretrained weights ignore it.
        gradient_checkpointing: trade compute for activation memory (and turn off the KV cache).
        attn_implementation: e.g. "sdpa" or "eager"; None lets transformers choose (sdpa where supported).

    Raises:
        ModelLoadError: with a one-line message naming `name_or_path` and the fix.
    """
    tokenizer = load_tokenizer(name_or_path)
    model: PreTrainedModel
    if name_or_path == TINY_RANDOM:
        try:
            model = _build_tiny_random(tokenizer, seed, attn_implementation)
        except ValueError as error:  # an attention implementation this model cannot use
            raise ModelLoadError(f"model.attn_implementation={attn_implementation!r}: {error}") from None
    else:
        model = _load_pretrained(
            name_or_path, resolve_source(name_or_path), dtype, attn_implementation, quantization_kwargs(quantization)
        )
    align_special_tokens(model, tokenizer)
    if quantization == "none":  # bitsandbytes places 4-bit weights itself and refuses .to()
        # PreTrainedModel.to (what runs) is wrapped by a decorator that mypy cannot call through: typed as Module's.
        cast(torch.nn.Module, model).to(device=device, dtype=dtype)
    if gradient_checkpointing:
        _enable_gradient_checkpointing(model)
    model.eval()
    return model, tokenizer


def check_quantization(quantization: str, device: torch.device) -> None:
    """4-bit loading needs CUDA and bitsandbytes: say so before anything loads."""
    if quantization == "none":
        return
    if device.type != "cuda":
        raise ModelLoadError(
            f"model.quantization={quantization} (QLoRA) needs a CUDA GPU, and this run is on {device.type}: "
            "drop model.quantization or run on a GPU machine"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ModelLoadError(f"model.quantization={quantization} needs bitsandbytes: pip install bitsandbytes")


def quantization_kwargs(quantization: str) -> dict[str, Any]:
    """from_pretrained arguments for 4-bit NF4 base weights with bf16 compute (the QLoRA recipe)."""
    if quantization == "none":
        return {}
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    return {"quantization_config": config}


def apply_lora(
    model: PreTrainedModel, r: int, alpha: int, dropout: float, target_modules: list[str], quantized: bool = False
) -> torch.nn.Module:
    """Wrap `model` with trainable LoRA adapters (peft); every base weight is frozen.

    Adapters start as an exact no-op (LoRA's B matrix is zero), so the wrapped model's outputs equal the base
    model's until the first update.
    """
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if quantized:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules), task_type="CAUSAL_LM"
    )
    try:
        with warnings.catch_warnings():
            # peft asks transformers 5 for `is_gradient_checkpointing`, which warns that the name is deprecated
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return get_peft_model(model, config)
    except ValueError as error:  # e.g. target modules that the model does not have
        raise ModelLoadError(f"model.lora.target_modules={list(target_modules)}: {error}") from None


def build_policy(model_cfg: ModelConfig, device: torch.device) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """The policy exactly as `model.*` describes it (dtype, quantization, LoRA adapters, gradient checkpointing)
    and its tokenizer: the one loading path of every job, so none of them can ignore a model option."""
    check_quantization(model_cfg.quantization, device)
    model, tokenizer = load_policy(
        model_cfg.name_or_path,
        device,
        resolve_dtype(model_cfg.dtype, device),
        seed=model_cfg.init_seed,
        gradient_checkpointing=model_cfg.gradient_checkpointing,
        quantization=model_cfg.quantization,
    )
    lora = model_cfg.lora
    if not lora.enabled:
        return model, tokenizer
    quantized = model_cfg.quantization != "none"
    return apply_lora(model, lora.r, lora.alpha, lora.dropout, lora.target_modules, quantized=quantized), tokenizer
