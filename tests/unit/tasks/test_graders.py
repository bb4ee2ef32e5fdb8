"""Math graders against hand-written cases: each expected value is what a careful human reader says."""

import threading
import time

import pytest

from grpo_cli.tasks import graders, question_only_reward_fn, r1_zero_reward_fn, symbolic
from grpo_cli.tasks.graders import extract_final_answer, last_boxed, normalize_answer, parse_number

# r1_zero: (text inside <answer>...</answer>, ground truth, answer correct?). The response is
# "Reasoning. </think> <answer>" + text + "</answer>", so the format is always right here.
R1_ZERO_ANSWERS = [
    # equivalent forms: correct
    ("\\frac{1}{2}", "\\frac{1}{2}", True),
    ("0.5", "\\frac{1}{2}", True),
    ("1/2", "\\frac{1}{2}", True),
    ("\\dfrac{1}{2}", "\\frac12", True),
    ("\\tfrac12", "0.5", True),
    ("\\boxed{\\frac{3}{4}}", "\\frac34", True),
    ("The answer is $\\boxed{5}$.", "5", True),
    ("2\\sqrt{2}", "\\sqrt{8}", True),
    ("\\sqrt{18}", "3\\sqrt{2}", True),
    ("45^\\circ", "45", True),
    ("45", "45^\\circ", True),
    ("5\\text{ cm}", "5", True),
    ("12\\text{ cm}^2", "12", True),
    ("1,000", "1000", True),
    ("1{,}000", "1000", True),
    ("\\$18.00", "18", True),
    ("18 dollars", "18", True),
    ("x = 5", "5", True),
    ("10\\%", "10", True),
    ("\\left( 3, -1 \\right)", "(3,-1)", True),
    ("[2, 5)", "[2,5)", True),
    ("(-\\infty, 3]", "(-\\infty,3]", True),
    ("\\{2, 1\\}", "\\{1,2\\}", True),
    ("x^2+2x+1", "(x+1)^2", True),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt{3}", True),
    ("\\text{(B)}", "B", True),
    ("3.0", "3", True),
    (".5", "0.5", True),
    ("-\\frac{2}{3}", "\\frac{-2}{3}", True),
    ("\\frac{9\\pi}{4}", "\\frac{9}{4}\\pi", True),
    ("y = 2x+3", "y=2x+3", True),
    ("7, 5", "5, 7", True),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", True),
    ("\\text{5}", "5", True),
    ("$5$", "5", True),
    ("2^{10}", "1024", True),
    ("10!", "3628800", True),
    ("\\infty", "\\infty", True),
    # near misses: formatted but wrong
    ("\\frac{1}{3}", "\\frac{1}{2}", False),
    ("0.33", "\\frac{1}{3}", False),
    ("-5", "5", False),
    ("[1,2)", "(1,2)", False),
    ("(1,2]", "(1,2)", False),
    ("(2,1)", "(1,2)", False),
    ("12", "1,2", False),
    ("72 or 73", "72", False),
    ("\\sqrt{2}", "2", False),
    ("x^2+2x", "(x+1)^2", False),
    ("3.14", "\\pi", False),
    ("5 million", "5", False),
    ("Monday", "\\text{Tuesday}", False),
    ("1001", "1,000", False),
    ("x", "5", False),
    ("-\\infty", "\\infty", False),
]


@pytest.mark.parametrize(("answer", "truth", "correct"), R1_ZERO_ANSWERS, ids=lambda v: str(v)[:24])
def test_r1_zero_grades_the_answer_inside_the_tags(answer, truth, correct):
    result = r1_zero_reward_fn(f"Reasoning. </think> <answer>{answer}</answer>", truth)
    assert result == {
        "reward": float(correct),
        "format_reward": 1.0,
        "answer_reward": float(correct),
        "unparseable": 0.0,
    }


