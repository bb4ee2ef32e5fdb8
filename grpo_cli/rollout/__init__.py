"""Rollout: producing a scored batch on the one path (worker.py), held-out evaluation; the
engines' names (grpo_cli.engines) re-exported for the callers that build one."""

from grpo_cli.engines.base import RolloutBatch, RolloutEngine, SamplingSettings, WeightSyncError, render_prompts
from grpo_cli.engines.build import build_rollout_engine
from grpo_cli.engines.hf import HFRolloutEngine

__all__ = [
    "HFRolloutEngine",
    "RolloutBatch",
    "RolloutEngine",
    "SamplingSettings",
    "WeightSyncError",
    "build_rollout_engine",
    "render_prompts",
]
