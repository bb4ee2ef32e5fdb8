"""Regex sum: add up the numbers in a short paragraph and answer inside `<ans>X</ans>`.

The ground truth is computed from the paragraph itself (the sum of every run of digits in it), so the data
cannot disagree with its own answers. Reward 1 iff the response holds exactly one `<ans>...</ans>` block
(format_reward; two blocks are a hedge, not an answer) AND its content is a plain number equal to the sum
(`49`, ` 49 `, `49.0` and `1,049` are numbers; `12+37=49` is not). "unparseable" is 1 when there is no single
block or its content is not a number.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from grpo_cli.config.fields import positive
from grpo_cli.tasks.base import Example, GroundTruth, RewardComponent, SanityCase, TaskSpec, format_prompt
from grpo_cli.tasks.schema import NumericCloseOptions, TaskConfig

NAMES = "Ava Ben Cleo Dan Eva Finn Gia Hal Ivy Jon Kai Lena Max Nia Omar Pia Raj Sia Tom Uma".split()
SENTENCES = (
    "{name} picked {n} apples in the morning.",
    "The shop sold {n} lamps on Monday.",
    "There were {n} boats in the harbor at noon.",
    "{name} read {n} pages before dinner.",
    "A crate on the truck held {n} melons.",
    "The choir sang {n} songs at the fair.",
    "{name} counted {n} birds on the fence.",
    "The bus stopped {n} times on its route.",
    "Our class planted {n} trees by the river.",
    "{name} baked {n} cookies for the party.",
)
INSTRUCTION = (
    "Add up all the numbers in the paragraph below. Reply with the sum inside <ans></ans> tags, for example "
    "<ans>42</ans>.\n\nParagraph: {paragraph}"
)

_ANSWER_BLOCK = re.compile(r"<ans>(.*?)</ans>", re.DOTALL)
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def sum_of_numbers(paragraph: str) -> int:
    """The sum of every run of digits in `paragraph` (what the task asks the model to compute)."""
    return sum(int(digits) for digits in re.findall(r"\d+", paragraph))


def extract_sum_answer(response: str) -> float | None:
    """The number in the one `<ans>...</ans>` block, or None (no block, several, or not a plain number)."""
    blocks = _ANSWER_BLOCK.findall(response)
    if len(blocks) != 1 or not _PLAIN_NUMBER.fullmatch(blocks[0].strip()):
        return None
    return float(blocks[0].strip().replace(",", ""))


def regex_sum_reward_fn(response: str, ground_truth: int) -> dict[str, float]:
    """{"reward" = "answer_reward": the one <ans> block holds the sum; "format_reward": exactly one block;
    "unparseable": no number to read}."""
    value = extract_sum_answer(response)
    correct = value is not None and value == float(ground_truth)
    return {
        "reward": float(correct),
        "format_reward": float(len(_ANSWER_BLOCK.findall(response)) == 1),
        "answer_reward": float(correct),
        "unparseable": float(value is None),
    }


def numeric_close_components(prompt_style: str, numeric_tolerance: float = 0.01) -> dict[str, RewardComponent]:
    """`numeric_close`: 1 when the <ans> number is within a relative `numeric_tolerance` of the sum."""
    del prompt_style  # the <ans> tags are the task's own format under every prompt style

    def numeric_close(response: str, ground_truth: GroundTruth) -> float:
        value, truth = extract_sum_answer(response), float(ground_truth)
        return float(value is not None and abs(value - truth) <= numeric_tolerance * max(1.0, abs(truth)))

    return {"numeric_close": numeric_close}


def build_regex_sum_examples(
    split: str,
    n: int | None,
    seed: int,
    prompt_style: str = "chat",
    numbers_per_prompt: int = 4,
    max_number: int = 99,
) -> list[Example]:
    """Deterministic synthetic paragraphs of `numbers_per_prompt` sentences with one number in 1..max_number each."""
    if n is None:
        n = 2000 if split == "train" else 256
    if not 1 <= numbers_per_prompt <= len(SENTENCES):
        raise ValueError(f"task.numbers_per_prompt={numbers_per_prompt} must be between 1 and {len(SENTENCES)}")
    if max_number < 1:
        raise ValueError(f"task.max_number={max_number} must be at least 1")
    rng = random.Random(f"regex_sum/{split}/{seed}")
    examples = []
    for _ in range(n):
        sentences = rng.sample(SENTENCES, numbers_per_prompt)
        paragraph = " ".join(s.format(name=rng.choice(NAMES), n=rng.randint(1, max_number)) for s in sentences)
        question = INSTRUCTION.format(paragraph=paragraph)
        examples.append(
            Example(format_prompt(question, prompt_style), sum_of_numbers(paragraph), {"question": question})
        )
    return examples


SANITY_CASES = (
    SanityCase(49, "12 + 37 = 49, so <ans>49</ans>", 1.0, "the sum in the tags"),
    SanityCase(49, "<ans> 49 </ans>", 1.0, "spaces inside the tags"),
    SanityCase(49, "<ans>49.0</ans>", 1.0, "49.0 is 49"),
    SanityCase(1049, "<ans>1,049</ans>", 1.0, "thousands separator"),
    SanityCase(49, "<ans>48</ans>", 0.0, "off by one"),
    SanityCase(49, "The sum is 49.", 0.0, "no tags"),
    SanityCase(49, "<ans>49</ans> or maybe <ans>50</ans>", 0.0, "two answers: a hedge"),
    SanityCase(49, "<ans>12+37=49</ans>", 0.0, "not a plain number"),
    SanityCase(49, "<ans>49", 0.0, "unclosed tag"),
)


@dataclass
class RegexSumTaskConfig(NumericCloseOptions, TaskConfig):
    """task=regex_sum's keys and the numeric tolerance."""

    numbers_per_prompt: int = positive(4, help="Numbers per paragraph (one per sentence), each in 1..task.max_number.")
    max_number: int = positive(99, help="The largest number a paragraph may hold.")


REGEX_SUM_TASK = TaskSpec(
    schema=RegexSumTaskConfig,
    name="regex_sum",
    reward_fn=regex_sum_reward_fn,
    build=build_regex_sum_examples,
    sanity_cases=SANITY_CASES,
    options=("numbers_per_prompt", "max_number"),
    reward_components=numeric_close_components,
    reward_options=("numeric_tolerance",),
)
