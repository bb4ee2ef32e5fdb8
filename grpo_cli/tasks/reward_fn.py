"""The reward a run scores with (`make_reward_fn`): the task's reward for task.prompt, its components weighted by
task.reward_weights (tasks/rewards.py composes them), limited to task.reward_timeout_s per call."""

from __future__ import annotations

import dataclasses
from typing import Any

from grpo_cli.tasks.base import RewardFn, TaskSpec
from grpo_cli.tasks.custom import CustomReward
from grpo_cli.tasks.multiturn import ENV_COMPONENT, env_weight, is_multiturn
from grpo_cli.tasks.registry import task_for
from grpo_cli.tasks.rewards import DEFAULT_WEIGHTS, Shaping, build_reward_fn
from grpo_cli.tasks.schema import RewardWeightsConfig, TaskConfig


def reward_options(task: TaskSpec, task_cfg: TaskConfig) -> dict[str, Any]:
    """The keys of task_cfg the task's reward reads (TaskSpec.reward_options), by name."""
    return {key: getattr(task_cfg, key) for key in task.reward_options}


def reward_weights(task_cfg: TaskConfig) -> dict[str, float]:
    """The components with a nonzero weight in task.reward_weights, as {name: weight} (default: correctness 1)."""
    weights = task_cfg.reward_weights
    if weights is None:
        return dict(DEFAULT_WEIGHTS)
    # RewardWeightsConfig, or task=custom's mapping of the user's reward names. `env` (the environment's step
    # rewards, multi-turn episodes only) is not one of the task's reward components: env_weight reads it.
    items = dataclasses.asdict(weights) if isinstance(weights, RewardWeightsConfig) else dict(weights)
    return {name: float(weight) for name, weight in items.items() if weight != 0 and name != ENV_COMPONENT}


def component_weights(task_cfg: TaskConfig) -> dict[str, float]:
    """The weights make_reward_fn builds the task's reward with: reward_weights(task_cfg), or for a task whose
    environment's reward is the only one weighted (guess_number: task.reward_weights.correctness=0) the task's own
    reward at weight 0, so that "correctness" is still reported (eval/pass@k) and the total is the env component."""
    weights = reward_weights(task_cfg)
    if not weights and is_multiturn(task_cfg) and env_weight(task_cfg) != 0:
        return {"correctness": 0.0}
    return weights


def make_reward_fn(task_cfg: TaskConfig, max_tokens: int | None = None, device: str | None = None) -> RewardFn:
    """The reward a run scores with: the task's reward for `task.prompt`, combined per `task.reward_weights`,
    limited to `task.reward_timeout_s` per call (a timeout raises RewardTimeout, counted by the scorer).
    `max_tokens` (rollout.max_tokens) is what the overlong shaping term measures against; `device` is where a
    reward model runs (the policy's; None: the CPU)."""
    task = task_for(task_cfg)
    if isinstance(task.reward_fn, CustomReward):  # task=custom: weights, limits and errors handled by its reward
        return task.reward_fn.for_run(max_tokens, device)
    shaping = Shaping(
        max_tokens=max_tokens,
        overlong_buffer=task_cfg.overlong_buffer,
        repetition_ngram=task_cfg.repetition_ngram,
    )
    return build_reward_fn(
        task,
        task_cfg.prompt,
        component_weights(task_cfg),
        reward_options(task, task_cfg),
        task_cfg.reward_timeout_s,
        shaping,
    )
