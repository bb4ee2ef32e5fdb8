"""Math answer graders: the strict r1_zero rule and the question_only rule (docs/tasks.md). No torch.

Grading an answer against the ground truth takes two steps:
1. MATH-style string normalization of both sides (`normalize_answer`): equal non-empty strings are a match.
   This catches what a symbolic parser cannot read (text answers, units, `\\text{(A)}`) cheaply.
2. Otherwise math-verify parses both sides (each wrapped in `\\boxed{}` so the whole answer is one expression)
   and compares them symbolically and numerically: `\\frac{1}{2}` = `0.5`, `2\\sqrt{2}` = `\\sqrt{8}`,
   `[1,2)` != `(1,2)`, `\\{1,2\\}` = `\\{2,1\\}`.

math-verify's own timeouts use `signal.alarm`, which only works in the main thread (and cannot stop some
computations at all): the symbolic step runs in a helper process that is killed after
`MATH_VERIFY_TIME_LIMIT_S` (grpo_cli/tasks/symbolic.py). An answer that cannot be settled in time is scored
wrong. The reward functions never raise.

Every reward dict has the three required keys plus "unparseable": 1.0 when there was no answer to grade (no
answer tags, no \\boxed{} or final answer, an empty answer) or when the answer is not a readable expression.
Each response is exactly one of: correct, wrong, unparseable.
"""

from __future__ import annotations

import re

from grpo_cli.tasks.base import GroundTruth
from grpo_cli.tasks.symbolic import symbolic_match
from grpo_cli.usercode.timelimit import RewardTimeout

R1_ZERO_ANSWER_OPEN = "</think> <answer>"
ANSWER_CLOSE = "</answer>"
# Per call of the symbolic step (parse both sides + compare); far above the ~1-100 ms a normal answer takes.
MATH_VERIFY_TIME_LIMIT_S = 5.0
# No final answer is this long; a longer one is an essay inside the tags, not worth a symbolic parse.
MAX_SYMBOLIC_ANSWER_CHARS = 1000


# ----------------------------------------------------------------------------------------------------------
# Extraction


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in `text`, braces matched."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if text.startswith(" ", i):  # "\boxed 5": the argument is the next token
        match = re.match(r" +([^\s$]+)", text[i:])
        return match.group(1) if match else None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unbalanced: no complete boxed answer


def extract_r1_zero_answer(response: str) -> str | None:
    """The text between `</think> <answer>` and the next `</answer>`, or None when the format is broken."""
    start = response.find(R1_ZERO_ANSWER_OPEN)
    if start < 0:
        return None
    body_start = start + len(R1_ZERO_ANSWER_OPEN)
    end = response.find(ANSWER_CLOSE, body_start)
    if end < 0:
        return None
    return response[body_start:end]


