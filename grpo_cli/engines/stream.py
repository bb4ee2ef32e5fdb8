"""Decoding as a stream of rows (sync=async): rows join and leave between decode steps, and new weights can be
applied between two steps while rows are half sampled.

`sample()` of the batch engines takes a batch and returns it whole; the asynchronous generator
(rollout/async_generation.py) instead keeps a pool of rows in flight: a group ships as soon as its G rows have
ended, new prompts' rows join the ones still running (continuous batching), and a weight update lands between two
steps (`sync.partial_rollouts`). Every sampled token is recorded with the policy version of the forward that gave
its logits and its log-prob under the sampler's softmax(logits / T) over the whole vocabulary (the behaviour
policy of that token), so the learner can weigh each token by pi_prox / pi_behav (decoupled PPO).

After an update the keys/values of the tokens sampled so far are those of the old weights. `recompute` (the
default, exact) prefills every running row's prompt and tokens again under the new weights, which also gives the
next-token logits under them: the first token sampled after the update comes from the new weights and every token
from then on is sampled exactly from the version it records. `keep` (cheaper) keeps the cache: the token whose
logits were computed before the update is recorded with the old version, the ones after with the new version,
their logits computed over keys/values partly of the old weights (what they were sampled from; recorded as is).

Engines: `HFDecodeStream` (the transformers decode loop's model calls, one row per sequence) and vLLM's offline
engine step loop (engines/vllm_stream.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

import grpo_cli.engines.hf_internals as hf_internals
from grpo_cli.config.schemas import KV_AFTER_UPDATE
from grpo_cli.engines.base import SamplingSettings
from grpo_cli.engines.decode import STOP_CHECK_EVERY, Decoder, cache_length, left_pad
from grpo_cli.engines.sampling import sample_next_tokens, sampler_log_probs
from grpo_cli.engines.stopping import stop_length

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class StreamRow:
    """One completion in flight: its prompt, what it sampled so far with each token's log-prob and version."""

    key: tuple[int, int, int]  # (batch number, prompt index within the batch, completion index)
    prompt_ids: list[int]
    max_tokens: int  # its limit: rollout.max_tokens, or what the model's context leaves after the prompt
    seed: int  # its random stream's seed (engines.sampling.completion_seed): the same in every engine
    generator: torch.Generator | None = None  # the transformers loop's stream (built from `seed` at the first step)
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    ended: bool = False
    stopped: bool = False  # ended on EOS or a stop string (else at max_tokens: truncated)
    context_limited: bool = False  # max_tokens was the context's room, below rollout.max_tokens

    @property
    def partial(self) -> bool:
        """Sampled by more than one policy version."""
        return len(set(self.versions)) > 1


@dataclass
class StreamCounters:
    """What the stream spent, for the step's metrics (read and reset by the generator)."""

    row_steps: int = 0  # rows x decode steps run
    wasted_row_steps: int = 0  # of them on rows already ended (they stay in the batch until it is rebuilt)
    prefill_s: float = 0.0
    recompute_s: float = 0.0  # prefills of running rows' tokens again after an update (kv=recompute)
    decode_s: float = 0.0
    rows_joined: int = 0  # rows that joined a running batch in an ended row's place (no rebuild)


class DecodeStream(Protocol):
    """Rows join with `add`, each `step` samples one token of every running row; `updated` says the weights
    changed in place (between two steps)."""

    version: int  # the policy version of the weights the engine holds now
    counters: StreamCounters

    def add(self, rows: Sequence[StreamRow]) -> None: ...

    def room(self) -> int:
        """How many rows to add now: 0 while the running batch is worth finishing first."""
        ...

    def running(self) -> int:
        """Rows added and not ended."""
        ...

    def step(self) -> list[StreamRow]:
        """One token of every running row; returns the rows that ended with it."""
        ...

    def updated(self, version: int, kv: str) -> None:
        """The weights were just changed in place to `version`; `kv`: one of KV_AFTER_UPDATE."""
        ...


