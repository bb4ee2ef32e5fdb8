"""What every task provides: examples (prompt + ground truth) and a reward function. No torch here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# A prompt is either plain text (r1_zero / question_only templates, fed to the model as is) or a list of
# chat messages that the tokenizer's chat template renders (instruct models).
Prompt = str | list[dict[str, str]]
RewardFn = Callable[[str, Any], dict[str, float]]

REWARD_KEYS = ("reward", "format_reward", "answer_reward")


@dataclass(frozen=True)
class Example:
    prompt: Prompt
    ground_truth: Any
    # Free-form data kept in eval JSONL (e.g. the source question); never read by rewards.
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SanityCase:
    """A hand-made response with the reward it must get: shown by check_reward, asserted by tests."""

    ground_truth: Any
    response: str
    expected_reward: float
    why: str


@dataclass(frozen=True)
class TaskSpec:
    name: str
    reward_fn: RewardFn
    # build(split, n, seed, options) -> list[Example]
    build: Callable[..., list[Example]]
    sanity_cases: tuple[SanityCase, ...] = ()
    # Task-specific keys of the task config passed to build() as keyword arguments.
    options: tuple[str, ...] = ()


def format_prompt(question: str, style: str) -> Prompt:
    """Wrap a task's question in the configured prompt style (design.md section 3)."""
    if style == "chat":
        return [{"role": "user", "content": question}]
    if style == "question_only":
        return question
    if style == "r1_zero":
        return R1_ZERO_TEMPLATE.format(question=question)
    raise ValueError(f"unknown prompt style {style!r}: use chat, r1_zero or question_only")


R1_ZERO_TEMPLATE = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the User with the "
    "answer. The reasoning process is enclosed within <think> </think> and answer is enclosed within <answer> "
    "</answer> tags, respectively, i.e., <think> reasoning process here </think> <answer> answer here </answer>.\n"
    "User: {question}\n"
    "Assistant: <think>"
)
