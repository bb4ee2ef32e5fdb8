"""Rollouts on the policy model itself (so there are no weights to sync): by the decode loop of `rollout.decode`
where `rollout.hf_internals` supports the model and the installed transformers, else by `model.generate` with the
same sampling (`rollout.hf_generate`), said in one log line."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

import grpo_cli.rollout.hf_internals as hf_internals
from grpo_cli.rollout.base import RolloutBatch, SamplingSettings
from grpo_cli.rollout.decode import Decoder
from grpo_cli.rollout.hf_generate import GenerateDecoder

log = logging.getLogger(__name__)
_FALLBACKS_LOGGED: set[str] = set()  # each reason once per process (training and evaluation engines share it)


def make_decoder(model, tokenizer, eos_ids: set[int], compile: str = "auto") -> Decoder | GenerateDecoder:
    """The decode loop where it supports `model` here, else generate() with the loop's sampling (one log line)."""
    device = next(model.parameters()).device
    problem = hf_internals.fast_path_problem(model, device)
    if problem is None:
        return Decoder(model, tokenizer, eos_ids, compile_setting=compile)
    if problem not in _FALLBACKS_LOGGED:
        _FALLBACKS_LOGGED.add(problem)
        log.warning("rollout: %s; sampling with transformers' generate() instead (same samples, slower)", problem)
    return GenerateDecoder(model, tokenizer, eos_ids)


def cut_completion(ids: list[int], eos_ids: set[int], stop: tuple[str, ...], tokenizer) -> tuple[list[int], bool]:
    """Cut sampled ids after the first EOS token or the first completed stop string (both kept).

    Returns (ids, finished); finished is False when neither occurred (the completion was truncated).
    Whatever a row sampled after its end (the batch decodes on until every row has ended) is dropped here.
    """
    for i, token in enumerate(ids):
        if token in eos_ids:
            ids, eos_at = ids[: i + 1], i
            break
    else:
        eos_at = None
    if stop:
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if any(s in text for s in stop):
            # Decoded text grows with the prefix, so the shortest prefix holding a stop string is found by
            # bisection instead of decoding every prefix.
            lo, hi = 1, len(ids)
            while lo < hi:
                mid = (lo + hi) // 2
                prefix = tokenizer.decode(ids[:mid], skip_special_tokens=False)
                if any(s in prefix for s in stop):
                    hi = mid
                else:
                    lo = mid + 1
            return ids[:lo], True
    return ids, eos_at is not None


class HFRolloutEngine:
    """Batched sampling on the policy itself with the static-cache loop of `rollout.decode` (n completions per
    prompt from one prefill) or its generate() fallback, each completion from its own random stream
    (`rollout.sampling`), with the sampler's log-prob of every sampled token."""

    def __init__(self, model, tokenizer, max_batch_prompts: int | None = None, compile: str = "auto") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_prompts = max_batch_prompts
        eos = model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = {int(e) for e in eos if e is not None} | {tokenizer.eos_token_id}
        # Sampling reads SamplingSettings alone: nothing of the checkpoint's generation_config (repetition_penalty,
        # top_k, ...) reaches the loop, so completions come from the distribution the trainer scores.
        self.decoder = make_decoder(model, tokenizer, self.eos_ids, compile=compile)

    def sync_weights(self, version: int | None = None) -> dict[str, float]:
        return {"time/sync_s": 0.0}  # the loop runs on the trained model itself

    def close(self) -> None:
        self.model = None
        self.decoder = None

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], settings: SamplingSettings) -> RolloutBatch:
        chunk = self.max_batch_prompts or len(prompt_ids)
        out = RolloutBatch([], [], [], [], sampler_log_probs=[])
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(prompt_ids), chunk):
                # Each completion's stream depends on its prompt's index in the step, so chunks change nothing.
                part_settings = replace(settings, first_prompt_index=settings.first_prompt_index + start)
                part = self._generate_chunk(prompt_ids[start : start + chunk], part_settings)
                for field in ("prompt_ids", "completion_ids", "texts", "truncated", "sampler_log_probs"):
                    getattr(out, field).extend(getattr(part, field))
        finally:
            self.model.train(was_training)
        return out

    def _generate_chunk(self, prompt_ids: list[list[int]], settings: SamplingSettings) -> RolloutBatch:
        sampled = self.decoder.sample(prompt_ids, settings)
        batch = RolloutBatch([], [], [], [], sampler_log_probs=[])
        for row, (ids, log_probs) in enumerate(zip(sampled.token_ids, sampled.log_probs, strict=True)):
            ids, finished = cut_completion(ids, self.eos_ids, settings.stop, self.tokenizer)
            batch.prompt_ids.append(prompt_ids[row // settings.n])
            batch.completion_ids.append(ids)
            batch.sampler_log_probs.append(log_probs[: len(ids)])
            batch.texts.append(self.tokenizer.decode(ids, skip_special_tokens=True))
            batch.truncated.append(not finished)
        return batch
