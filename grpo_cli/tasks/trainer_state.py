"""TrainerState: how far the run is, as a reward function sees it (TRL's trainer_state=). Its own leaf module, so
that rollout/, jobs/ and the tasks' rewards share it without importing a task."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainerState:
    """What a reward function gets as trainer_state= (TRL passes transformers' TrainerState): how far the run is,
    for rewards that change over training. Plain data, so it pickles to a worker process."""

    # Updates made before the weights that sampled these completions (TRL's state.global_step while it scores).
    global_step: int = 0
    # train.steps.
    max_steps: int = 0
    # Passes over the training prompts drawn so far, fractional (TRL's state.epoch).
    epoch: float = 0.0
