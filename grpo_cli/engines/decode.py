"""Sampling loop of the transformers engine: one prefill, then one model call per token, nothing else per token.

The loop reaches into transformers internals (its caches, its attention tables); every such use lives in
`engines.hf_internals`, whose `fast_path_problem` decides whether this loop runs at all. Where it does not, the
engine samples through `model.generate` with the same sampling (`engines.hf_generate`).

What transformers' generate() did per token and this loop does not:

- a KV cache that grows by concatenation (a copy of every layer's keys and values per token): here a static cache
  (`transformers.StaticCache`) sized once per (rows, length bucket) and reused across calls;
- logits processors, stopping criteria and stop-string matching every token: EOS is checked on the sampled ids,
  stop strings (those that count past min_tokens, `engines.stopping`) every STOP_CHECK_EVERY tokens (the
  completion is cut at its first such stop string afterwards anyway, `engines.hf.cut_completion`, so checking
  late only decodes a few tokens more);
- a prefill per completion: each distinct prompt is prefilled once and its keys/values copied to its n rows;
- GQA keys/values repeated to every query head in every layer (transformers' sdpa path copies the whole cache
  twice per layer per token): for supported architectures `decode_attention` attends with the query heads
  grouped instead, and only over the positions filled so far;
- sampling from the global RNG: `engines.sampling` draws each completion from its own stream.

The decode step is `torch.compile`d where that pays (`compile_decode`): its shapes are static (rows, cache bucket),
so prompt lengths do not cause recompiles. Shapes: P prompts, n completions each, B = P * n rows, W the padded
prompt width, L the cache length (W + max_tokens rounded up to CACHE_BUCKET), V the vocabulary.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

import grpo_cli.engines.hf_internals as hf_internals
from grpo_cli.engines.base import SamplingSettings
from grpo_cli.engines.hf_internals import SKINNY_ROWS, SkinnyLinear  # noqa: F401 - re-exported (job=benchmark)
from grpo_cli.engines.sampling import row_generators, sample_next_tokens, sampler_log_probs, suppress_tokens_
from grpo_cli.engines.stopping import stopped

if TYPE_CHECKING:
    from transformers import Cache, DynamicCache, PreTrainedTokenizerBase, StaticCache

log = logging.getLogger(__name__)

# Cache lengths are rounded up to a multiple of this, so that prompts of different lengths reuse one cache (and
# one compiled graph).
CACHE_BUCKET = 64
# Static caches kept per engine (training rows and evaluation rows differ; more would only hold memory).
CACHES_KEPT = 2
STOP_CHECK_EVERY = 8
# Architectures whose attention the loop replaces by hf_internals.decode_attention under sdpa.
GROUPED_ATTENTION_MODEL_TYPES = hf_internals.FAST_PATH_MODEL_TYPES


@dataclass
class Sampled:
    """What a decoder returns: each row's sampled ids (up to where the batch stopped) and, per id, its log-prob
    under the sampler's softmax(logits / T) over the whole vocabulary (greedy: softmax(logits)), taken before
    top-p truncation and before min_tokens holds EOS back, i.e. the policy's own log-prob at that temperature."""

    token_ids: list[list[int]]  # (B, steps)
    log_probs: list[list[float]]  # (B, steps)


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


