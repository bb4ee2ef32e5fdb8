"""Which prompts each step trains on: a seeded order without replacement, saved in checkpoints."""

from __future__ import annotations

import random
from typing import Any

from grpo_cli.tasks import Example


class PromptSampler:
    """Draws prompts without replacement in a seeded order, reshuffling after each pass over the data."""

    def __init__(self, examples: list[Example], seed: int) -> None:
        self.examples = examples
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self.position = 0
        self.drawn = 0  # prompts drawn since the run began (resumed runs included)

    @property
    def epoch(self) -> float:
        """Passes over the data drawn so far, fractional (what reward functions read as trainer_state.epoch)."""
        return self.drawn / max(len(self.examples), 1)

    def next_batch(self, n: int) -> list[Example]:
        batch: list[Example] = []
        while len(batch) < n:
            if self.position >= len(self.order):
                self.order = list(range(len(self.examples)))
                self.rng.shuffle(self.order)
                self.position = 0
            batch.append(self.examples[self.order[self.position]])
            self.position += 1
        self.drawn += n
        return batch

    def state(self) -> dict[str, Any]:
        """JSON-serializable position in the data, so a resumed run draws the same prompts."""
        version, internal, gauss = self.rng.getstate()
        return {
            "rng": [version, list(internal), gauss],
            "order": self.order,
            "position": self.position,
            "drawn": self.drawn,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.order, self.position = list(state["order"]), int(state["position"])
        # A checkpoint from before the count was kept: the position in the current pass is what is known.
        self.drawn = int(state.get("drawn", self.position))
