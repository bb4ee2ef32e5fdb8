"""Rollouts with transformers `generate` on the policy model itself (so there are no weights to sync)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import GenerationConfig

from grpo_cli.rollout.base import RolloutBatch, SamplingSettings


@contextmanager
def _only_our_sampling_settings(model: torch.nn.Module) -> Iterator[None]:
    """Hide the checkpoint's generation_config while generate() runs.

    generate() fills every setting a call leaves unset from the model's generation_config (Qwen2.5-Instruct ships
    repetition_penalty, top_k, top_p, ...), so completions would come from another distribution than the one the
    trainer scores, and rollout=hf would train differently from rollout=vllm. A blank config leaves only what
    SamplingSettings says.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps the HF model
    shipped = base.generation_config
    base.generation_config = GenerationConfig(
        bos_token_id=shipped.bos_token_id, eos_token_id=shipped.eos_token_id, pad_token_id=shipped.pad_token_id
    )
    try:
        yield
    finally:
        base.generation_config = shipped


def cut_completion(ids: list[int], eos_ids: set[int], stop: tuple[str, ...], tokenizer) -> tuple[list[int], bool]:
    """Cut sampled ids after the first EOS token or the first completed stop string (both kept).

    Returns (ids, finished); finished is False when neither occurred (the completion was truncated).
    generate() pads rows that finished early, so everything after the cut point is padding.
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
    """Batched sampling with left padding; `n` completions per prompt via num_return_sequences."""

    def __init__(self, model, tokenizer, max_batch_prompts: int | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_prompts = max_batch_prompts
        eos = model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = {int(e) for e in eos if e is not None} | {tokenizer.eos_token_id}

    def sync_weights(self) -> dict[str, float]:
        return {"time/sync_s": 0.0}  # generate() runs on the trained model itself

    def close(self) -> None:
        self.model = None

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], settings: SamplingSettings) -> RolloutBatch:
        chunk = self.max_batch_prompts or len(prompt_ids)
        out = RolloutBatch([], [], [], [])
        was_training = self.model.training
        self.model.eval()
        try:
            torch.manual_seed(settings.seed)
            for start in range(0, len(prompt_ids), chunk):
                part = self._generate_chunk(prompt_ids[start : start + chunk], settings)
                for field in ("prompt_ids", "completion_ids", "texts", "truncated"):
                    getattr(out, field).extend(getattr(part, field))
        finally:
            self.model.train(was_training)
        return out

    def _generate_chunk(self, prompt_ids: list[list[int]], settings: SamplingSettings) -> RolloutBatch:
        pad_id = self.tokenizer.pad_token_id
        width = max(len(p) for p in prompt_ids)
        device = self.model.device
        # Left padding: every prompt ends at the same column, so new tokens are appended in lockstep.
        input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(prompt_ids):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1
        sample = settings.temperature > 0
        kwargs = dict(
            max_new_tokens=settings.max_tokens,
            min_new_tokens=settings.min_tokens or None,
            num_return_sequences=settings.n,
            do_sample=sample,
            pad_token_id=pad_id,
            eos_token_id=sorted(self.eos_ids),
            use_cache=True,
        )
        if sample:
            kwargs.update(temperature=settings.temperature, top_p=settings.top_p, top_k=0)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        if settings.stop:
            kwargs.update(stop_strings=list(settings.stop), tokenizer=self.tokenizer)
        with _only_our_sampling_settings(self.model):
            sequences = self.model.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **kwargs
            )
        new_tokens = sequences[:, width:].tolist()
        batch = RolloutBatch([], [], [], [])
        for row, ids in enumerate(new_tokens):
            ids, finished = cut_completion(ids, self.eos_ids, settings.stop, self.tokenizer)
            batch.prompt_ids.append(prompt_ids[row // settings.n])
            batch.completion_ids.append(ids)
            batch.texts.append(self.tokenizer.decode(ids, skip_special_tokens=True))
            batch.truncated.append(not finished)
        return batch
