"""Every use of transformers internals by the decode loop (`engines.decode`), behind one support check.

The decode loop is fast because it reaches below transformers' public API: it fills a `StaticCache`'s layers by
hand (`StaticLayer.keys`, `.cumulative_length`, `early_initialization`), repeats a `DynamicCache`'s rows in place,
swaps `config._attn_implementation` to an attention function of its own for the decode steps, and rewrites
the linear layers' forward on few rows (`skinny_linears`). None of that is a stable API: transformers 4.57's
`StaticLayer` has no `cumulative_length`, and any release may change the rest. So:

- `fast_path_problem(model)` says, before any sampling, why the loop cannot run this model here (a transformers
  older than the loop's floor, an internal missing, an architecture, adapter, quantized layer, attention
  implementation or device it was not checked on) or None when it may. Where it cannot, the HF engine samples
  through `model.generate` instead (`engines.hf_generate`): same samples, slower.
- There is no upper bound on transformers: whether the loop is right under the installed release, whatever it
  is, is checked on the loaded model against `generate()` before the loop samples anything
  (`engines.loop_check`), and the engine takes `generate()` where it is not.
- Nothing here is imported from transformers at import time, and nothing is registered in transformers'
  global tables at import time: `decode_scope` adds the decode attention function for the duration of the decode
  steps only and removes it afterwards.

Tested (tests/unit/engines/test_decode.py, greedy tokens equal to `generate`'s): Llama (tied and untied
embeddings, Llama 3
rope scaling), Qwen2 (qkv bias), Qwen3, Mistral without a sliding window, each also under LoRA; Gemma 2 and any
sliding-window layer go to `generate`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
import transformers
from packaging.version import Version
from torch.overrides import TorchFunctionMode

from grpo_cli.core import causal_lm

if TYPE_CHECKING:
    from transformers import DynamicCache, PretrainedConfig, PreTrainedModel, StaticCache
    from transformers.generation.utils import GenerateOutput

log = logging.getLogger(__name__)

# The oldest transformers release the decode loop runs on (older ones lack internals it uses, and will not change).
# Newer releases, published or not, are not listed: the loop is checked on the loaded model (engines.loop_check).
FAST_PATH_MIN_TRANSFORMERS = Version("5.16")
# Architectures whose greedy tokens on the loop equal generate()'s (tests/unit/engines/test_decode.py, one test
# each), and
# whose attention calls the attention interface with (query, key, value, mask, scaling, dropout) only, so
# decode_attention computes exactly what sdpa would.
FAST_PATH_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})
# Attention implementations the loop was checked with (others, e.g. flash attention, keep generate()).
FAST_PATH_ATTENTION = frozenset({"sdpa", "eager"})
DECODE_ATTENTION = "grpo_cli_decode"
# Extra attention arguments that change the math (logit soft-capping, sinks, sliding windows, ALiBi-style bias).
_UNSUPPORTED_ATTENTION_KWARGS = ("softcap", "s_aux", "sinks", "sliding_window", "position_bias", "head_mask")


def transformers_version() -> Version:
    return Version(transformers.__version__)


def base_model(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers model inside a peft wrapper (the model itself otherwise)."""
    get_base_model = getattr(model, "get_base_model", None)
    # The policy is a transformers model, in a peft wrapper when LoRA is on (grpo_cli.models.loading).
    return cast("PreTrainedModel", get_base_model() if get_base_model is not None else model)


def generate(model: torch.nn.Module, **kwargs: Any) -> GenerateOutput | torch.LongTensor:
    """`model.generate(**kwargs)`: transformers' own, or a peft wrapper's, which forwards to it (nn.Module's
    attribute typing cannot see either)."""
    generate_fn = cast("Callable[..., GenerateOutput | torch.LongTensor]", model.generate)
    return generate_fn(**kwargs)


