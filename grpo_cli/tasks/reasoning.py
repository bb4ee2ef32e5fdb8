"""MATH and GSM8K: the r1_zero prompt by default (question_only as the alternative), graded by math-verify plus
MATH-style normalization (grpo_cli/tasks/graders.py).

Data comes from the hub through `datasets` (MATH 12K: `hiyouga/math12k`, whose test split is MATH-500;
GSM8K: `openai/gsm8k`, config `main`), or from local JSONL files (`task.train_path`, `task.eval_path`) in the
same formats, one object per line:

    MATH 12K style   {"problem": "...", "solution": "... \\boxed{answer} ..."}   (answer = the last \\boxed{})
    MATH-500 style   {"problem": "...", "answer": "...", ...}                    ("answer" wins over "solution")
    GSM8K            {"question": "...", "answer": "... #### 72"}                (answer = the text after ####)

Any of them also accepts the generic {"question": ..., "ground_truth": ...}, and `math` reads GSM8K lines too
(so GSM8K can be one of a math run's `task.eval_sets`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from grpo_cli.tasks.base import GroundTruth, RewardComponent, Row, RowError, SanityCase, TaskSpec
from grpo_cli.tasks.graders import (
    answers_equivalent,
    extract_final_answer,
    extract_r1_zero_answer,
    last_boxed,
    parse_number,
    question_only_reward_fn,
    r1_zero_reward_fn,
    vote_answer,
)
from grpo_cli.tasks.hub import load_hub_examples
from grpo_cli.tasks.schema import HubTaskConfig, NumericCloseOptions

HUB_OPTIONS = ("hub_dataset", "hub_config", "hub_train_split", "hub_eval_split")
# Row fields worth keeping next to each eval generation (never read by the rewards).
META_FIELDS = ("level", "subject", "type", "unique_id")


def _text_field(row: Row, key: str) -> str:
    value = row.get(key)
    if not isinstance(value, str | int | float) or isinstance(value, bool) or not str(value).strip():
        raise RowError(f"field {key!r} must be a non-empty string, got {value!r}")
    return str(value).strip()


def parse_math_row(row: Row) -> tuple[str, str, dict[str, Any]]:
    """A MATH row -> (problem, final answer, meta). "answer" (MATH-500) wins; else the solution's last \\boxed{}."""
    if "problem" not in row:
        if "question" in row and "ground_truth" in row:
            return _text_field(row, "question"), _text_field(row, "ground_truth"), {"question": row["question"]}
        if "question" in row and "answer" in row:  # a GSM8K line: GSM8K can be an eval set of a math run
            return parse_gsm8k_row(row)
        raise RowError(
            'missing field \'problem\' (MATH lines need "problem" plus "answer" or a "solution" with a '
            '\\boxed{} answer, or "question" and "ground_truth")'
        )
    problem = _text_field(row, "problem")
    if "answer" in row:
        answer = _text_field(row, "answer")
    elif "solution" in row:
        boxed = last_boxed(_text_field(row, "solution"))
        if not boxed or not boxed.strip():
            raise RowError("field 'solution' has no \\boxed{...} final answer: add one, or an \"answer\" field")
        answer = boxed.strip()
    else:
        raise RowError('missing field \'answer\' (MATH lines need "answer" or a "solution" with a \\boxed{} answer)')
    meta = {"question": problem, **{key: row[key] for key in META_FIELDS if key in row}}
    return problem, answer, meta


def gsm8k_final_answer(answer: str) -> str:
    """The number after the last `####` of a GSM8K answer, thousands separators removed."""
    if "####" not in answer:
        raise RowError("field 'answer' has no '#### <number>' final answer")
    final = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        raise RowError("field 'answer' is empty after '####'")
    return final


def parse_gsm8k_row(row: Row) -> tuple[str, str, dict[str, Any]]:
    """A GSM8K row -> (question, final answer, meta)."""
    if "question" not in row:
        raise RowError('missing field \'question\' (GSM8K lines need "question" and "answer" with "#### <number>")')
    question = _text_field(row, "question")
    if "answer" in row:
        return question, gsm8k_final_answer(_text_field(row, "answer")), {"question": question}
    if "ground_truth" in row:
        return question, _text_field(row, "ground_truth"), {"question": question}
    raise RowError('missing field \'answer\' (GSM8K lines need "question" and "answer" with "#### <number>")')


def numeric_close_components(prompt_style: str, numeric_tolerance: float = 0.01) -> dict[str, RewardComponent]:
    """`numeric_close`: 1 when the extracted answer is a number within a relative `numeric_tolerance` of the
    truth (a denser signal than exact match, for task.reward_weights)."""
    extract = extract_r1_zero_answer if prompt_style == "r1_zero" else extract_final_answer

    def numeric_close(response: str, ground_truth: GroundTruth) -> float:
        answer = extract(response)
        if answer is not None and prompt_style == "r1_zero":
            answer = last_boxed(answer) or answer
        value, truth = parse_number(answer), parse_number(str(ground_truth))
        if value is None or truth is None:
            return 0.0
        return float(abs(value - truth) <= numeric_tolerance * max(1.0, abs(truth)))

    return {"numeric_close": numeric_close}


# ----------------------------------------------------------------------------------------------------------
# Sanity cases (job=check_reward): what a careful reader expects of each rule.

