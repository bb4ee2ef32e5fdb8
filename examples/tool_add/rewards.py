"""The reward, TRL's convention: on a multi-turn episode `completions` holds each episode's messages after the
prompt (the model's turns and the tool's results), and the row's other columns come by name."""

import re


def correct(completions, answer, **kwargs):
    """1.0 when the model's last turn states the row's sum as a number of its own, else 0.0."""
    rewards = []
    for messages, truth in zip(completions, answer, strict=True):
        last = next((m["content"] or "" for m in reversed(messages) if m["role"] == "assistant"), "")
        rewards.append(1.0 if truth in re.findall(r"-?\d+", last.replace(",", "")) else 0.0)
    return rewards
