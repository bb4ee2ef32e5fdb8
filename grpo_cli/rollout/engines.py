"""Choosing the rollout engine that `rollout.engine` names."""

from __future__ import annotations

from typing import Any

from grpo_cli.rollout.base import RolloutEngine
from grpo_cli.rollout.hf import HFRolloutEngine


def build_rollout_engine(cfg: Any, model: Any, tokenizer: Any) -> RolloutEngine:
    """The engine `rollout.engine` names, sampling from `model` (colocated with the trainer)."""
    if cfg.rollout.engine == "vllm":
        from grpo_cli.rollout.vllm_engine import VLLMRolloutEngine  # vLLM is an optional extra

        return VLLMRolloutEngine.from_config(cfg, model, tokenizer)
    return HFRolloutEngine(
        model, tokenizer, cfg.rollout.max_batch_prompts, compile=cfg.rollout.compile, decoder=cfg.rollout.decoder
    )
