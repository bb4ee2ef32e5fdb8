"""guess_number: the model guesses a whole number; the environment answers "Higher." or "Lower." after each guess.

Reward 1 on the turn the model names the number (the episode ends there); 0 for every other turn, so an episode
that does not find it within task.max_turns earns nothing. A turn without a number is answered with what to write
(and earns nothing). The number is the row's `target`, drawn with the task's data seed (`guess_number_rows`), so an
instance rebuilt by replaying its episode (episodes/environments.py) is in the same state.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from grpo_cli.tasks.base import Example, GroundTruth, SanityCase, TaskSpec
from grpo_cli.tasks.schema import TaskConfig

Message = dict[str, Any]

# The last whole number in the model's turn is its guess ("I guess 37." -> 37; "-5" -> -5).
_NUMBER = re.compile(r"-?\d+")


def guess_number_rows(n: int, seed: int, low: int = 1, high: int = 100) -> list[dict[str, Any]]:
    """`n` rows, each {"target", "low", "high"}, the target uniform in [low, high], drawn from `seed`."""
    rng = random.Random(seed)
    return [{"target": rng.randint(low, high), "low": low, "high": high} for _ in range(n)]


def opening_prompt(low: int, high: int) -> str:
    return (
        f"I am thinking of a whole number between {low} and {high}. Guess it: answer with one number. After each "
        "guess I will say Higher or Lower."
    )


class GuessNumber:
    """The guess_number environment (task.environment=grpo_cli.tasks.guess_number:GuessNumber)."""

    def __init__(self) -> None:
        self.target = 0
        self.low, self.high = 1, 100

    def reset(self, row: dict[str, Any]) -> list[Message]:
        self.target, self.low, self.high = int(row["target"]), int(row.get("low", 1)), int(row.get("high", 100))
        return [{"role": "user", "content": opening_prompt(self.low, self.high)}]

    def step(self, messages: list[Message]) -> tuple[list[Message] | None, float | None, bool]:
        numbers = _NUMBER.findall(str(messages[-1]["content"]))
        if not numbers:
            return (
                [{"role": "user", "content": f"Answer with one whole number between {self.low} and {self.high}."}],
                0.0,
                False,
            )
        guess = int(numbers[-1])
        if guess == self.target:
            return None, 1.0, True
        return [{"role": "user", "content": "Higher." if guess < self.target else "Lower."}], 0.0, False


# ------------------------------------------------------------------------------------------------- the task


def guess_number_examples(split: str, n: int | None, seed: int, prompt_style: str = "chat") -> list[Example]:
    """`n` games (64 when None), each the opening prompt and its row as the ground truth; the eval split draws
    from seed + 1, so it differs from the training games and stays the same from run to run."""
    if prompt_style != "chat":
        raise ValueError(f"task.prompt={prompt_style}: guess_number is a conversation: use task.prompt=chat")
    rows = guess_number_rows(64 if n is None else n, seed if split == "train" else seed + 1)
    return [
        Example([{"role": "user", "content": opening_prompt(r["low"], r["high"])}], r, {"target": r["target"]})
        for r in rows
    ]


def guess_number_reward_fn(response: str, ground_truth: GroundTruth) -> dict[str, float]:
    """The episode's last model turn (its last guess) names the number: 1, else 0 (whether the game was won, the
    "correctness" eval/pass@k reads; the environment's own reward is the `env` component). format_reward: the turn
    holds a whole number."""
    numbers = _NUMBER.findall(response)
    found = bool(numbers) and int(numbers[-1]) == int(ground_truth["target"])
    return {"reward": float(found), "format_reward": float(bool(numbers)), "answer_reward": float(found)}


def _cases() -> tuple[SanityCase, ...]:
    truth = {"target": 37, "low": 1, "high": 100}
    prompt = [{"role": "user", "content": opening_prompt(1, 100)}]
    scripts: tuple[tuple[tuple[str, ...], float, str], ...] = (
        (("50", "25", "37"), 1.0, "binary search finds 37 on the third guess (Lower, Higher, found)"),
        (("I guess 37.",), 1.0, "the last number of the turn is the guess"),
        (("50", "I am not sure.", "37"), 1.0, "a turn without a number is told what to write, and earns nothing"),
        (("50", "25", "30"), 0.0, "three wrong guesses: the script ends (task.max_turns) without the number"),
        (("1", "2", "3", "4", "5", "6", "7", "37"), 0.0, "found on the 8th guess: past task.max_turns=7"),
    )
    return tuple(
        SanityCase(truth, turns[-1], expected, why, turns=turns, prompt=prompt) for turns, expected, why in scripts
    )


@dataclass
class GuessNumberTaskConfig(TaskConfig):
    """task=guess_number: the common keys; conf/task/guess_number.yaml sets task.environment, task.max_turns and
    the weights (the environment's reward only)."""


GUESS_NUMBER_TASK = TaskSpec(
    schema=GuessNumberTaskConfig,
    name="guess_number",
    reward_fn=guess_number_reward_fn,
    build=guess_number_examples,
    sanity_cases=_cases(),
    prompt_styles=("chat",),
)
