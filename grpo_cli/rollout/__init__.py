"""Rollout: engines behind one interface (transformers `generate`, vLLM), the worker that turns prompts into a
scored rollout batch, scoring and held-out evaluation."""

from grpo_cli.rollout.base import RolloutBatch, RolloutEngine, SamplingSettings, WeightSyncError, render_prompts
from grpo_cli.rollout.engines import build_rollout_engine
from grpo_cli.rollout.hf import HFRolloutEngine

__all__ = [
    "HFRolloutEngine",
    "RolloutBatch",
    "RolloutEngine",
    "SamplingSettings",
    "WeightSyncError",
    "build_rollout_engine",
    "render_prompts",
]
