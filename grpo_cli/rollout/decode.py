"""Sampling loop of the transformers engine: one prefill, then one model call per token, nothing else per token.

What transformers' generate() did per token and this loop does not:

- a KV cache that grows by concatenation (a copy of every layer's keys and values per token): here a static cache
  (`transformers.StaticCache`) sized once per (rows, length bucket) and reused across calls;
- logits processors, stopping criteria and stop-string matching every token: EOS is checked on the sampled ids,
  stop strings every STOP_CHECK_EVERY tokens (the completion is cut at its first stop string afterwards anyway,
  `rollout.hf.cut_completion`, so checking late only decodes a few tokens more);
- a prefill per completion: each distinct prompt is prefilled once and its keys/values copied to its n rows;
- GQA keys/values repeated to every query head in every layer (transformers' sdpa path copies the whole cache
  twice per layer per token): for supported architectures `decode_attention` attends with the query heads
  grouped instead, and only over the positions filled so far;
- sampling from the global RNG: `rollout.sampling` draws each completion from its own stream.

The decode step is `torch.compile`d where that pays (`compile_decode`): its shapes are static (rows, cache bucket),
so prompt lengths do not cause recompiles. Shapes: P prompts, n completions each, B = P * n rows, W the padded
prompt width, L the cache length (W + max_tokens rounded up to CACHE_BUCKET), V the vocabulary.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from grpo_cli.rollout.base import SamplingSettings
from grpo_cli.rollout.sampling import row_generators, sample_next_tokens, suppress_tokens_

log = logging.getLogger(__name__)

# Cache lengths are rounded up to a multiple of this, so that prompts of different lengths reuse one cache (and
# one compiled graph).
CACHE_BUCKET = 64
# Static caches kept per engine (training rows and evaluation rows differ; more would only hold memory).
CACHES_KEPT = 2
STOP_CHECK_EVERY = 8
DECODE_ATTENTION = "grpo_cli_decode"
# Architectures whose attention calls the interface with (query, key, value, mask, scaling, dropout) only, so
# decode_attention computes exactly what sdpa would. Others keep transformers' own attention.
GROUPED_ATTENTION_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})
# Extra attention arguments that change the math (logit soft-capping, sinks, sliding windows, ALiBi-style bias).
_UNSUPPORTED_ATTENTION_KWARGS = ("softcap", "s_aux", "sinks", "sliding_window", "position_bias", "head_mask")


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
    """
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


AttentionInterface.register(DECODE_ATTENTION, decode_attention)
AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)  # only reached for masks transformers builds itself


# A decode step's linear layers multiply a few rows by each weight. On the CPU, (W @ x^T)^T computes the same
# product 1.3-1.9x faster than x @ W^T (what F.linear runs) for such shapes: measured on the 2-core AMD EPYC,
# 16 rows of SmolLM2-135M, 36 -> 21 ms for the 49k-vocabulary head and 49 -> 36 ms for the decoder's layers per
# decode step. Row counts above this limit keep F.linear (a prefill, a large batch).
SKINNY_ROWS = 64


class SkinnyLinear(TorchFunctionMode):
    """While active, F.linear on at most SKINNY_ROWS rows (CPU, no autograd) runs as (W @ x^T)^T: the same
    product up to float rounding, computed by the faster kernel; every other call runs unchanged."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
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
        return func(*args, **kwargs)


@contextmanager
def attention_implementation(config: Any, name: str | None) -> Iterator[None]:
    """Run the model with another registered attention function, restoring the configured one afterwards."""
    if name is None:
        yield
        return
    configured = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = configured


def left_pad(prompt_ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts right-aligned in one (P, W) id tensor, and its (P, W) attention mask (1 on prompt tokens).

    Left padding puts every prompt's last token in the same column, so new tokens are appended in lockstep.
    """
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompt_ids):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        mask[row, width - len(ids) :] = 1
    return input_ids, mask