def _missing_internal() -> str | None:
    """The first internal the loop needs that the installed transformers lacks, or None."""
    try:
        from transformers import DynamicCache, StaticCache  # noqa: F401
        from transformers.cache_utils import DynamicLayer, StaticLayer  # noqa: F401
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: F401
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask  # noqa: F401
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: F401
    except ImportError as error:
        return f"an import ({error})"
    if not hasattr(StaticCache, "early_initialization"):
        return "StaticCache.early_initialization"
    if not hasattr(DynamicCache, "batch_repeat_interleave"):
        return "DynamicCache.batch_repeat_interleave"
    return None


def _sliding_window(config: PretrainedConfig) -> bool:
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    return layer_types != {"full_attention"} or getattr(config, "sliding_window", None) is not None


def _quantized(model: torch.nn.Module) -> bool:
    base = base_model(model)
    if getattr(base, "is_quantized", False) or getattr(base, "hf_quantizer", None) is not None:
        return True
    return any(hasattr(getattr(module, "weight", None), "quant_state") for module in base.modules())


def _adapter_problem(model: torch.nn.Module) -> str | None:
    """peft adapters other than plain LoRA (prompt tuning, DoRA, ...) were not checked against generate()."""
    for name, adapter in (getattr(model, "peft_config", None) or {}).items():
        kind = str(getattr(getattr(adapter, "peft_type", None), "value", getattr(adapter, "peft_type", None)))
        if kind != "LORA" or getattr(adapter, "use_dora", False):
            return f"the peft adapter {name!r} ({kind}{', DoRA' if getattr(adapter, 'use_dora', False) else ''})"
    return None


def fast_path_problem(model: torch.nn.Module, device: torch.device) -> str | None:
    """Why the decode loop cannot sample from `model` here, in a few words; None when it can.

    The model's own reasons come first (they hold whatever transformers is installed), then the installed
    transformers'."""
    config = base_model(model).config
    model_type = getattr(config, "model_type", None)
    if model_type not in FAST_PATH_MODEL_TYPES:
        return f"the architecture {model_type!r} was not checked against generate()"
    if _sliding_window(config):
        return f"{model_type} with sliding-window attention was not checked against generate()"
    attention = getattr(config, "_attn_implementation", None)
    if attention not in FAST_PATH_ATTENTION:
        return f"the attention implementation {attention!r} was not checked"
    if _quantized(model):
        return "quantized (4-bit/8-bit) layers were not checked"
    adapter = _adapter_problem(model)
    if adapter is not None:
        return f"{adapter} was not checked"
    if device.type not in ("cpu", "cuda"):
        return f"the device {device.type} was not checked"
    version = transformers_version()
    if Version(version.base_version) < FAST_PATH_MIN_TRANSFORMERS:
        return f"transformers {version} is older than the decode loop's floor ({FAST_PATH_MIN_TRANSFORMERS})"
    missing = _missing_internal()
    return None if missing is None else f"transformers {version} lacks {missing}"


# --- caches ------------------------------------------------------------------------------------------------------


def cache_keyword(model: torch.nn.Module) -> str:
    """The forward keyword that takes the KV cache, read from the transformers model inside a peft wrapper
    (`cache` from transformers 5.24, `past_key_values` before): core.causal_lm.cache_keyword, the one choice
    the shared-prompt forward makes too."""
    return causal_lm.cache_keyword(base_model(model))


def can_compile_fullgraph(model: torch.nn.Module) -> bool:
    """Whether the model declares itself compilable with a static cache (transformers' own flag)."""
    return bool(getattr(base_model(model), "_can_compile_fullgraph", False))


def new_dynamic_cache(config: PretrainedConfig) -> DynamicCache:
    from transformers import DynamicCache

    return DynamicCache(config=config)


def new_static_cache(config: PretrainedConfig, rows: int, length: int, like: torch.Tensor) -> StaticCache:
    """A static cache of `rows` x `length` positions, allocated now in `like`'s dtype/device and head shape."""
    from transformers import StaticCache

    cache = StaticCache(config=config, max_cache_len=length)
    cache.early_initialization(rows, like.shape[1], like.shape[-1], like.dtype, like.device)
    return cache


