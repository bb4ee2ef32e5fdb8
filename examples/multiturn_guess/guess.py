"""A user's own multi-turn environment and tool, in a folder of their own (docs/multi-turn.md).

`GuessNumber` plays "guess my number" against the model: each episode's number is the row's `target`; after each
guess the environment answers "Higher." or "Lower." (reward 0) or ends the game with reward 1 when it is found.
`count_letters` is a tool, for `task.tools.count_letters=guess.py:count_letters`.
"""

from __future__ import annotations

import re

HIGHEST = 8


class GuessNumber:
    """One game per episode: constructed with no arguments, `reset(row)` opens it, `step(messages)` answers."""

    def reset(self, row: dict) -> list[dict]:
        self.target = int(row["target"])
        return [
            {
                "role": "user",
                "content": f"I am thinking of a whole number from 1 to {HIGHEST}. Guess it: reply with one number. "
                "After each guess I will say higher or lower.",
            }
        ]

    def step(self, messages: list[dict]) -> tuple[list[dict] | None, float | None, bool]:
        numbers = re.findall(r"\d+", messages[-1]["content"])
        if not numbers:
            return [{"role": "user", "content": f"Reply with one number from 1 to {HIGHEST}."}], 0.0, False
        guess = int(numbers[0])
        if guess == self.target:
            return None, 1.0, True
        hint = "Higher." if guess < self.target else "Lower."
        return [{"role": "user", "content": hint}], 0.0, False


def count_letters(word: str, letter: str) -> int:
    """Count how many times a letter occurs in a word.

    Args:
        word: The word to look in.
        letter: The letter to count.
    """
    return word.lower().count(letter.lower())