def cache_length(needed: int, limit: int | None) -> int:
    """`needed` rounded up to CACHE_BUCKET, but never beyond the model's position limit (when it has one)."""
    length = -(-needed // CACHE_BUCKET) * CACHE_BUCKET
    return max(needed, min(length, limit)) if limit else length


def resolve_compile(setting: str, device: torch.device) -> bool:
    """`rollout.compile`: always / never, or auto = on CUDA only.

    On the 2-core CPU this project measures on, a compiled decode step was no faster than eager (the step streams
    the weights through small matmuls either way) and compiling took minutes; on a GPU the eager step is bound by
    kernel launches, which compiling removes.
    """
    if setting == "auto":
        return device.type == "cuda"
    return setting == "always"


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps the HF model


def _all_full_attention(config: Any) -> bool:
    return set(getattr(config, "layer_types", None) or ["full_attention"]) == {"full_attention"}


@dataclass
class DecodeTimings:
    """Seconds of the last call, by phase (the benchmark prints them)."""

    prefill_s: float = 0.0
    forward_s: float = 0.0  # decode steps' model calls
    sampling_s: float = 0.0
    steps: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class Decoder:
    """Samples completions from a transformers causal LM (peft-wrapped or not) with the loop described above."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, eos_ids: set[int], compile_setting: str = "auto"):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = sorted(eos_ids)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        base = _base_model(model)
        self.config = base.config
        self.device = next(model.parameters()).device
        self.static = bool(getattr(base, "_can_compile_fullgraph", False)) and _all_full_attention(self.config)
        self.grouped_attention = (
            self.config._attn_implementation == "sdpa"
            and getattr(self.config, "model_type", None) in GROUPED_ATTENTION_MODEL_TYPES
            and _all_full_attention(self.config)
        )
        self.compile = self.static and resolve_compile(compile_setting, self.device)
        self._compiled: Callable | None = None
        self._caches: OrderedDict[tuple, StaticCache] = OrderedDict()
        self.timings = DecodeTimings()

    # --- one model call -----------------------------------------------------------------------------------
    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """Logits of the last position: (B, V)."""
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    def _decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any):
        if not self.compile:
            return self._forward(input_ids, positions, mask, cache)
        if self._compiled is None:
            # On CUDA the eager step is bound by kernel launches: CUDA graphs replay the whole step at once (the
            # static cache's tensors keep their addresses, as transformers' own compiled generation needs).
            mode = "reduce-overhead" if self.device.type == "cuda" else None
            self._compiled = torch.compile(self._forward, dynamic=False, fullgraph=False, mode=mode)
        try:
            return self._compiled(input_ids, positions, mask, cache).clone()
        except Exception as error:  # noqa: BLE001 - any compiler failure: decode eagerly instead
            # A failure is raised while tracing, before the step ran, so the cache is untouched.
            log.warning("rollout: torch.compile of the decode step failed (%s); decoding eagerly", type(error).__name__)
            self.compile = False
            return self._forward(input_ids, positions, mask, cache)

    # --- caches -------------------------------------------------------------------------------------------
    def _static_cache(self, rows: int, length: int, like: torch.Tensor) -> StaticCache:
        """A static cache of `rows` x `length` (reused: allocated once per shape, the CACHES_KEPT latest kept)."""
        key = (rows, length, like.dtype, like.shape[1], like.shape[-1])
        cache = self._caches.pop(key, None)
        if cache is None:
            while len(self._caches) >= CACHES_KEPT:
                self._caches.popitem(last=False)
            cache = StaticCache(config=self.config, max_cache_len=length)
            cache.early_initialization(rows, like.shape[1], like.shape[-1], like.dtype, like.device)
        self._caches[key] = cache
        return cache

    def _decode_cache(self, prefix: DynamicCache, n: int, width: int, length: int) -> tuple[Any, bool]:
        """The cache the decode steps run on, holding the prefill's keys/values repeated to n rows per prompt.

        Returns (cache, static). Static when the model allows it and both caches have the plain layer types whose
        tensors can be copied; otherwise the prefill's own dynamic cache, repeated in place.
        """
        layers = prefix.layers
        # Under bf16 autocast the prefill's keys (after the fp32 rotary embedding) and a decode step's differ in
        # dtype: a static cache copies into one dtype and refuses, the dynamic cache concatenates with promotion.
        autocast = bool(layers) and torch.is_autocast_enabled(layers[0].keys.device.type)
        if self.static and not autocast and layers and all(type(layer) is DynamicLayer for layer in layers):
            cache = self._static_cache(len(layers[0].keys) * n, length, layers[0].keys)
            if all(type(layer) is StaticLayer for layer in cache.layers) and len(cache.layers) == len(layers):
                for target, source in zip(cache.layers, layers, strict=True):
                    # (P, Hkv, W, D) -> rows p*n .. p*n+n-1 of the first W positions, without a repeated temporary.
                    target.keys[:, :, :width].unflatten(0, (-1, n)).copy_(source.keys.unsqueeze(1))
                    target.values[:, :, :width].unflatten(0, (-1, n)).copy_(source.values.unsqueeze(1))
                    target.cumulative_length.fill_(width)
                return cache, True
        prefix.batch_repeat_interleave(n)
        return prefix, False

    # --- the loop -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, prompt_ids: list[list[int]], settings: SamplingSettings) -> list[list[int]]:
        """Sampled ids of every completion (prompt-major rows), up to max_tokens or until every row has ended
        (EOS, or a stop string at the last check); tokens after a row's end are whatever it sampled on."""
        started = time.perf_counter()
        n, max_tokens = settings.n, settings.max_tokens
        input_ids, prompt_mask = left_pad(prompt_ids, self.pad_id)  # (P, W)
        rows, width = len(prompt_ids) * n, input_ids.shape[1]
        device = self.device
        input_ids, prompt_mask = input_ids.to(device), prompt_mask.to(device)
        # Each prompt token's position counts its prompt's tokens only (pads are invisible), as in generate().
        positions = (prompt_mask.cumsum(-1) - 1).clamp_min_(0)  # (P, W)
        prefix = DynamicCache(config=self.config)
        logits = self._forward(input_ids, positions, prompt_mask, prefix).repeat_interleave(n, 0)  # (B, V)

        generators = []
        if settings.temperature > 0:
            generators = row_generators(settings.seed, settings.first_prompt_index, len(prompt_ids), n, device)
        eos = torch.tensor(self.eos_ids, dtype=torch.long, device=device)
        limit = getattr(self.config, "max_position_embeddings", None)
        length = cache_length(width + max_tokens, limit) if self.static else width + max_tokens
        cache, static = self._decode_cache(prefix, n, width, length)
        mask = self._step_mask(prompt_mask.repeat_interleave(n, 0), length)  # (B, 1, 1, L) or (B, L)
        # Slice the mask to the filled positions where shapes may change (eager); a compiled step sees all L.
        sliced = not static or (self.grouped_attention and not self.compile)
        next_positions = prompt_mask.sum(-1, keepdim=True).repeat_interleave(n, 0)  # (B, 1)
        tokens = torch.full((rows, max_tokens), self.pad_id, dtype=torch.long, device=device)  # (B, T)
        ended = torch.zeros(rows, dtype=torch.bool, device=device)
        self.timings = DecodeTimings(prefill_s=time.perf_counter() - started)

        steps = 0
        skinny = SkinnyLinear() if self.device.type == "cpu" and not self.compile else contextlib.nullcontext()
        with attention_implementation(self.config, DECODE_ATTENTION if self.grouped_attention else None), skinny:
            for step in range(max_tokens):
                sampled_at = time.perf_counter()
                if step < settings.min_tokens:
                    suppress_tokens_(logits, eos)
                next_tokens = sample_next_tokens(logits, settings.temperature, settings.top_p, generators)  # (B,)
                tokens[:, step] = next_tokens
                ended |= torch.isin(next_tokens, eos)
                steps = step + 1
                if settings.stop and (steps % STOP_CHECK_EVERY == 0 or steps == max_tokens):
                    ended |= self._stopped(tokens[:, :steps], ended, settings.stop)
                self.timings.sampling_s += time.perf_counter() - sampled_at
                if steps == max_tokens or bool(ended.all()):
                    break
                called_at = time.perf_counter()
                if self.grouped_attention:
                    mask[:, :, :, width + step] = 0.0  # the position this token's keys/values go to
                else:
                    mask[:, width + step] = 1
                visible = mask[..., : width + step + 1] if sliced else mask
                logits = self._decode_step(next_tokens.view(rows, 1), next_positions, visible, cache)
                next_positions += 1
                self.timings.forward_s += time.perf_counter() - called_at
        self.timings.steps = steps
        return tokens[:, :steps].tolist()

    def _step_mask(self, prompt_mask: torch.Tensor, length: int) -> torch.Tensor:
        """The attention mask the decode steps update in place: (B, 1, 1, L) additive (0 attended, -inf not) for
        decode_attention, else transformers' (B, L) 0/1 padding mask. Generated positions open one per step."""
        rows, width = prompt_mask.shape
        if self.grouped_attention:
            mask = torch.full((rows, 1, 1, length), float("-inf"), device=prompt_mask.device)
            mask[:, 0, 0, :width].masked_fill_(prompt_mask.bool(), 0.0)
            return mask
        mask = torch.zeros((rows, length), dtype=prompt_mask.dtype, device=prompt_mask.device)
        mask[:, :width] = prompt_mask
        return mask

    def _stopped(self, tokens: torch.Tensor, ended: torch.Tensor, stop: tuple[str, ...]) -> torch.Tensor:
        """(B,) True for rows not yet ended whose text holds a stop string."""
        hit = torch.zeros_like(ended)
        for row in (~ended).nonzero().flatten().tolist():
            text = self.tokenizer.decode(tokens[row].tolist(), skip_special_tokens=False)
            hit[row] = any(s in text for s in stop)
        return hit
