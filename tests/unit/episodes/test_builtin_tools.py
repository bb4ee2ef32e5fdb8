"""The shipped tools (grpo_cli/episodes/builtin_tools.py): the calculator evaluates arithmetic without eval."""

from __future__ import annotations

import pytest
from transformers.utils import get_json_schema

from grpo_cli.episodes.builtin_tools import calculator, evaluate_arithmetic, make_python_tool, python


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("(12 + 8) * 3 / 4", "15"),
        ("7 / 2", "3.5"),
        ("0.1 + 0.2", "0.3"),
        ("2 ^ 10", "1024"),
        ("2 ** -1", "0.5"),
        ("17 // 5 + 17 % 5", "5"),
        ("-(-3)", "3"),
        ("1,250,000 * 2", "2500000"),
        ("max(3, 9, 4) - min(2, 5)", "7"),
        ("sqrt(16) + abs(-2) + round(2.6)", "9"),
        ("10 ** 30", "1000000000000000000000000000000"),
        ("2 / 3", "0.666666666667"),
    ],
)
def test_calculator_values(expression: str, value: str) -> None:
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("__import__('os').system('ls')", "\"__import__('os').system('ls')\" is not allowed: use numbers"),
        ("(1).__class__", "'1 .__class__' is not allowed"),
        ("x + 1", "'x' is not allowed"),
        ("'a' * 3", "\"'a'\" is not allowed"),
        ("9 ** 9 ** 9", "the exponent 387420489 is too large (at most 10000)"),
        ("99999 ** 9999", "the result is too large"),
        ("1 / 0", "division by zero"),
        ("1, 2", "write one expression (numbers without thousands separators)"),
        ("2 +", "'2 +' is not an arithmetic expression"),
        ("", "the expression is empty"),
        ("round(2.5, ndigits=1)", "round() takes no keyword arguments here"),
        ("(-1) ** 0.5", "the result (6.123233995736766e-17+1j) is not a real number"),
    ],
)
def test_calculator_refuses_what_is_not_arithmetic(expression: str, error: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        evaluate_arithmetic(expression)
    assert str(excinfo.value).startswith(error)


def test_the_shipped_tools_have_json_schemas() -> None:
    schema = get_json_schema(calculator)["function"]
    assert schema["name"] == "calculator" and schema["parameters"]["required"] == ["expression"]
    python_schema = get_json_schema(python)["function"]
    assert python_schema["parameters"]["properties"]["code"]["type"] == "string"
    assert "at most 5 s of CPU time" in python_schema["parameters"]["properties"]["code"]["description"]
    custom = get_json_schema(make_python_tool(cpu_time_s=2, memory_mb=512))["function"]
    assert "at most 2 s of CPU time, 512 MB of memory" in custom["parameters"]["properties"]["code"]["description"]


def test_the_python_tool_runs_code_in_the_sandbox() -> None:
    assert python("print(sum(range(10)))") == "45"
    assert make_python_tool(max_output_bytes=5)("print('abcdefgh')") == (
        "abcde\n[output cut at 5 bytes: the program was stopped]"
    )
