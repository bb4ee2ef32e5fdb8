"""Choosing the rollout engine that `rollout.engine` names."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from grpo_cli.engines.base import RolloutEngine
from grpo_cli.engines.hf import HFRolloutEngine

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from grpo_cli.config.rollout_schemas import HFRolloutConfig
    from grpo_cli.config.schemas import GRPOConfig


def build_rollout_engine(cfg: GRPOConfig, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> RolloutEngine:
    """The engine `rollout.engine` names, sampling from `model` (colocated with the trainer)."""
    if cfg.rollout.engine == "vllm":
        from grpo_cli.engines.vllm_engine import VLLMRolloutEngine  # vLLM is an optional extra

        return VLLMRolloutEngine.from_config(cfg, model, tokenizer)
    rollout = cast("HFRolloutConfig", cfg.rollout)  # rollout.engine=hf picked the hf schema (ROLLOUT_SCHEMAS)
    return HFRolloutEngine(
        model, tokenizer, rollout.max_batch_prompts, compile=rollout.compile, decoder=rollout.decoder
    )
