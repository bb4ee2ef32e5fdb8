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
"format_reward", "answer_reward" and "unparseable" stay those of the task's own reward, and "correctness" is
returned too (whether the answer is right, for eval/pass@k and maj@n, whatever the weights).

Every task also has two shaping terms, penalties in [-1, 0] that a positive weight subtracts from the reward
(docs/evaluation.md#reward-shaping):

    overlong      DAPO's soft overlong punishment: 0 up to rollout.max_tokens - task.overlong_buffer tokens,
                  then falling linearly to -1 at rollout.max_tokens (needs the completion's token count)
    repetition    open-r1's n-gram repetition penalty: -(1 - distinct / total) over the word n-grams
                  (n = task.repetition_ngram)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from grpo_cli.tasks.base import GroundTruth, RewardComponent, RewardFn, TaskSpec
from grpo_cli.usercode.timelimit import call_with_time_limit

# Component name -> key of the task's own reward dict.
BUILTIN_COMPONENTS = {"correctness": "reward", "format": "format_reward", "answer": "answer_reward"}
DEFAULT_WEIGHTS = {"correctness": 1.0}
# Shaping terms every task has (penalties in [-1, 0]); "overlong" reads the completion's token count.
SHAPING_COMPONENTS = ("overlong", "repetition")
_WORD = re.compile(r"\w+")


def overlong_penalty(n_tokens: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; TRL's get_soft_overlong_punishment): 0 for
    n_tokens <= max_tokens - buffer, then (max_tokens - buffer - n_tokens) / buffer, down to -1 at max_tokens
    (a completion cut at the limit). A ramp rather than a cliff, so a long-but-finished answer is not punished
    like a truncated one."""
    if buffer <= 0 or buffer > max_tokens:
        raise ValueError(f"overlong buffer {buffer} must be in 1..max_tokens={max_tokens}")
    start = max_tokens - buffer
    if n_tokens <= start:
        return 0.0
    return max(-1.0, (start - n_tokens) / buffer)


def repetition_penalty(text: str, ngram: int) -> float:
    """open-r1's repetition penalty with max_penalty -1: -(1 - distinct n-grams / n-grams) over the lower-cased
    words. Words are runs of letters and digits (open-r1 splits on whitespace), so "pig," and "pig" are one
    word and "a black pig, a black pig" repeats. Fewer than `ngram` words: 0."""
    if ngram < 1:
        raise ValueError(f"repetition n-gram size {ngram} must be >= 1")
    words = _WORD.findall(text.lower())
    ngrams = [tuple(words[i : i + ngram]) for i in range(len(words) - ngram + 1)]
    if not ngrams:
        return 0.0
    return len(set(ngrams)) / len(ngrams) - 1.0


@dataclass(frozen=True)
class Shaping:
    """What the shaping terms read beyond the response: the generation limit and the two term options."""

    max_tokens: int | None = None  # rollout.max_tokens; None: the overlong term cannot be used
    overlong_buffer: int | None = None  # task.overlong_buffer; None: a quarter of max_tokens
    repetition_ngram: int = 3  # task.repetition_ngram

    def buffer(self) -> int:
        return self.overlong_window()[1]

    def overlong_window(self) -> tuple[int, int]:
        """(max_tokens, buffer): what overlong_penalty reads besides the completion's length."""
        if self.max_tokens is None:
            raise ValueError("the overlong reward term needs rollout.max_tokens")
        return self.max_tokens, self.overlong_buffer if self.overlong_buffer is not None else max(
            1, self.max_tokens // 4
        )


@dataclass(frozen=True)
class ShapingCase:
    """A hand-made input of a shaping term with the value a careful reader expects (job=check_reward, tests).
    The cases fix the term's parameters (SHAPING_CASE_*), so they pin down the rule, not one run's settings."""

    term: str  # one of SHAPING_COMPONENTS
    response: str
    expected: float
    why: str
    n_tokens: int = 0  # overlong: the completion's token count


SHAPING_CASE_MAX_TOKENS, SHAPING_CASE_BUFFER, SHAPING_CASE_NGRAM = 48, 12, 3
SHAPING_CASES = (
    ShapingCase("overlong", "(20 tokens)", 0.0, "well before the last 12 tokens", n_tokens=20),
    ShapingCase("overlong", "(36 tokens)", 0.0, "48 - 12 = 36: the ramp starts after it", n_tokens=36),
    ShapingCase("overlong", "(42 tokens)", -0.5, "half way through the buffer", n_tokens=42),
    ShapingCase("overlong", "(48 tokens)", -1.0, "cut at rollout.max_tokens", n_tokens=48),
    ShapingCase("repetition", "The red apple fell from the tree.", 0.0, "no 3-gram repeats"),
    ShapingCase("repetition", "a black pig, a black pig", -0.25, "3 distinct of 4 3-grams; commas ignored"),
    ShapingCase("repetition", "quiet quiet quiet quiet quiet", -2 / 3, "1 distinct of 3 3-grams"),
    ShapingCase("repetition", "red apple", 0.0, "fewer than 3 words: no 3-gram"),
)


def shaping_case_value(case: ShapingCase) -> float:
    """The shaping term's value on a case, at the cases' own parameters."""
    if case.term == "overlong":
        return overlong_penalty(case.n_tokens, SHAPING_CASE_MAX_TOKENS, SHAPING_CASE_BUFFER)
    return repetition_penalty(case.response, SHAPING_CASE_NGRAM)


@dataclass(frozen=True)
class WeightedReward:
    """reward = sum(weight * component) over the configured components; each one also under reward/<name>."""

    base: RewardFn
    extras: dict[str, RewardComponent]
    weights: dict[str, float]
    shaping: Shaping = Shaping()

    @property
    def uses_n_tokens(self) -> bool:
        """Whether a call needs n_tokens (the scorer passes it only then)."""
        return "overlong" in self.weights

    def __call__(self, response: str, ground_truth: GroundTruth, n_tokens: int | None = None) -> dict[str, float]:
        result = {key: float(value) for key, value in self.base(response, ground_truth).items()}
        values = {name: result[key] for name, key in BUILTIN_COMPONENTS.items()}
        for name, component in self.extras.items():
            values[name] = float(component(response, ground_truth))
        if "overlong" in self.weights:
            if n_tokens is None:
                raise ValueError("the overlong reward term needs the completion's token count: pass n_tokens=")
            values["overlong"] = overlong_penalty(n_tokens, *self.shaping.overlong_window())
        if "repetition" in self.weights:
            values["repetition"] = repetition_penalty(response, self.shaping.repetition_ngram)
        result["reward"] = sum(weight * values[name] for name, weight in self.weights.items())
        result["correctness"] = values["correctness"]  # whether the answer is right, whatever the weights
        result.update({f"reward/{name}": values[name] for name in self.weights})
        return result


@dataclass(frozen=True)
class TimeLimitedReward:
    """Raises RewardTimeout when one call takes longer than `seconds` (None or 0: no limit)."""

    fn: RewardFn
    seconds: float | None

    @property
    def uses_n_tokens(self) -> bool:
        return uses_n_tokens(self.fn)

    def __call__(self, response: str, ground_truth: GroundTruth, **kwargs: Any) -> dict[str, float]:
        return call_with_time_limit(self.seconds, self.fn, response, ground_truth, **kwargs)


def uses_n_tokens(reward_fn: RewardFn) -> bool:
    """Whether `reward_fn` takes the completion's token count as `n_tokens=` (a weighted overlong term)."""
    return bool(getattr(reward_fn, "uses_n_tokens", False))


def component_names(task: TaskSpec, prompt_style: str, options: dict[str, Any]) -> list[str]:
    """Every component `task.reward_weights` may name for this task."""
    extras = task.reward_components(prompt_style, **options) if task.reward_components else {}
    return [*BUILTIN_COMPONENTS, *extras, *SHAPING_COMPONENTS]


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
    shaping: Shaping | None = None,
) -> RewardFn:
    """The reward a run trains and evaluates with: the task's own reward under `prompt_style`, weighted with
    other components (and the shaping terms, read with `shaping`) when `weights` asks for more than
    `{correctness: 1}`, under a per-call time limit."""
    weights = dict(weights or DEFAULT_WEIGHTS)
    options = options or {}
    check_weights(task, prompt_style, weights, options)
    fn = task.reward_for(prompt_style)
    if "overlong" in weights and (shaping is None or shaping.max_tokens is None):
        raise ValueError("task.reward_weights.overlong needs the generation limit: pass rollout.max_tokens")
    if weights != DEFAULT_WEIGHTS:
        extras = task.reward_components(prompt_style, **options) if task.reward_components else {}
        fn = WeightedReward(
            fn, {name: extras[name] for name in weights if name in extras}, weights, shaping or Shaping()
        )
    return TimeLimitedReward(fn, time_limit_s) if time_limit_s else fn
