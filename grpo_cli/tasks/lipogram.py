"""Lipogram: write about a topic without the letter e (or E).

Reward 1 iff the response contains no e/E at all (accented forms such as é count: the text is checked after
Unicode decomposition) AND passes the relevance check: at least `min_words` words and the topic word itself
(or its plural with -s), so an empty or evasive answer cannot win. format_reward is that relevance check;
answer_reward is the share of words free of e/E (a denser signal to watch). Every topic is spelled without e.
"""

from __future__ import annotations

import random
import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from grpo_cli.config.fields import positive
from grpo_cli.tasks.base import Example, SanityCase, TaskSpec, format_prompt
from grpo_cli.tasks.keyword import keyword_present
from grpo_cli.tasks.schema import TaskConfig

TOPICS = (
    "cat dog fish bird cow owl lion frog ant goat rabbit pig duck wolf bat fox shark crab sloth panda koala "
    "parrot snail squid salmon hippo bison gorilla lizard rain sun moon stars autumn pizza radio farm city "
    "music train boat clock guitar piano soup rainbow island milk cotton library school hospital airport "
    "football yoga swimming camping fishing cooking painting dancing walking"
).split()

TEMPLATES = (
    "Describe {topic}.",
    "Why do people like {topic}?",
    "Tell a short story about {topic}.",
    "What is special about {topic}?",
)

INSTRUCTION = (
    '{question} Answer in at least {min_words} words, use the word "{topic}", and do not use the letter e '
    "(or E) anywhere."
)

_WORD = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)?")


def _letters(text: str) -> str:
    # NFKD splits "é" into "e" + a combining accent, so accented e's are caught by a plain "e" test.
    return unicodedata.normalize("NFKD", text)


def lipogram_reward_fn(response: str, ground_truth: dict[str, Any]) -> dict[str, float]:
    """{"reward": no e/E and relevant, "format_reward": relevant (long enough, on topic),
    "answer_reward": share of words without e/E}."""
    topic, min_words = ground_truth["topic"], int(ground_truth["min_words"])
    text = _letters(response)
    words = _WORD.findall(text)
    has_e = "e" in text.lower()
    relevant = len(words) >= min_words and (keyword_present(response, topic) or keyword_present(response, topic + "s"))
    return {
        "reward": float(relevant and not has_e),
        "format_reward": float(relevant),
        "answer_reward": sum("e" not in w.lower() for w in words) / len(words) if words else 0.0,
    }


def build_lipogram_examples(
    split: str, n: int | None, seed: int, prompt_style: str = "chat", min_words: int = 10
) -> list[Example]:
    """Deterministic synthetic examples; train and eval draw from disjoint seeds."""
    if n is None:
        n = 2000 if split == "train" else 256
    if min_words < 1:
        raise ValueError(f"task.min_words={min_words} must be at least 1")
    rng = random.Random(f"lipogram/{split}/{seed}")
    examples = []
    for _ in range(n):
        topic = rng.choice(TOPICS)
        question = INSTRUCTION.format(
            question=rng.choice(TEMPLATES).format(topic=topic), min_words=min_words, topic=topic
        )
        truth = {"topic": topic, "min_words": min_words}
        examples.append(Example(format_prompt(question, prompt_style), truth, {"question": question}))
    return examples


_CAT = {"topic": "cat", "min_words": 10}
SANITY_CASES = (
    SanityCase(_CAT, "A cat is a small animal that naps all day and purrs a lot.", 1.0, "no e, 14 words, on topic"),
    SanityCase(_CAT, "CATS: playful animals that nap a lot and purr all day long.", 1.0, "plural, uppercase topic"),
    SanityCase(_CAT, "The cat is a small animal that naps all day and purrs a lot.", 0.0, "'The' has an e"),
    SanityCase(_CAT, "A cat naps in a café all day long, calm and happy and warm.", 0.0, "an accented é is an e"),
    SanityCase(_CAT, "A cat naps.", 0.0, "too short (3 words < 10)"),
    SanityCase(_CAT, "A dog is a loyal animal that barks at night and runs a lot.", 0.0, "off topic: no 'cat'"),
    SanityCase(_CAT, "", 0.0, "empty response"),
)


@dataclass
class LipogramTaskConfig(TaskConfig):
    """task=lipogram's keys."""

    min_words: int = positive(10, help="The fewest words an answer may have (with the topic word) to be rewarded.")


LIPOGRAM_TASK = TaskSpec(
    schema=LipogramTaskConfig,
    name="lipogram",
    reward_fn=lipogram_reward_fn,
    build=build_lipogram_examples,
    sanity_cases=SANITY_CASES,
    options=("min_words",),
)
