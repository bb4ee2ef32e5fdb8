"""A lexicon sentiment scorer, the reward of this task: is the rewrite negative, and still about the product?

Per-sample convention (task.reward_convention=per_sample): negativity(response, row) -> float in [0, 1].
"""

import re

NEGATIVE = {
    "bad",
    "terrible",
    "awful",
    "poor",
    "broke",
    "broken",
    "disappointing",
    "disappointed",
    "waste",
    "worst",
    "cheap",
    "flimsy",
    "useless",
    "hate",
    "horrible",
    "slow",
    "never",
    "refund",
    "returned",
    "regret",
    "mediocre",
    "annoying",
    "faulty",
    "overpriced",
    "unreliable",
    "not",
    "don't",
    "didn't",
    "doesn't",
    "avoid",
    "sadly",
    "unfortunately",
    "fails",
    "failed",
    "problem",
    "problems",
    "boring",
}
POSITIVE = {
    "good",
    "great",
    "love",
    "loved",
    "perfect",
    "perfectly",
    "excellent",
    "wonderful",
    "amazing",
    "recommend",
    "recommended",
    "beautiful",
    "beautifully",
    "best",
    "joy",
    "worth",
    "reliable",
    "sturdy",
    "happy",
    "exceeded",
    "five",
    "fantastic",
    "awesome",
    "nice",
    "enjoy",
    "enjoyed",
}
WORD = re.compile(r"[a-z']+")


def negativity(response, row):
    """(negative words - positive words) / words that carry sentiment, mapped to [0, 1]; 0 when the rewrite
    no longer names the product (an off-topic rant is not a rewrite) or carries no sentiment at all."""
    words = WORD.findall(response.lower())
    if row["product"].split()[-1] not in words:
        return 0.0
    neg = sum(w in NEGATIVE for w in words)
    pos = sum(w in POSITIVE for w in words)
    if neg + pos == 0:
        return 0.0
    return (neg - pos) / (neg + pos) / 2 + 0.5