# Broken format: reward 0, format 0, the answer is not graded (even when it is right).
MALFORMED = [
    "</think><answer>5</answer>",  # no space between the tags
    "</think> <answer>5",  # no closing tag
    "<answer>5</answer>",  # no </think>
    "</think>  <answer>5</answer>",  # two spaces
    "</think>\n<answer>5</answer>",  # a newline is not the required space
    "</THINK> <ANSWER>5</ANSWER>",  # tags are case-sensitive
    "</answer> oops </think> <answer>5",  # the only </answer> comes before the answer
    "The answer is 5.",
    "",
]


@pytest.mark.parametrize("response", MALFORMED)
def test_r1_zero_malformed_tags_score_format_0(response):
    assert r1_zero_reward_fn(response, "5") == {
        "reward": 0.0,
        "format_reward": 0.0,
        "answer_reward": 0.0,
        "unparseable": 1.0,
    }


# Formatted, but nothing readable inside: format 1, answer 0, unparseable.
UNREADABLE = ["", "   ", "\\boxed{}", "\\frac{", "\\left(\\right.", "\\\\\\\\", "}{"]


@pytest.mark.parametrize("answer", UNREADABLE)
def test_r1_zero_empty_or_unreadable_answers_are_unparseable(answer):
    assert r1_zero_reward_fn(f"</think> <answer>{answer}</answer>", "5") == {
        "reward": 0.0,
        "format_reward": 1.0,
        "answer_reward": 0.0,
        "unparseable": 1.0,
    }


def test_r1_zero_reads_up_to_the_first_closing_tag():
    # generation stops at </answer>; a stray second one does not change the answer
    assert r1_zero_reward_fn("</think> <answer>5</answer></answer>", "5")["reward"] == 1.0
    assert r1_zero_reward_fn("</think> <answer>4</answer> 5", "5")["reward"] == 0.0


# question_only: (response, ground truth, an answer was found, correct)
QUESTION_ONLY = [
    ("So the answer is $\\boxed{\\frac{1}{2}}$.", "0.5", True, True),
    ("We get 5+13 = 18 apples.", "18", True, True),
    ("The answer is 18 apples.", "18", True, True),
    ("Final answer: 1,000", "1000", True, True),
    ("#### 72", "72", True, True),
    ("First \\boxed{10}, then I fixed it: \\boxed{12}", "12", True, True),
    ("First \\boxed{12}, then \\boxed{10}", "12", True, False),
    ("x - 3 = 0 gives x = 3", "3", True, True),
    ("The temperature is -4 degrees.", "-4", True, True),
    ("The answer is 2.", "3", True, False),
    ("Answer: $\\frac{3}{4}$", "0.75", True, True),
    ("The answer is \\boxed{\\frac12}. Check: 1/2 + 1/2 = 1", "\\frac12", True, True),
    ("I am not sure.", "5", False, False),
    ("", "5", False, False),
]


@pytest.mark.parametrize(("response", "truth", "found", "correct"), QUESTION_ONLY, ids=lambda v: str(v)[:24])
def test_question_only_takes_the_last_box_or_the_final_answer(response, truth, found, correct):
    result = question_only_reward_fn(response, truth)
    assert (result["format_reward"], result["answer_reward"], result["reward"]) == (
        float(found),
        float(correct),
        float(correct),
    )
    assert result["unparseable"] == float(not found)


def test_there_are_at_least_60_hand_written_grader_cases():
    assert len(R1_ZERO_ANSWERS) + len(MALFORMED) + len(UNREADABLE) + len(QUESTION_ONLY) >= 60


