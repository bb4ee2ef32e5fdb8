"""MedCalc-Bench (course handout "Reinforcement Learning Fine-Tuning with GRPO"): compute a clinical value from a
patient note, reasoning in <think>...</think> and answering in <answer>...</answer>.

Data comes from the hub dataset `ncbi/MedCalc-Bench-v1.0` (train 10,053 rows, test 1,047) through `datasets`, or
from local JSONL files (`task.train_path`, `task.eval_path`) with the dataset's own columns, one object per line:

    {"Patient Note": "...", "Question": "...", "Ground Truth Answer": "26.122", ...}

The other columns (Calculator Name, Category, ...) are optional and kept next to each eval generation.

The prompt is the handout's `build_prompt`, one plain text that carries its own system prompt; `task.prompt=
question_only` (the default) feeds it as is, as the handout does, and `chat` sends it as one user message.

The rewards are the handout's three functions, unchanged:
    correctness   its exact_answer_reward: the first <answer>...</answer> block, stripped, equals the ground truth
                  text (also answer_reward; the <think> block is not required)
    format        its format_reward: `<think>.*?</think>\\s*<answer>.*?</answer>` anywhere in the response
    numeric_close its numeric_tolerance_reward: the number right after `<answer>` (closing tag not required) is
                  within an absolute `task.answer_atol` (0.5) of the first number in the ground truth
The handout trains on format + numeric tolerance, which conf/task/medcalc.yaml sets as task.reward_weights.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from grpo_cli.config.fields import non_negative
from grpo_cli.tasks.base import GroundTruth, RewardComponent, Row, RowError, SanityCase, TaskSpec
from grpo_cli.tasks.hub import load_hub_examples
from grpo_cli.tasks.reasoning import HUB_OPTIONS
from grpo_cli.tasks.schema import HubTaskConfig

# Verbatim from the handout.
SYSTEM_PROMPT = (
    "You are a clinical calculator assistant. "
    "Provide concise reasoning in <think>...</think> and the final numeric result in <answer>...</answer>."
)
PROMPT = "{system}\n\nPatient Note: {note}\nQuestion: {question}\nAnswer with <think> and <answer> tags."
FORMAT_PATTERN = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ANSWER_NUMBER = re.compile(r"<answer>\s*([+-]?[0-9]*\.?[0-9]+)")
_NUMBER = re.compile(r"([+-]?[0-9]*\.?[0-9]+)")

# r1_zero's template ends inside "<think>", so a response could never hold the <think> tag the format asks for.
PROMPT_STYLES = ("question_only", "chat")
# Columns worth keeping next to each eval generation (never read by the rewards).
META_FIELDS = ("Row Number", "Calculator ID", "Calculator Name", "Category", "Output Type", "Note ID")
REQUIRED_FIELDS = ("Patient Note", "Question", "Ground Truth Answer")


def _column(row: Row, key: str) -> str:
    if key not in row:
        raise RowError(f"missing field {key!r} (MedCalc-Bench lines need {', '.join(map(repr, REQUIRED_FIELDS))})")
    value = row[key]
    # The hub stores every answer as text; a JSONL file may hold a bare number.
    if not isinstance(value, str | int | float) or isinstance(value, bool) or not str(value).strip():
        raise RowError(f"field {key!r} must be a non-empty string, got {value!r}")
    return str(value).strip()


def medcalc_prompt_text(note: str, question: str) -> str:
    """The handout's `build_prompt`: system prompt, patient note, question and the tag instruction."""
    return PROMPT.format(system=SYSTEM_PROMPT, note=note, question=question)


def parse_medcalc_row(row: Row) -> tuple[str, str, dict[str, Any]]:
    """A MedCalc-Bench row -> (the handout's prompt text, ground truth answer text, meta)."""
    note, question, answer = (_column(row, key) for key in REQUIRED_FIELDS)
    meta = {"question": question, **{key: row[key] for key in META_FIELDS if key in row}}
    return medcalc_prompt_text(note, question), answer, meta


def format_ok(response: str) -> bool:
    """The handout's format_reward for one response."""
    return isinstance(response, str) and FORMAT_PATTERN.search(response) is not None