_ANCHOR = re.compile(r"\banswer\s*(?:is|:)\s*:?\s*|####\s*", re.IGNORECASE)
# A minus sign counts only where it cannot be subtraction ("x-3" ends in 3, "is -3" in -3).
_NUMBER = re.compile(r"(?:(?<![\w)}])-)?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def extract_final_answer(response: str) -> str | None:
    """question_only extraction: the last `\\boxed{}`; else the text after the last "answer is" / "answer:" /
    "####" up to the end of its sentence; else the last number in the response. None if there is none."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    anchors = list(_ANCHOR.finditer(response))
    if anchors:
        tail = response[anchors[-1].end() :]
        sentence = re.split(r"\n|\.(?:\s|$)", tail, maxsplit=1)[0].strip()
        if sentence:
            return sentence
    numbers = _NUMBER.findall(response)
    return numbers[-1].rstrip(",") if numbers else None


# ----------------------------------------------------------------------------------------------------------
# MATH-style normalization

_LEAD_IN = re.compile(r"^(?:so,?\s*)?(?:the\s+)?(?:final\s+)?answer\s*(?:is|:)\s*:?\s*", re.IGNORECASE)
# Spacing and sizing commands; \left and \right only as delimiters' prefixes (not \leftarrow).
_SPACING = re.compile(r"\\[,;:! ]|\\q?quad|~|\\displaystyle|\\(?:left|right|[bB]igg?[lr]?)(?![a-zA-Z])")
_TEXT_CMD = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_TRAILING_UNIT = re.compile(r"^(.*[\d}])\s*\\(?:text|textrm|mathrm|mbox)\s*\{[^{}]*\}(?:\^\{?[23]\}?)?$")
_UNIT_WORDS = re.compile(r"^(-?\d[\d,]*(?:\.\d+)?)\s*((?:[A-Za-z]{2,}\.?\s*){1,3})$")
# Words after a number that change its value or its meaning: never dropped as units.
_NOT_UNITS = frozenset(
    "and or to plus minus times over thousand thousands million millions billion billions trillion hundred "
    "hundreds dozen dozens pi sqrt inf infinity".split()
)
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def _strip_outer_dollars(s: str) -> str:
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
            return s[len(left) : len(s) - len(right)].strip()
    return s


def _drop_unit_words(s: str) -> str:
    match = _UNIT_WORDS.match(s)
    if match and not any(w.strip(".").lower() in _NOT_UNITS for w in match.group(2).split()):
        return match.group(1)
    return s


def _fix_fracs_and_roots(s: str) -> str:
    # \frac12 -> \frac{1}{2}, \frac1{2} -> \frac{1}{2}, \frac{1}2 -> \frac{1}{2}, \sqrt2 -> \sqrt{2}
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    return re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", s)


def _strip_number_zeros(s: str) -> str:
    # 5.0 -> 5, 2.50 -> 2.5, .5 -> 0.5 (only whole numbers inside the answer, never digits of longer ones)
    s = re.sub(r"(?<![\d.])(\d+)\.0+(?![\d])", r"\1", s)
    s = re.sub(r"(?<![\d.])(\d+\.\d*?[1-9])0+(?![\d])", r"\1", s)
    return re.sub(r"(?<![\d])\.(\d)", r"0.\1", s)


def normalize_answer(answer: str) -> str:
    """MATH-style canonical form of a final answer: equal forms of one answer normalize to one string.

    Unwraps `\\boxed{}`, "the answer is", `$...$`, `\\left`/`\\right`, spacing commands and `\\text{}`; drops
    degrees, percent signs, dollar signs, trailing units (`5\\text{ cm}`, `18 dollars`) and thousands separators
    (`1,000`, `1{,}000`, `1\\,000`); `\\dfrac`/`\\tfrac` -> `\\frac`, `\\frac12` -> `\\frac{1}{2}`,
    `\\sqrt2` -> `\\sqrt{2}`, `a/b` -> `\\frac{a}{b}`; trailing zeros (`5.0`, `2.50`), a trailing period and
    an `x =` prefix; then removes all whitespace.
    """
    s = answer.strip()
    boxed = last_boxed(s)
    if boxed is not None:
        s = boxed.strip()
    s = _LEAD_IN.sub("", s)
    s = _strip_outer_dollars(s.rstrip(".").strip())
    s = s.replace("\\$", "").replace("$", "")
    s = _SPACING.sub(" ", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree", "", s)
    s = s.replace("\\%", "").replace("%", "")
    s = _TRAILING_UNIT.sub(r"\1", s.strip())
    s = _TEXT_CMD.sub(r"\1", s)
    s = _drop_unit_words(s.strip().rstrip(".").strip())
    s = re.sub(r"\s+", "", s).replace("{,}", ",")
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    s = _fix_fracs_and_roots(s)
    s = re.sub(r"^(-?\d+)/(\d+)$", r"\\frac{\1}{\2}", s)
    s = _strip_number_zeros(s)
    # "x=5" -> "5": a one-letter (or subscripted) variable on the left is not part of the answer.
    if s.count("=") == 1 and re.fullmatch(r"[A-Za-z](?:_\{?\w\}?)?", s.split("=")[0]):
        s = s.split("=")[1]
    return s.rstrip(".")


# ----------------------------------------------------------------------------------------------------------
# Grading


def grade_answer(answer: str | None, ground_truth: GroundTruth) -> tuple[bool, bool]:
    """(correct, unparseable) for an extracted answer against a ground truth (string or number)."""
    if answer is None:
        return False, True
    gold_text = str(ground_truth)
    pred, gold = normalize_answer(answer), normalize_answer(gold_text)
    if not pred:
        return False, True
    if pred == gold:
        return True, False
    if len(answer) > MAX_SYMBOLIC_ANSWER_CHARS:
        return False, False
    # Both the normalized and the raw text: normalization helps the parser on most answers, but a raw form
    # can still parse where a normalization step (e.g. a dropped trailing \text{}) went too far.
    pred_forms = list(dict.fromkeys((pred, answer.strip())))
    gold_forms = list(dict.fromkeys((gold, gold_text.strip())))
    try:
        parsed, match = symbolic_match(pred_forms, gold_forms, MATH_VERIFY_TIME_LIMIT_S)
    except RewardTimeout:
        return False, False  # an answer too pathological to compare in time is wrong, not unreadable
    return match, not parsed


def answers_equivalent(a: str, b: str) -> bool:
    """Whether two extracted answers are the same answer under the grading rule (equal after normalization, or
    equal for math-verify in its killable helper, within MATH_VERIFY_TIME_LIMIT_S): what majority voting groups
    by, so "0.5", "1/2" and "\\frac{1}{2}" vote together."""
    return grade_answer(a, b)[0]


def vote_answer(response: str, prompt_style: str) -> str | None:
    """The answer a math reward grades under `prompt_style`: r1_zero's tagged answer (its last \\boxed{} when
    it holds one), else question_only's extraction. None when there is none (that response does not vote)."""
    if prompt_style == "r1_zero":
        answer = extract_r1_zero_answer(response)
        if answer is None:
            return None
        answer = last_boxed(answer) or answer
    else:
        answer = extract_final_answer(response)
    return answer if answer is not None and answer.strip() else None