def row_ended(
    row: StreamRow, eos_ids: set[int], tokenizer: PreTrainedTokenizerBase, settings: SamplingSettings
) -> bool:
    """Whether `row` has just ended: EOS, a stop string that counts (engines.stopping, vLLM's rule; looked for every
    STOP_CHECK_EVERY tokens, as the decode loop does) or its limit. Cuts what follows a stop string (kept, as the
    engines' cut_completion keeps it)."""
    if row.token_ids[-1] in eos_ids:
        row.ended = row.stopped = True
    elif settings.stop and (len(row.token_ids) % STOP_CHECK_EVERY == 0 or len(row.token_ids) >= row.max_tokens):
        length = stop_length(tokenizer, row.token_ids, settings.stop, settings.min_tokens)
        if length is not None:
            del row.token_ids[length:], row.log_probs[length:], row.versions[length:]
            row.ended = row.stopped = True
    if not row.ended and len(row.token_ids) >= row.max_tokens:
        row.ended = True
    return row.ended


class HFDecodeStream:
    """The transformers engine as a stream: each running row is one sequence of a left-padded batch; the batch is
    rebuilt (its rows' prompts and tokens prefilled) when rows joined, when half of it has ended, and after an
    update with kv=recompute; between rebuilds each step is one model call of the decode loop (`Decoder`)."""

    def __init__(self, decoder: Decoder, settings: SamplingSettings, capacity: int, version: int = 0) -> None:
        self.decoder = decoder
        self.settings = settings
        self.capacity = capacity
        self.version = version
        self.counters = StreamCounters()
        self.rows: list[StreamRow] = []  # the built batch, ended rows included until the next rebuild
        self.waiting: list[StreamRow] = []  # added, not in the batch yet
        self.stale = False  # an update with kv=recompute: rebuild before the next step
        self.logits: torch.Tensor | None = None  # (B, V), the next token's, row r's from a forward of version
        self.logits_versions: list[int] = []  # logits_versions[r]
        self.static = False  # the built batch runs on a static cache: rows can join into ended rows' places
        self.eos_ids = set(decoder.eos_ids)
        self.eos = torch.tensor(decoder.eos_ids, dtype=torch.long, device=decoder.device)

    def add(self, rows: Sequence[StreamRow]) -> None:
        for row in rows:
            if row.generator is None:
                row.generator = torch.Generator(device=self.decoder.device)
                row.generator.manual_seed(row.seed)
        self.waiting.extend(rows)

    def running(self) -> int:
        return sum(not row.ended for row in self.rows) + len(self.waiting)

    def room(self) -> int:
        live = self.running()
        if self.static and live:
            # Rows join into ended rows' places (prefilling only themselves), and past the batch's rows at the
            # next rebuild.
            free = sum(row.ended for row in self.rows) + self.capacity - len(self.rows)
            return max(0, free - len(self.waiting))
        # Rows join at a rebuild, which prefills every running row again: only once half the batch has ended.
        if self.rows and live > len(self.rows) // 2 and not self.waiting:
            return 0
        return max(0, self.capacity - live)

    def updated(self, version: int, kv: str) -> None:
        if kv not in KV_AFTER_UPDATE:
            raise ValueError(f"kv={kv!r}: one of {list(KV_AFTER_UPDATE)}")
        self.version = version
        if kv == "recompute" and any(not row.ended for row in self.rows):
            self.stale = True  # the logits in hand and the cache are the old weights'

    @torch.no_grad()
    def _rebuild(self) -> None:
        """Prefill every running row (prompt + tokens so far) under the weights held now: a fresh cache and the
        next token's logits."""
        started = time.perf_counter()
        recompute = self.stale
        self.rows = [row for row in self.rows if not row.ended] + self.waiting
        self.waiting = []
        self.stale = False
        if not self.rows:
            self.logits = None
            return
        d = self.decoder
        if d.compile:
            # A compiled step (CUDA graphs) is captured per shape: pad the batch to `capacity` rows with ended rows so
            # that joining and ending rows never change it (the padding counts as wasted row-steps).
            self.rows += [self._padding_row() for _ in range(self.capacity - len(self.rows))]
        prefixes = [row.prompt_ids + row.token_ids for row in self.rows]
        input_ids, prefix_mask = left_pad(prefixes, d.pad_id)
        input_ids, prefix_mask = input_ids.to(d.device), prefix_mask.to(d.device)
        self.width = input_ids.shape[1]
        positions = (prefix_mask.cumsum(-1) - 1).clamp_min_(0)
        prefix = hf_internals.new_dynamic_cache(d.config)
        self.logits = d._forward(input_ids, positions, prefix_mask, prefix)  # (B, V)
        self.logits_versions = [self.version] * len(self.rows)
        left = max(row.max_tokens - len(row.token_ids) for row in self.rows)
        limit = getattr(d.config, "max_position_embeddings", None)
        # A static cache has room for rows that join later with a whole completion still to sample.
        self.length = (
            cache_length(self.width + left + self.settings.max_tokens, limit) if d.static else self.width + left
        )
        self.cache, self.static = d._decode_cache(prefix, 1, self.width, self.length)
        self.mask = d._step_mask(prefix_mask, self.length)
        self.sliced = not self.static or (d.grouped_attention and not d.compile)
        self.next_positions = prefix_mask.sum(-1, keepdim=True)  # (B, 1)
        self.filled = 0  # decode positions written after the prefix
        seconds = time.perf_counter() - started
        if recompute:
            self.counters.recompute_s += seconds
        else:
            self.counters.prefill_s += seconds

    def _padding_row(self) -> StreamRow:
        row = StreamRow((-1, -1, -1), [self.decoder.pad_id], 0, 0, ended=True)
        row.generator = torch.Generator(device=self.decoder.device)
        return row

    @torch.no_grad()
    def _join(self) -> None:
        """Waiting rows into ended rows' places of the running static batch: only they are prefilled (left-padded to
        the batch's current column, so that they decode in step with it), their keys/values copied into their
        rows of the cache, their masks, positions and next-token logits set. Rows that do not fit (a prefix longer
        than the column, a completion past the cache) wait for the next rebuild."""
        d = self.decoder
        column = self.width + self.filled  # where every row's next token goes
        free = [i for i, row in enumerate(self.rows) if row.ended]
        joining: list[StreamRow] = []
        kept: list[StreamRow] = []
        slots: list[int] = []
        for row in self.waiting:
            fits = len(row.prompt_ids) + len(row.token_ids) <= column
            fits = fits and column + row.max_tokens - len(row.token_ids) <= self.length
            if fits and len(slots) < len(free):
                joining.append(row)
                slots.append(free[len(slots)])
            else:
                kept.append(row)
        if not joining:
            return
        started = time.perf_counter()
        # Each distinct prefix once (a new group's G rows share their prompt), left-padded to the longest of them
        # only, and placed so that it ends in the batch's last filled column.
        prefixes = [tuple(row.prompt_ids + row.token_ids) for row in joining]
        distinct = list(dict.fromkeys(prefixes))
        input_ids, prefix_mask = left_pad([list(p) for p in distinct], d.pad_id)
        input_ids, prefix_mask = input_ids.to(d.device), prefix_mask.to(d.device)
        width = input_ids.shape[1]
        positions = (prefix_mask.cumsum(-1) - 1).clamp_min_(0)
        prefix = hf_internals.new_dynamic_cache(d.config)
        distinct_logits = d._forward(input_ids, positions, prefix_mask, prefix)  # (distinct, V)
        sources = torch.tensor([distinct.index(p) for p in prefixes], dtype=torch.long, device=d.device)
        index = torch.tensor(slots, dtype=torch.long, device=d.device)
        if not hf_internals.copy_rows_into_static(self.cache, prefix, sources, index, column - width):
            self.static = False  # not the plain layer kinds: rows join at rebuilds instead
            return
        logits, prefix_mask = distinct_logits[sources], prefix_mask[sources]
        self.waiting = kept
        assert self.logits is not None
        self.logits[index] = logits.to(self.logits.dtype)
        start = column - width
        if d.grouped_attention:
            self.mask[index] = float("-inf")
            self.mask[index, 0, 0, start:column] = torch.zeros_like(prefix_mask, dtype=self.mask.dtype).masked_fill_(
                prefix_mask == 0, float("-inf")
            )
        else:
            self.mask[index] = 0
            self.mask[index, start:column] = prefix_mask.to(self.mask.dtype)
        self.next_positions[index] = prefix_mask.sum(-1, keepdim=True)
        for slot, row in zip(slots, joining, strict=True):
            self.rows[slot] = row
            self.logits_versions[slot] = self.version
        self.counters.rows_joined += len(joining)
        self.counters.prefill_s += time.perf_counter() - started

    @torch.no_grad()
    def step(self) -> list[StreamRow]:
        live = sum(not row.ended for row in self.rows)
        if self.waiting and self.static and not self.stale and self.logits is not None:
            self._join()
        mostly_ended = self.rows and live <= len(self.rows) // (4 if self.static else 2)
        if self.waiting and mostly_ended or self.stale or self.logits is None:
            self._rebuild()
        elif mostly_ended and not self.decoder.compile:
            self._rebuild()  # fewer rows per step from here on (a compiled step keeps its one shape)
        if not self.rows or self.logits is None:
            return []
        started = time.perf_counter()
        d, settings = self.decoder, self.settings
        logits = self.logits
        log_softmax = sampler_log_probs(logits, settings.temperature)  # (B, V) before any masking
        early = [i for i, row in enumerate(self.rows) if len(row.token_ids) < settings.min_tokens]
        if early:
            logits[torch.tensor(early, device=logits.device).unsqueeze(1), self.eos.unsqueeze(0)] = float("-inf")
        generators = [row.generator for row in self.rows] if settings.temperature > 0 else []
        next_tokens = sample_next_tokens(logits, settings.temperature, settings.top_p, generators)  # type: ignore[arg-type]
        token_log_probs = log_softmax.gather(-1, next_tokens.unsqueeze(-1)).squeeze(-1).tolist()
        ended_now = []
        for i, (row, token, log_prob) in enumerate(zip(self.rows, next_tokens.tolist(), token_log_probs, strict=True)):
            self.counters.row_steps += 1
            if row.ended:
                self.counters.wasted_row_steps += 1
                continue
            row.token_ids.append(token)
            row.log_probs.append(log_prob)
            row.versions.append(self.logits_versions[i])
            if row_ended(row, self.eos_ids, d.tokenizer, settings):
                ended_now.append(row)
        if all(row.ended for row in self.rows) or self.filled + self.width >= self.length:
            self.logits = None  # nothing left to decode in this batch: the next step rebuilds
        else:
            column = self.width + self.filled
            skinny = d.model if d.device.type == "cpu" and not d.compile else None
            with hf_internals.decode_scope(d.config, d.grouped_attention, skinny):
                if d.grouped_attention:
                    self.mask[:, :, :, column] = 0.0
                else:
                    self.mask[:, column] = 1
                visible = self.mask[..., : column + 1] if self.sliced else self.mask
                rows = len(self.rows)
                self.logits = d._decode_step(next_tokens.view(rows, 1), self.next_positions, visible, self.cache)
            self.logits_versions = [self.version] * rows
            self.next_positions += 1
            self.filled += 1
        self.counters.decode_s += time.perf_counter() - started
        return ended_now
