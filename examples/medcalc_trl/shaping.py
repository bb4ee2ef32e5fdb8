"""A shaping reward of this folder's own, beside the handout's (rewards.py, unchanged).

Why: SmolLM2-135M-Instruct never writes both tag pairs unprompted, so the handout's format_reward and
numeric_tolerance_reward give every completion of a group 0, every advantage is 0, and nothing is learned (the
handout's own tip: "If all completions in a group score identically ... no learning signal"). Partial credit for
each tag the completion writes gives the groups a spread to learn from, as the handout's larger model does not need.
TRL's convention, like the handout's functions: fn(completions, **kwargs) -> one float per completion.
"""

TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def tag_credit(completions, **kwargs):
    """0.25 for each of the four tags the completion contains (0 to 1)."""
    return [sum(tag in c for tag in TAGS) / len(TAGS) if isinstance(c, str) else 0.0 for c in completions]
