"""Addition (course handout HW 4, section 2): "If you add {a} and {b}, what is the result?" under a system prompt
that asks for the strict template

    <think>
    ...
    </think>
    <answer>
    ...
    </answer>

Synthetic data: a in 10..99, b in 1..9, drawn from `task.data_seed` (the handout's `build_dataset`).

format_reward is the handout's own check, unchanged: `FORMAT_PATTERN.match(response.strip())` with its
`re.MULTILINE` pattern. Because of MULTILINE, `$` also matches at the end of an inner line, so text on a line
after `</answer>` still passes (text on the `</answer>` line itself does not). answer_reward is 1 iff the
response holds exactly one `<answer>...</answer>` block whose content is a plain number equal to a + b (`97`,
`97.0`; not `The result is 97`; two blocks are a hedge). reward = format AND answer, so the default
`task.reward_weights` (correctness 1) pays only a strictly formatted right sum; the handout trains on the format
alone: `task.reward_weights.correctness=0 task.reward_weights.format=1`.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from grpo_cli.tasks.base import Example, Prompt, SanityCase, TaskSpec
from grpo_cli.tasks.schema import TaskConfig

# Verbatim from the handout.
SYSTEM_PROMPT = (
    "You are a helpful assistant. First reason internally, then provide the user answer. "
    "Respond using the template:\n"
    "<think>\n"
    "...\n"
    "</think>\n"
    "<answer>\n"
    "...\n"
    "</answer>"
)
QUESTION = "If you add {a} and {b}, what is the result?"
FORMAT_PATTERN = re.compile(r"^<think>\n[\s\S]*\n</think>\n<answer>\n[\s\S]*\n</answer>$", re.MULTILINE)

# The template conflicts with r1_zero's one-line `</think> <answer>` and its prompt that ends inside <think>.
PROMPT_STYLES = ("chat", "question_only")

_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_PLAIN_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def addition_prompt(question: str, style: str) -> Prompt:
    """chat: the handout's system + user messages; question_only: the same two texts as one plain prompt (for
    models without a chat template, the way the MedCalc handout writes its system prompt into the text)."""
    if style == "chat":
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    if style == "question_only":
        return f"{SYSTEM_PROMPT}\n\n{question}"
    raise ValueError(
        f"task=addition has its own <think>/<answer> template: use task.prompt={' or '.join(PROMPT_STYLES)}"
    )


def strict_format_ok(response: str) -> bool:
    """The handout's `format_reward` for one response."""
    return FORMAT_PATTERN.match(response.strip()) is not None


def extract_sum(response: str) -> float | None:
    """The number in the one `<answer>...</answer>` block, or None (no block, several, or not a plain number)."""
    blocks = _ANSWER_BLOCK.findall(response)
    if len(blocks) != 1 or not _PLAIN_NUMBER.fullmatch(blocks[0].strip()):
        return None
    return float(blocks[0].strip())


def addition_reward_fn(response: str, ground_truth: int) -> dict[str, float]:
    """{"reward": strict format AND right sum, "format_reward": the handout's strict format,
    "answer_reward": the one <answer> block holds a + b, "unparseable": no number to read}."""
    value = extract_sum(response)
    formatted = strict_format_ok(response)
    correct = value is not None and value == float(ground_truth)
    return {
        "reward": float(formatted and correct),
        "format_reward": float(formatted),
        "answer_reward": float(correct),
        "unparseable": float(value is None),
    }


def build_addition_examples(split: str, n: int | None, seed: int, prompt_style: str = "chat") -> list[Example]:
    """Deterministic synthetic examples (a in 10..99, b in 1..9); train and eval draw from disjoint seeds."""
    if n is None:
        n = 2000 if split == "train" else 256
    rng = random.Random(f"addition/{split}/{seed}")
    examples = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(1, 9)
        question = QUESTION.format(a=a, b=b)
        examples.append(Example(addition_prompt(question, prompt_style), a + b, {"question": question}))
    return examples


_GOOD = "<think>\n90 + 7 = 97\n</think>\n<answer>\n97\n</answer>"
SANITY_CASES = (
    SanityCase(97, _GOOD, 1.0, "the strict template with the right sum"),
    SanityCase(
        97, f"\n  {_GOOD}\n\n", 1.0, "whitespace around the response is stripped first (the handout's .strip())"
    ),
    SanityCase(97, "<think>\n90 + 7 = 97\n</think>\n<answer>\n97.0\n</answer>", 1.0, "97.0 is 97"),
    SanityCase(97, "<think>\n\n</think>\n<answer>\n97\n</answer>", 1.0, "empty reasoning still fits the template"),
    SanityCase(
        97,
        f"{_GOOD}\nHope this helps!",
        1.0,
        "a later line after </answer> passes: the handout's pattern is re.MULTILINE, so $ matches at a line end",
    ),
    SanityCase(97, "<think>\n90 + 7 = 96\n</think>\n<answer>\n96\n</answer>", 0.0, "formatted, wrong sum"),
    SanityCase(97, "<think>90 + 7 = 97</think>\n<answer>97</answer>", 0.0, "tags not on lines of their own"),
    SanityCase(97, "<answer>\n97\n</answer>", 0.0, "no <think> block"),
    SanityCase(97, f"{_GOOD} Hope this helps!", 0.0, "text right after </answer> on its line"),
    SanityCase(97, "<think>\n90 + 7\n</think>\n<answer>\nThe result is 97\n</answer>", 0.0, "not a plain number"),
    SanityCase(97, f"{_GOOD}\n<answer>\n98\n</answer>", 0.0, "two answers: a hedge (the format alone passes)"),
    SanityCase(97, "The result is 97.", 0.0, "no template at all"),
)


@dataclass
class AdditionTaskConfig(TaskConfig):
    """task=addition: synthetic data from task.data_seed, nothing of its own."""


ADDITION_TASK = TaskSpec(
    schema=AdditionTaskConfig,
    name="addition",
    reward_fn=addition_reward_fn,
    build=build_addition_examples,
    sanity_cases=SANITY_CASES,
    prompt_format=addition_prompt,
    prompt_styles=PROMPT_STYLES,
)