R1_ZERO_CASES = (
    SanityCase("\\frac{1}{2}", "Half of one. </think> <answer>\\frac{1}{2}</answer>", 1.0, "exact answer in the tags"),
    SanityCase("\\frac{1}{2}", "Divide. </think> <answer>0.5</answer>", 1.0, "0.5 equals 1/2 (math-verify)"),
    SanityCase("\\frac{1}{2}", "x </think> <answer>So $\\boxed{\\dfrac12}$.</answer>", 1.0, "boxed \\dfrac12"),
    SanityCase("3\\sqrt{2}", "</think> <answer>\\sqrt{18}</answer>", 1.0, "sqrt(18) = 3 sqrt(2)"),
    SanityCase("[1,2)", "</think> <answer>(1,2)</answer>", 0.0, "open interval is not half-open"),
    SanityCase("\\frac{1}{2}", "</think> <answer>\\frac{1}{3}</answer>", 0.0, "formatted but wrong: reward 0"),
    SanityCase("\\frac{1}{2}", "The answer is \\frac{1}{2}.", 0.0, "no tags: format 0"),
    SanityCase("\\frac{1}{2}", "</think><answer>\\frac{1}{2}</answer>", 0.0, "no space between the tags"),
    SanityCase("\\frac{1}{2}", "</think> <answer>\\frac{1}{2}", 0.0, "missing </answer>"),
    SanityCase("\\frac{1}{2}", "</think> <answer></answer>", 0.0, "empty answer"),
)

QUESTION_ONLY_CASES = (
    SanityCase("\\frac{1}{2}", "So the result is $\\boxed{\\frac{1}{2}}$.", 1.0, "last \\boxed{}"),
    SanityCase("12", "First \\boxed{10}, then corrected: \\boxed{12}", 1.0, "the last \\boxed{} counts"),
    SanityCase("18", "She has 5 + 13 = 18 apples. The answer is 18.", 1.0, "text after 'The answer is'"),
    SanityCase("18", "She has 5 + 13 = 18 apples.", 1.0, "last number"),
    SanityCase("18", "She has 5 + 13 = 19 apples.", 0.0, "wrong last number"),
    SanityCase("\\frac{1}{2}", "I do not know.", 0.0, "no answer at all"),
)

GSM8K_R1_ZERO_CASES = (
    SanityCase("72", "48 + 24 = 72 </think> <answer>72</answer>", 1.0, "plain number"),
    SanityCase("72", "</think> <answer>$72.00</answer>", 1.0, "dollar sign and trailing zeros"),
    SanityCase("1000", "</think> <answer>1,000 dollars</answer>", 1.0, "thousands separator and unit word"),
    SanityCase("72", "</think> <answer>\\boxed{72}</answer>", 1.0, "boxed inside the tags"),
    SanityCase("72", "</think> <answer>71</answer>", 0.0, "off by one"),
    SanityCase("72", "</think> <answer>72 or 73</answer>", 0.0, "hedged answer"),
    SanityCase("72", "The answer is 72.", 0.0, "no tags: format 0"),
)

GSM8K_QUESTION_ONLY_CASES = (
    SanityCase("72", "48 + 24 = 72. The answer is 72.", 1.0, "text after 'The answer is'"),
    SanityCase("72", "Natalia sold 48 + 24 = 72 clips.", 1.0, "last number"),
    SanityCase("72", "#### 72", 1.0, "GSM8K's own #### marker"),
    SanityCase("72", "In May she sold 24 clips.", 0.0, "wrong last number"),
)

_build_math = functools.partial(load_hub_examples, parse_row=parse_math_row)
_build_gsm8k = functools.partial(load_hub_examples, parse_row=parse_gsm8k_row)


@dataclass
class MathTaskConfig(HubTaskConfig):
    """task=math: the hub keys, nothing of its own."""


@dataclass
class GSM8KTaskConfig(NumericCloseOptions, HubTaskConfig):
    """task=gsm8k: the hub keys and the numeric tolerance."""


MATH_TASK = TaskSpec(
    schema=MathTaskConfig,
    name="math",
    reward_fn=question_only_reward_fn,
    build=_build_math,
    sanity_cases=QUESTION_ONLY_CASES,
    options=HUB_OPTIONS,
    parse_row=parse_math_row,
    reward_fns_by_prompt={"r1_zero": r1_zero_reward_fn},
    sanity_cases_by_prompt={"r1_zero": R1_ZERO_CASES},
    extract_answer=vote_answer,
    same_answer=answers_equivalent,
)

GSM8K_TASK = TaskSpec(
    schema=GSM8KTaskConfig,
    name="gsm8k",
    reward_fn=question_only_reward_fn,
    build=_build_gsm8k,
    sanity_cases=GSM8K_QUESTION_ONLY_CASES,
    options=HUB_OPTIONS,
    parse_row=parse_gsm8k_row,
    reward_fns_by_prompt={"r1_zero": r1_zero_reward_fn},
    sanity_cases_by_prompt={"r1_zero": GSM8K_R1_ZERO_CASES},
    reward_components=numeric_close_components,
    reward_options=("numeric_tolerance",),
    extract_answer=vote_answer,
    same_answer=answers_equivalent,
)