def prefill_keys(prefix: DynamicCache) -> torch.Tensor | None:
    """The first layer's keys (P, Hkv, W, D) of a prefilled dynamic cache, None if it has no plain layers."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(prefix, "layers", None)
    if not layers or not all(type(layer) is DynamicLayer for layer in layers):
        return None
    return layers[0].keys


# Any: a StaticCache and a DynamicCache, whose layers transformers types as a union of kinds; the type() checks
# below admit only the plain kinds whose keys and values this copies.
def copy_prefill_into_static(static: Any, prefix: Any, n: int, width: int) -> bool:
    """Copy a prefill's keys/values (P prompts) into rows p*n .. p*n+n-1 of a static cache's first `width`
    positions, and mark those positions filled. False (nothing copied) when the layers are not the plain kinds."""
    from transformers.cache_utils import StaticLayer

    if len(static.layers) != len(prefix.layers) or not all(type(layer) is StaticLayer for layer in static.layers):
        return False
    for target, source in zip(static.layers, prefix.layers, strict=True):
        # (P, Hkv, W, D) -> rows p*n .. p*n+n-1 of the first W positions, without a repeated temporary.
        target.keys[:, :, :width].unflatten(0, (-1, n)).copy_(source.keys.unsqueeze(1))
        target.values[:, :, :width].unflatten(0, (-1, n)).copy_(source.values.unsqueeze(1))
        target.cumulative_length.fill_(width)
    return True


def copy_rows_into_static(static: Any, prefix: Any, sources: torch.Tensor, rows: torch.Tensor, start: int) -> bool:
    """Copy a prefill's keys/values (its sequences `sources` (n,), W positions each) into rows `rows` (n,) of a
    static cache at positions [start, start + W), leaving its other rows and its filled length as they are (rows
    joining a running batch, their last prefix token in the batch's last filled column). False (nothing copied)
    when the layers are not the plain kinds."""
    from transformers.cache_utils import DynamicLayer, StaticLayer

    if len(static.layers) != len(prefix.layers) or not all(type(layer) is StaticLayer for layer in static.layers):
        return False
    if not all(type(layer) is DynamicLayer for layer in prefix.layers):
        return False
    for target, source in zip(static.layers, prefix.layers, strict=True):
        width = source.keys.shape[2]
        target.keys[rows, :, start : start + width] = source.keys[sources].to(target.keys.dtype)
        target.values[rows, :, start : start + width] = source.values[sources].to(target.values.dtype)
    return True


def repeat_dynamic(prefix: DynamicCache, n: int) -> DynamicCache:
    """The prefill's dynamic cache with each prompt's row repeated n times (prompt-major), in place."""
    prefix.batch_repeat_interleave(n)
    return prefix


# --- the decode steps' attention -----------------------------------------------------------------------------------


def decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of one new token per row against the cache, query heads grouped by their key/value head.

    query (B, Hq, 1, D); key, value (B, Hkv, L, D), the whole static cache; attention_mask (B, 1, 1, l) additive,
    l <= L the positions that may be attended (the loop passes only those filled so far, so the rest of the cache
    is not read). Returns (B, 1, Hq, D) like transformers' sdpa_attention_forward. Anything else (prefill, masks
    transformers built, extra arguments) goes to sdpa_attention_forward unchanged.

    transformers' sdpa path repeats the GQA keys/values to every query head (a copy of the whole cache per layer
    per token); grouping the query heads instead reads each key/value head once.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = not any(kwargs.get(name) is not None for name in _UNSUPPORTED_ATTENTION_KWARGS)
    if query.shape[2] != 1 or attention_mask is None or attention_mask.dtype == torch.bool or dropout or not plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    rows, kv_heads, _, dim = key.shape
    length = attention_mask.shape[-1]
    key, value = key[:, :, :length], value[:, :, :length]  # (B, Hkv, l, D) views
    groups = query.shape[1] // kv_heads
    # Query head h reads key/value head h // groups (transformers' repeat_kv order), so (Hq,) -> (Hkv, groups).
    grouped = query.view(rows, kv_heads, groups, dim)  # (B, Hkv, G, D)
    scale = dim**-0.5 if scaling is None else scaling
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float().mul_(scale)  # (B, Hkv, G, l)
    scores.add_(attention_mask)  # (B, 1, 1, l) broadcasts over heads and groups
    weights = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(weights, value)  # (B, Hkv, G, D)
    return out.view(rows, kv_heads * groups, 1, dim).transpose(1, 2), None


def configured_attention(model: torch.nn.Module) -> str | None:
    return getattr(base_model(model).config, "_attn_implementation", None)


@contextmanager
def decode_scope(config: PretrainedConfig, grouped_attention: bool, skinny: torch.nn.Module | None) -> Iterator[None]:
    """The decode steps' setting, undone on exit: with `grouped_attention`, `decode_attention` is added to the
    attention tables under DECODE_ATTENTION and the config switched to it; with a `skinny` model, its linear
    layers run `skinny_linear` (`skinny_linears`).

    The tables are transformers' process-wide ones, so the entry exists only while the steps run: nothing else
    (a training forward, another library) ever sees it.
    """
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    configured = config._attn_implementation
    if grouped_attention:
        ALL_ATTENTION_FUNCTIONS[DECODE_ATTENTION] = decode_attention
        # The mask function is only reached for masks transformers builds itself; the loop passes its own.
        ALL_MASK_ATTENTION_FUNCTIONS[DECODE_ATTENTION] = sdpa_mask
        config._attn_implementation = DECODE_ATTENTION
    try:
        if skinny is not None:
            with skinny_linears(skinny):
                yield
        else:
            yield
    finally:
        if grouped_attention:
            config._attn_implementation = configured
            for table in (ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS):
                if DECODE_ATTENTION in table._local_mapping:
                    del table[DECODE_ATTENTION]


# A decode step's linear layers multiply a few rows by each weight. On the CPU, (W @ x^T)^T computes the same
# product 1.3-1.9x faster than x @ W^T (what F.linear runs) for such shapes: measured on the 2-core AMD EPYC,
# 16 rows of SmolLM2-135M, 36 -> 21 ms for the 49k-vocabulary head and 49 -> 36 ms for the decoder's layers per
# decode step. Row counts above this limit keep F.linear (a prefill, a large batch).
SKINNY_ROWS = 64


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); on at most SKINNY_ROWS rows (CPU, no autograd) computed as (W @ x^T)^T, the same
    product up to float rounding by the faster kernel."""
    rows = x.numel() // max(x.shape[-1], 1)
    if (
        weight.dim() == 2
        and x.device.type == "cpu"
        and rows <= SKINNY_ROWS
        and weight.dtype == x.dtype
        and not torch.is_grad_enabled()
    ):
        out = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t()
        if bias is not None:
            out = out + bias
        return out.contiguous().view(*x.shape[:-1], weight.shape[0])
    return torch.nn.functional.linear(x, weight, bias)


@contextmanager
def skinny_linears(model: torch.nn.Module) -> Iterator[None]:
    """While active, every plain ``nn.Linear`` of `model` runs `skinny_linear` (its forward set on the instance,
    removed on exit). Only the linear layers pay for the check: the SkinnyLinear mode, which did this before,
    intercepted every torch call of a decode step in Python to find them (~5,500 per token on SmolLM2-135M,
    1,900 of them tensor attribute reads; docs/results/2026-12-06-step-profile.md)."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear and "forward" not in m.__dict__]
    for linear in linears:
        linear.forward = _skinny_forward(linear)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        for linear in linears:
            del linear.forward


def _skinny_forward(linear: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, linear.weight, linear.bias)

    return forward


class SkinnyLinear(TorchFunctionMode):
    """While active, F.linear calls run `skinny_linear`; every other call runs unchanged. For timing bare linear
    calls (job=benchmark's matmul floor); the decode loop uses `skinny_linears`, which costs nothing per other
    call."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            return skinny_linear(*args, **kwargs)
        return func(*args, **kwargs)
