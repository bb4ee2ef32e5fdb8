"""What every model and tokenizer we load goes through: the `from_pretrained` arguments (dtype, GGUF
dequantization) and the fix-ups after loading (a pad token distinct from EOS, special tokens the model agrees
with). Used by both the embedded model's cache build and ordinary loading."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import PreTrainedModel, PreTrainedTokenizerBase

# Tokens that are conventionally unused padding, in order of preference. A pad token distinct from EOS
# matters to us: code that masks `ids != pad_token_id` would otherwise also drop the EOS the policy must learn
# to emit, and the embedding row of `config.pad_token_id` gets no gradient through the input embedding.
_PAD_CANDIDATES = ("<|endoftext|>", "<|finetune_right_pad_id|>", "<|pad|>", "<pad>", "[PAD]")


def dtype_kwargs(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """transformers renamed `torch_dtype` to `dtype` in 4.56 and warns about the old name since."""
    if Version(transformers.__version__) >= Version("4.56"):
        return {"dtype": dtype}
    return {"torch_dtype": dtype}


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> None:
    """Give `tokenizer` a pad token, preferring an existing unused token distinct from EOS.

    SmolLM2-Instruct pads with its EOS `<|im_end|>`; we switch it to `<|endoftext|>` (see `_PAD_CANDIDATES`).
    Only when the vocabulary has no such token do we fall back to padding with EOS.
    """
    if tokenizer.pad_token is not None and tokenizer.pad_token_id != tokenizer.eos_token_id:
        return
    vocabulary = tokenizer.get_vocab()
    for candidate in _PAD_CANDIDATES:
        if candidate in vocabulary and candidate != tokenizer.eos_token:
            tokenizer.pad_token = candidate
            return
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token


def align_special_tokens(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Make the model's pad and stop tokens agree with the tokenizer's.

    The pad token may have been changed by `ensure_pad_token`, and `generate` must stop on the tokenizer's
    EOS (for a chat model the end-of-turn token) whatever else the checkpoint's generation config lists.
    """
    model.config.pad_token_id = tokenizer.pad_token_id
    generation = model.generation_config
    generation.pad_token_id = tokenizer.pad_token_id
    stops = generation.eos_token_id
    stops = [] if stops is None else [stops] if isinstance(stops, int) else list(stops)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stops:
        stops.append(tokenizer.eos_token_id)
    generation.eos_token_id = stops[0] if len(stops) == 1 else stops


def dequantizing_gguf_kwargs(gguf_file: str) -> dict[str, Any]:
    """`from_pretrained` arguments that load a GGUF file as a plain dense (trainable) model.

    Recent transformers keep GGUF weights packed when a matmul kernel is available; packed weights cannot be
    trained or saved, so we ask for dequantization explicitly where that option exists (older versions always
    dequantize).
    """
    kwargs: dict[str, Any] = {"gguf_file": gguf_file}
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None:
        kwargs["quantization_config"] = gguf_config(dequantize=True)
    return kwargs


def drop_quantization_config(model: PreTrainedModel) -> None:
    """Forget that `model` came from a GGUF file, so it saves and reloads as an ordinary checkpoint."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    elif hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
