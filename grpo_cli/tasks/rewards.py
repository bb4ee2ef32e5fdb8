"""Composable rewards: a weighted sum of named components, and a per-call time limit. No torch.

`task.reward_weights` gives each component a weight (0: unused), e.g. `task.reward_weights.format=0.1` next to
the default `correctness: 1.0`. Every task has three components derived from its own reward function
(computed once per response):

    correctness   the task's reward ("reward" of its reward function: for r1_zero, format AND correct answer)
    format        its "format_reward"
    answer        its "answer_reward" (e.g. keyword: the fraction of keywords present)

and may add its own (gsm8k, regex_sum: `numeric_close`, 1 when the answer is within `task.numeric_tolerance`
of the truth). The weighted sum becomes "reward" (the number advantages are computed from); each component is
also returned as "reward/<name>" so it is logged as `train/reward/<name>` and `eval/reward/<name>`.
"format_reward", "answer_reward" and "unparseable" stay those of the task's own reward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from grpo_cli.tasks.base import RewardComponent, RewardFn, TaskSpec
from grpo_cli.tasks.timelimit import call_with_time_limit

# Component name -> key of the task's own reward dict.
BUILTIN_COMPONENTS = {"correctness": "reward", "format": "format_reward", "answer": "answer_reward"}
DEFAULT_WEIGHTS = {"correctness": 1.0}


@dataclass(frozen=True)
class WeightedReward:
    """reward = sum(weight * component) over the configured components; each one also under reward/<name>."""

    base: RewardFn
    extras: dict[str, RewardComponent]
    weights: dict[str, float]

    def __call__(self, response: str, ground_truth: Any) -> dict[str, float]:
        result = {key: float(value) for key, value in self.base(response, ground_truth).items()}
        values = {name: result[key] for name, key in BUILTIN_COMPONENTS.items()}
        for name, component in self.extras.items():
            values[name] = float(component(response, ground_truth))
        result["reward"] = sum(weight * values[name] for name, weight in self.weights.items())
        result.update({f"reward/{name}": values[name] for name in self.weights})
        return result


@dataclass(frozen=True)
class TimeLimitedReward:
    """Raises RewardTimeout when one call takes longer than `seconds` (None or 0: no limit)."""

    fn: RewardFn
    seconds: float | None

    def __call__(self, response: str, ground_truth: Any) -> dict[str, float]:
        return call_with_time_limit(self.seconds, self.fn, response, ground_truth)


def component_names(task: TaskSpec, prompt_style: str, options: dict[str, Any]) -> list[str]:
    """Every component `task.reward_weights` may name for this task."""
    extras = task.reward_components(prompt_style, **options) if task.reward_components else {}
    return [*BUILTIN_COMPONENTS, *extras]


def check_weights(task: TaskSpec, prompt_style: str, weights: dict[str, float], options: dict[str, Any]) -> None:
    """ValueError with a one-line message naming the bad entry and the allowed names."""
    allowed = component_names(task, prompt_style, options)
    if not weights:
        raise ValueError(
            f"every task.reward_weights is 0: give a weight to one of {', '.join(allowed)} "
            "(e.g. task.reward_weights.correctness=1)"
        )
    for name, weight in weights.items():
        if name not in allowed:
            raise ValueError(
                f"task.reward_weights.{name}={weight:g}, but task={task.name} has no {name} component: "
                f"use {', '.join(allowed)}"
            )
        if not math.isfinite(weight):
            raise ValueError(f"task.reward_weights.{name}={weight} must be a finite number")


def build_reward_fn(
    task: TaskSpec,
    prompt_style: str,
    weights: dict[str, float] | None = None,
    options: dict[str, Any] | None = None,
    time_limit_s: float | None = None,
) -> RewardFn:
    """The reward a run trains and evaluates with: the task's own reward under `prompt_style`, weighted with
    other components when `weights` asks for more than `{correctness: 1}`, under a per-call time limit."""
    weights = dict(weights or DEFAULT_WEIGHTS)
    options = options or {}
    check_weights(task, prompt_style, weights, options)
    fn = task.reward_for(prompt_style)
    if weights != DEFAULT_WEIGHTS:
        extras = task.reward_components(prompt_style, **options) if task.reward_components else {}
        fn = WeightedReward(fn, {name: extras[name] for name in weights if name in extras}, weights)
    return TimeLimitedReward(fn, time_limit_s) if time_limit_s else fn
