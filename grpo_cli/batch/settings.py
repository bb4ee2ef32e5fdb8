"""The config read once into ScoringSettings, for every pass that scores completions: the learner's training, old
and reference passes and the rollout worker's behaviour log-probs (the loss's own settings: learner/settings.py)."""

from __future__ import annotations

import torch

from grpo_cli.batch.forward import ScoringSettings, packs_sequences, shares_prompts, uses_prompt_tree
from grpo_cli.config import BatchShape
from grpo_cli.config.schemas import GRPOConfig


def scoring_settings(cfg: GRPOConfig, model: torch.nn.Module, pad_token_id: int, sharded: bool) -> ScoringSettings:
    """How `model`'s completions are scored, at the training rollouts' temperature (rollout.temperature).
    `sharded`: the model is FSDP2-sharded, whose every rank must run the same sequence of layer calls; the shared
    prompt pass runs the decoder once or twice depending on the batch, so it stays off there, and off for a model
    it cannot score (shares_prompts)."""
    share_prompts = not sharded and shares_prompts(model, cfg.train.share_prompt_forward)
    return ScoringSettings(
        temperature=cfg.rollout.temperature,
        share_prompts=share_prompts,
        logits_chunk_tokens=cfg.train.logits_chunk_tokens,
        microbatch_size=BatchShape.from_config(cfg).microbatch_size,
        microbatch_tokens=cfg.train.microbatch_tokens,
        pad_token_id=pad_token_id,
        pack_sequences=packs_sequences(
            model, cfg.train.pack_sequences, cfg.rollout.temperature, cfg.train.logits_chunk_tokens
        ),
        prompt_tree=uses_prompt_tree(model, share_prompts, cfg.rollout.temperature, cfg.train.logits_chunk_tokens),
    )