@dataclass
class DecodeTimings:
    """Seconds of the last call, by phase (the benchmark prints them)."""

    prefill_s: float = 0.0
    forward_s: float = 0.0  # decode steps' model calls
    sampling_s: float = 0.0
    steps: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class Decoder:
    """Samples completions from a transformers causal LM (peft-wrapped or not) with the loop described above.

    Only for models `hf_internals.fast_path_problem` accepts; `make_decoder` picks this or the generate() one.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        eos_ids: set[int],
        compile_setting: str = "auto",
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = sorted(eos_ids)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.config = hf_internals.base_model(model).config
        self.device = next(model.parameters()).device
        self.cache_keyword = hf_internals.cache_keyword(model)
        self.static = hf_internals.can_compile_fullgraph(model)
        self.grouped_attention = (
            hf_internals.configured_attention(model) == "sdpa"
            and getattr(self.config, "model_type", None) in GROUPED_ATTENTION_MODEL_TYPES
        )
        self.compile = self.static and resolve_compile(compile_setting, self.device)
        self._compiled: Callable | None = None
        self._caches: OrderedDict[tuple[int, int, torch.dtype, int, int], StaticCache] = OrderedDict()
        self.timings = DecodeTimings()

    # --- one model call -----------------------------------------------------------------------------------
    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Cache
    ) -> torch.Tensor:
        """Logits of the last position: (B, V)."""
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=mask,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_keyword: cache},
        )
        return out.logits[:, -1]

    def _decode_step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Cache
    ) -> torch.Tensor:
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
            cache = hf_internals.new_static_cache(self.config, rows, length, like)
        self._caches[key] = cache
        return cache

    def forget_caches(self) -> None:
        """Drop the static caches kept for reuse (their memory goes back)."""
        self._caches.clear()

    def _decode_cache(self, prefix: DynamicCache, n: int, width: int, length: int) -> tuple[Cache, bool]:
        """The cache the decode steps run on, holding the prefill's keys/values repeated to n rows per prompt.

        Returns (cache, static). Static when the model allows it and both caches have the plain layer types whose
        tensors can be copied; otherwise the prefill's own dynamic cache, repeated in place.
        """
        keys = hf_internals.prefill_keys(prefix)
        # Under bf16 autocast the prefill's keys (after the fp32 rotary embedding) and a decode step's differ in
        # dtype: a static cache copies into one dtype and refuses, the dynamic cache concatenates with promotion.
        autocast = keys is not None and torch.is_autocast_enabled(keys.device.type)
        if self.static and not autocast and keys is not None:
            cache = self._static_cache(len(keys) * n, length, keys)
            if hf_internals.copy_prefill_into_static(cache, prefix, n, width):
                return cache, True
        return hf_internals.repeat_dynamic(prefix, n), False

    # --- the loop -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, prompt_ids: list[list[int]], settings: SamplingSettings) -> Sampled:
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
        prefix = hf_internals.new_dynamic_cache(self.config)
        logits = self._forward(input_ids, positions, prompt_mask, prefix).repeat_interleave(n, 0)  # (B, V)

        generators = []
        if settings.temperature > 0:
            generators = row_generators(
                settings.seed, settings.first_prompt_index, len(prompt_ids), n, device, settings.prompt_indices
            )
        eos = torch.tensor(self.eos_ids, dtype=torch.long, device=device)
        limit = getattr(self.config, "max_position_embeddings", None)
        length = cache_length(width + max_tokens, limit) if self.static else width + max_tokens
        cache, static = self._decode_cache(prefix, n, width, length)
        mask = self._step_mask(prompt_mask.repeat_interleave(n, 0), length)  # (B, 1, 1, L) or (B, L)
        # Slice the mask to the filled positions where shapes may change (eager); a compiled step sees all L.
        sliced = not static or (self.grouped_attention and not self.compile)
        next_positions = prompt_mask.sum(-1, keepdim=True).repeat_interleave(n, 0)  # (B, 1)
        tokens = torch.full((rows, max_tokens), self.pad_id, dtype=torch.long, device=device)  # (B, T)
        log_probs = torch.zeros((rows, max_tokens), dtype=torch.float32, device=device)  # (B, T)
        ended = torch.zeros(rows, dtype=torch.bool, device=device)
        self.timings = DecodeTimings(prefill_s=time.perf_counter() - started)

        steps = 0
        skinny = self.model if self.device.type == "cpu" and not self.compile else None
        with hf_internals.decode_scope(self.config, self.grouped_attention, skinny):
            for step in range(max_tokens):
                sampled_at = time.perf_counter()
                log_softmax = sampler_log_probs(logits, settings.temperature)  # (B, V), before any masking
                if step < settings.min_tokens:
                    suppress_tokens_(logits, eos)
                next_tokens = sample_next_tokens(logits, settings.temperature, settings.top_p, generators)  # (B,)
                tokens[:, step] = next_tokens
                log_probs[:, step] = log_softmax.gather(-1, next_tokens.unsqueeze(-1)).squeeze(-1)
                ended |= torch.isin(next_tokens, eos)
                steps = step + 1
                if settings.stop and (steps % STOP_CHECK_EVERY == 0 or steps == max_tokens):
                    ended |= self._stopped(tokens[:, :steps], ended, settings.stop, settings.min_tokens)
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
        return Sampled(tokens[:, :steps].tolist(), log_probs[:, :steps].tolist())

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

    def _stopped(
        self, tokens: torch.Tensor, ended: torch.Tensor, stop: tuple[str, ...], min_tokens: int
    ) -> torch.Tensor:
        """(B,) True for rows not yet ended whose text holds a stop string that counts (`engines.stopping`)."""
        hit = torch.zeros_like(ended)
        for row in (~ended).nonzero().flatten().tolist():
            hit[row] = stopped(self.tokenizer, tokens[row].tolist(), stop, min_tokens)
        return hit