# ----------------------------------------------------------------------------------------------------------
# Reward functions


def _reward(format_ok: bool, correct: bool, unparseable: bool) -> dict[str, float]:
    return {
        "reward": float(format_ok and correct),
        "format_reward": float(format_ok),
        "answer_reward": float(correct),
        "unparseable": float(unparseable),
    }


def r1_zero_reward_fn(response: str, ground_truth: GroundTruth) -> dict[str, float]:
    """The strict r1_zero rule (docs/tasks.md).

    format_reward 1 iff the response contains `</think> <answer>` followed later by `</answer>`; the answer is
    the text between them (or its last `\\boxed{}`), graded against `ground_truth`. reward = format AND correct,
    so a formatted wrong answer scores format 1, answer 0, reward 0; a broken format scores 0 and is not graded.
    """
    try:
        answer = extract_r1_zero_answer(response) if isinstance(response, str) else None
        if answer is None:
            return _reward(False, False, True)
        correct, unparseable = grade_answer(answer, ground_truth)
        return _reward(True, correct, unparseable)
    except Exception:  # noqa: BLE001 - graders never crash a run
        return _reward(False, False, True)


def question_only_reward_fn(response: str, ground_truth: GroundTruth) -> dict[str, float]:
    """question_only: no format required. The answer is the last `\\boxed{}`, else the text after the last
    "answer is" / "answer:" / "####", else the last number. format_reward 1 iff an answer was found;
    reward = answer_reward = correct."""
    try:
        answer = extract_final_answer(response) if isinstance(response, str) else None
        correct, unparseable = grade_answer(answer, ground_truth)
        return _reward(answer is not None, correct, unparseable)
    except Exception:  # noqa: BLE001 - graders never crash a run
        return _reward(False, False, True)


def parse_number(text: str | None) -> float | None:
    """A plain number from an answer (`1,234`, `$18.50`, `-3`, `3/4`, `18 dollars`), else None."""
    if text is None:
        return None
    s = normalize_answer(text)
    match = re.fullmatch(r"\\frac\{(-?\d+)\}\{(\d+)\}", s)
    try:
        if match:
            return int(match.group(1)) / int(match.group(2))
        return float(s)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
