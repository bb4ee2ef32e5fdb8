"""guess_number: the model guesses a whole number; the environment answers "Higher." or "Lower." after each guess.

Reward 1 on the turn the model names the number (the episode ends there); 0 for every other turn, so an episode
that does not find it within task.max_turns earns nothing. A turn without a number is answered with what to write
(and earns nothing). The number is the row's `target`, drawn with the task's data seed (`guess_number_rows`), so an
instance rebuilt by replaying its episode (tasks/environments.py) is in the same state.
"""

from __future__ import annotations

import random
import re
from typing import Any

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
