"""Keyword inclusion: "Write one short sentence that includes the words: w1, w2."

Reward 1 iff every keyword appears as a whole word, case-insensitive ("Apple," counts for "apple";
"pineapple" and "apples" do not). answer_reward is the fraction of keywords present (a denser signal to
watch), format_reward is 1 for any non-empty response.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from grpo_cli.config.fields import positive
from grpo_cli.tasks.base import Example, SanityCase, TaskSpec, format_prompt
from grpo_cli.tasks.schema import TaskConfig

# Concrete, common words a 135M model knows; pairs are drawn at random so most pairs are unrelated.
VOCABULARY = (
    "apple river window garden yellow bread winter ocean guitar candle forest bridge rabbit coffee mountain "
    "pencil summer castle silver orange market blanket doctor engine island kitchen ladder mirror needle "
    "pocket rocket shadow teacher thunder violin wallet anchor basket butter camera desert feather hammer "
    "jacket lemon marble noodle parrot pillow puzzle robot saddle tiger tomato tunnel umbrella velvet wagon "
    "whistle cookie dragon falcon glacier harbor lantern meadow nickel oyster pepper quilt ribbon spider "
    "tractor vacuum walnut zebra bicycle chimney dolphin envelope fountain giraffe helmet iceberg jungle "
    "kettle lobster magnet notebook orchard pumpkin rainbow sandwich telescope tornado volcano waterfall "
    "blue green purple happy quiet ancient frozen gentle brave clever dusty golden hollow narrow rusty "
    "sleepy smooth sticky tiny wooden"
).split()

INSTRUCTION = "Write one short sentence that includes the words: {words}."


def keyword_present(response: str, keyword: str) -> bool:
    """True iff `keyword` occurs in `response` as a whole word, ignoring case."""
    # Letters and digits on either side make it part of a longer word; punctuation and hyphens do not.
    pattern = rf"(?<![0-9A-Za-z]){re.escape(keyword)}(?![0-9A-Za-z])"
    return re.search(pattern, response, flags=re.IGNORECASE) is not None


def keyword_inclusion_reward_fn(response: str, keywords: list[str]) -> dict[str, float]:
    """{"reward": 1 iff all keywords present, "format_reward": non-empty, "answer_reward": fraction present}."""
    if not keywords:
        raise ValueError("keyword reward needs at least one keyword in the ground truth")
    present = sum(keyword_present(response, k) for k in keywords)
    return {
        "reward": float(present == len(keywords)),
        "format_reward": float(bool(response.strip())),
        "answer_reward": present / len(keywords),
    }


def build_keyword_examples(
    split: str, n: int | None, seed: int, prompt_style: str = "chat", keywords_per_prompt: int = 2
) -> list[Example]:
    """Deterministic synthetic examples; train and eval draw from disjoint seeds."""
    if n is None:
        n = 2000 if split == "train" else 256
    if not 1 <= keywords_per_prompt <= len(VOCABULARY):
        raise ValueError(f"task.keywords_per_prompt={keywords_per_prompt} must be between 1 and {len(VOCABULARY)}")
    rng = random.Random(f"keyword/{split}/{seed}")
    examples = []
    for _ in range(n):
        words = rng.sample(VOCABULARY, keywords_per_prompt)
        question = INSTRUCTION.format(words=", ".join(words))
        examples.append(
            Example(prompt=format_prompt(question, prompt_style), ground_truth=words, meta={"question": question})
        )
    return examples


SANITY_CASES = (
    SanityCase(["apple", "red"], "The red apple fell from the tree.", 1.0, "both words present"),
    SanityCase(["apple", "red"], "RED, apple!", 1.0, "case and punctuation do not matter"),
    SanityCase(["apple", "red"], "A well-made apple-pie is red.", 1.0, "hyphens separate words"),
    SanityCase(["apple", "red"], "The apple fell from the tree.", 0.0, "one word missing"),
    SanityCase(["apple", "red"], "I love pineapples and credit cards.", 0.0, "substrings inside words do not count"),
    SanityCase(["apple", "red"], "Apples are often reddish.", 0.0, "plurals and derived forms do not count"),
    SanityCase(["apple", "red"], "", 0.0, "empty response"),
)


@dataclass
class KeywordTaskConfig(TaskConfig):
    """task=keyword's keys."""

    keywords_per_prompt: int = positive(2, help="How many keywords each prompt asks for.")


KEYWORD_TASK = TaskSpec(
    schema=KeywordTaskConfig,
    name="keyword",
    reward_fn=keyword_inclusion_reward_fn,
    build=build_keyword_examples,
    sanity_cases=SANITY_CASES,
    options=("keywords_per_prompt",),
)
