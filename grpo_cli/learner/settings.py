"""The config read once into the loss's settings (core.LossSettings), for every microbatch's train step; the
scoring's (ScoringSettings, for every pass that scores completions) are read in grpo_cli/batch/settings.py.

The one place that maps loss config keys to them: a new loss option is declared in the schema and used where
it matters, with no keyword list in between to forget: every loss.* key goes over by name (docs/architecture.md,
"Adding a loss option").
"""

from __future__ import annotations

import dataclasses

from grpo_cli.config.schemas import GRPOConfig
from grpo_cli.core import LossSettings


def episode_length_constant(max_tokens_per_turn: int, max_turns: int, max_episode_tokens: int | None) -> int:
    """Dr. GRPO's default divisor (normalization.length=constant without normalization.length_constant) for a
    multi-turn task: the most model tokens an episode can hold, as rollout.max_tokens is for one completion:
    max_turns x rollout.max_tokens, capped by task.max_episode_tokens (which counts the tool/environment tokens
    too, so it bounds the model's). A truncated episode is divided by the same constant as any other."""
    most = max_turns * max_tokens_per_turn
    return most if max_episode_tokens is None else min(most, max_episode_tokens)


def default_length_constant(cfg: GRPOConfig) -> int:
    """Dr. GRPO's divisor without normalization.length_constant: rollout.max_tokens, or for a multi-turn task
    (task.tools or task.environment) the most model tokens an episode can hold (episode_length_constant)."""
    task = cfg.task
    if not task.tools and task.environment in (None, ""):
        return cfg.rollout.max_tokens
    return episode_length_constant(cfg.rollout.max_tokens, task.max_turns, task.max_episode_tokens)


def loss_settings(cfg: GRPOConfig) -> LossSettings:
    """loss.*, normalization.length*, kl.* and the rollout's importance correction, as the train step reads them.
    Every loss.* key goes over by name (LossSettings has a field of each's name; loss.type is loss_type), so a new
    loss option is declared in the schema and in LossSettings and read by its loss, with nothing to add here."""
    rollout = cfg.rollout
    options = {f.name: getattr(cfg.loss, f.name) for f in dataclasses.fields(cfg.loss) if f.name != "type"}
    if cfg.loss.type == "cispo" and options["cliprange_high"] is None:
        # CISPO's cap reads loss.cliprange_high, falling back to the symmetric range like the clipped losses do.
        options["cliprange_high"] = cfg.loss.cliprange
    return LossSettings(
        loss_type=cfg.loss.type,
        **options,
        length_normalization=cfg.normalization.length,
        normalize_constant=cfg.normalization.length_constant or default_length_constant(cfg),
        kl_beta=cfg.kl.beta,
        kl_estimator=cfg.kl.estimator,
        kl_beta_schedule=cfg.kl.beta_schedule,
        kl_beta_final=cfg.kl.beta_final,
        total_steps=cfg.train.steps,
        importance_correction=rollout.importance_correction,
        importance_level=rollout.importance_level,
        importance_threshold=rollout.importance_threshold,
        importance_threshold_low=rollout.importance_threshold_low,
        # sync=async recomputes the old log-probs at the learner's version (the proximal policy) while the sampler's
        # are each token's behaviour policy: pi_prox / pi_behav weighs the loss whatever the correction.
        decoupled=cfg.sync.strategy == "async" and cfg.sync.proximal == "recompute",
        behaviour_weight_cap=cfg.sync.behaviour_weight_cap if cfg.sync.strategy == "async" else None,
    )
