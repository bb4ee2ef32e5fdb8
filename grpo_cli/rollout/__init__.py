"""Rollout engines behind one interface (transformers generate; vLLM comes with its own extra)."""

from grpo_cli.rollout.base import RolloutBatch, RolloutEngine, SamplingSettings, render_prompts
from grpo_cli.rollout.hf import HFRolloutEngine

__all__ = ["HFRolloutEngine", "RolloutBatch", "RolloutEngine", "SamplingSettings", "render_prompts"]