@pytest.mark.parametrize(
    ("answer", "normalized"),
    [
        ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}"),
        ("$18", "18"),
        ("\\$1,000.00", "1000"),
        ("45^{\\circ}", "45"),
        ("12\\text{ cm}^2", "12"),  # the unit's exponent goes with the unit, never onto the number
        ("\\text{(A)}", "(A)"),
        ("The answer is 18.", "18"),
        ("\\left( 1, 2 \\right)", "(1,2)"),
        ("1\\,000", "1000"),
        ("2.50", "2.5"),
        ("\\frac12", "\\frac{1}{2}"),
        ("\\sqrt2", "\\sqrt{2}"),
        ("3/4", "\\frac{3}{4}"),
        ("x = 5", "5"),
        ("(1,2)", "(1,2)"),  # a pair keeps its comma
        ("5 million", "5million"),  # scale words are not units
        ("2 and 3", "2and3"),
        ("10.05", "10.05"),  # only trailing zeros go
    ],
)
def test_normalize_answer(answer, normalized):
    assert normalize_answer(answer) == normalized


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        ("a \\boxed{1} b \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\fbox{7}", "7"),
        ("\\boxed 5 is it", "5"),
        ("\\boxed{5", None),
        ("no box", None),
    ],
)
def test_last_boxed_matches_braces(text, boxed):
    assert last_boxed(text) == boxed


def test_extract_final_answer_prefers_box_then_anchor_then_last_number():
    assert extract_final_answer("1 and \\boxed{2}, then 3") == "2"
    assert extract_final_answer("The answer is 7 cats. Then 9 more.") == "7 cats"
    assert extract_final_answer("x-3 and 1,200, ") == "1,200"
    assert extract_final_answer("no digits here") is None


def test_parse_number():
    assert parse_number("$1,234.50") == 1234.5
    assert parse_number("3/4") == 0.75
    assert parse_number("18 dollars") == 18.0
    assert parse_number("x+1") is None
    assert parse_number(None) is None


@pytest.mark.parametrize("bad", [None, 42, ["</think> <answer>5</answer>"]])
def test_graders_never_raise_on_odd_inputs(bad):
    for fn in (r1_zero_reward_fn, question_only_reward_fn):
        assert fn(bad, "5")["reward"] == 0.0
    # a numeric ground truth (GSM8K-style data) is compared as its text
    assert r1_zero_reward_fn("</think> <answer>72</answer>", 72)["reward"] == 1.0


@pytest.mark.alone  # a wall-clock bound
def test_an_answer_sympy_cannot_finish_is_wrong_within_the_time_limit(monkeypatch):
    # 10^(10^10) vs 1/2: sympy computes a ten-billion-digit power inside one C call; only killing the helper
    # process stops it.
    monkeypatch.setattr(graders, "MATH_VERIFY_TIME_LIMIT_S", 1.0)
    start = time.perf_counter()
    result = r1_zero_reward_fn("</think> <answer>10^{10^{10}}</answer>", "\\frac{1}{2}")
    assert time.perf_counter() - start < 1.0 + 3.0
    assert result == {"reward": 0.0, "format_reward": 1.0, "answer_reward": 0.0, "unparseable": 0.0}
    # the next call gets a fresh helper and grades normally
    assert r1_zero_reward_fn("</think> <answer>0.5</answer>", "\\frac{1}{2}")["reward"] == 1.0


@pytest.mark.alone  # a wall-clock bound
def test_the_time_limit_works_outside_the_main_thread(monkeypatch):
    monkeypatch.setattr(graders, "MATH_VERIFY_TIME_LIMIT_S", 1.0)
    results = {}

    def grade():
        start = time.perf_counter()
        results["slow"] = question_only_reward_fn("\\boxed{(10^{100})!}", "5")
        results["seconds"] = time.perf_counter() - start
        results["fast"] = question_only_reward_fn("\\boxed{\\sqrt{8}}", "2\\sqrt{2}")

    thread = threading.Thread(target=grade)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert results["slow"]["reward"] == 0.0 and results["seconds"] < 4.0
    assert results["fast"]["reward"] == 1.0


def test_in_process_fallback_grades_the_same_when_no_helper_can_start(monkeypatch):
    monkeypatch.setattr(symbolic._HELPER, "unavailable", True)
    assert r1_zero_reward_fn("</think> <answer>0.5</answer>", "\\frac{1}{2}")["reward"] == 1.0
    assert r1_zero_reward_fn("</think> <answer>[1,2)</answer>", "(1,2)")["reward"] == 0.0