def first_answer(response: str) -> str | None:
    """The stripped content of the first <answer>...</answer> block, or None without one."""
    match = _ANSWER_BLOCK.search(response)
    return match.group(1).strip() if match else None


def within_atol(response: str, ground_truth: str, atol: float) -> bool:
    """The handout's numeric_tolerance_reward: |number after <answer> - first number of the truth| <= atol."""
    pred, truth = _ANSWER_NUMBER.search(response), _NUMBER.search(str(ground_truth))
    if pred is None or truth is None:
        return False
    return abs(float(pred.group(1)) - float(truth.group(1))) <= atol


def medcalc_reward_fn(response: str, ground_truth: str) -> dict[str, float]:
    """{"reward" = "answer_reward": the exact answer, "format_reward": the handout's format,
    "unparseable": no <answer> block}."""
    answer = first_answer(response)
    exact = answer is not None and answer == str(ground_truth).strip()
    return {
        "reward": float(exact),
        "format_reward": float(format_ok(response)),
        "answer_reward": float(exact),
        "unparseable": float(answer is None),
    }


def numeric_close_components(prompt_style: str, answer_atol: float = 0.5) -> dict[str, RewardComponent]:
    """`numeric_close`: the handout's numeric tolerance, an absolute difference of at most `task.answer_atol`."""
    del prompt_style  # the <answer> tags are asked for by the prompt text itself under every style
    if not answer_atol >= 0:  # also rejects nan, which no difference would ever be within
        raise ValueError(f"task.answer_atol={answer_atol} must be >= 0")

    def numeric_close(response: str, ground_truth: GroundTruth) -> float:
        return float(within_atol(response, ground_truth, answer_atol))

    return {"numeric_close": numeric_close}


_THINK = "<think>\nBMI = 80 kg / (1.75 m)^2 = 26.122\n</think>\n"
SANITY_CASES = (
    SanityCase("26.122", f"{_THINK}<answer>26.122</answer>", 1.0, "the exact answer"),
    SanityCase("26.122", f"{_THINK}<answer>\n 26.122 \n</answer>", 1.0, "spaces inside the tags are stripped"),
    SanityCase("26.122", "<answer>26.122</answer>", 1.0, "exact answer ignores the format (its own component)"),
    SanityCase("03/15/2024", "<think>LMP + 280 days</think><answer>03/15/2024</answer>", 1.0, "dates match as text"),
    SanityCase(
        "26.122",
        f"{_THINK}<answer>26.122</answer> or <answer>30</answer>",
        1.0,
        "the first <answer> block counts (the handout's re.search)",
    ),
    SanityCase("26.122", f"{_THINK}<answer>26.12</answer>", 0.0, "rounded: not exact (numeric_close still pays)"),
    SanityCase("26.122", f"{_THINK}<answer>26.122 kg/m^2</answer>", 0.0, "a unit makes the text differ"),
    SanityCase("26.122", f"{_THINK}<answer>30</answer> or <answer>26.122</answer>", 0.0, "only the first block"),
    SanityCase("26.122", f"{_THINK}The BMI is 26.122.", 0.0, "no <answer> tags"),
    SanityCase("26.122", f"{_THINK}<answer>26.122", 0.0, "unclosed <answer> tag"),
)

_build_medcalc = functools.partial(load_hub_examples, parse_row=parse_medcalc_row)


@dataclass
class MedcalcTaskConfig(HubTaskConfig):
    """task=medcalc: the hub keys and the answer tolerance."""

    answer_atol: float = non_negative(
        0.5, help="numeric_close: largest absolute difference from the ground truth's number that still counts."
    )


MEDCALC_TASK = TaskSpec(
    schema=MedcalcTaskConfig,
    name="medcalc",
    reward_fn=medcalc_reward_fn,
    build=_build_medcalc,
    sanity_cases=SANITY_CASES,
    options=HUB_OPTIONS,
    parse_row=parse_medcalc_row,
    reward_components=numeric_close_components,
    reward_options=("answer_atol",),
    prompt_styles=PROMPT_STYLES,
)
