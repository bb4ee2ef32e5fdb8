"""The tools grpo-run ships: `calculator` (task=gsm8k_tools) and `python` (task=python_math).

Plain functions with type hints and a docstring, as a user's tools are (tools.load_tools reads their JSON schema
from them), referenced as `grpo_cli.episodes.builtin_tools:calculator`. A tool reports a mistake of the model by
raising: its message becomes the tool message the model reads.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from grpo_cli.sandbox import (
    SandboxLimits,
    SandboxSettings,
    current_settings,
    describe_run,
    on_configure,
    run,
    uses_sandbox,
)

# Exponents past this (and results past _MAX_POW_BITS bits) are refused: 9**9**9 would take minutes and gigabytes.
_MAX_EXPONENT = 10_000
_MAX_POW_BITS = 100_000

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., Any]] = {"abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt}
# 1,000,000 -> 1000000 (a thousands separator between digits; "max(1,000)" is then max(1000), as a person means it).
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression, evaluated from its syntax tree (no eval): numbers, + - * / // % and
    ** (or ^), parentheses, and abs, round, min, max, sqrt. ValueError, with what is wrong, for anything else."""
    text = _THOUSANDS.sub("", expression.strip()).replace("^", "**")
    if not text:
        raise ValueError("the expression is empty")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"{expression!r} is not an arithmetic expression") from None
    try:
        return _value(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("the result is too large") from None


def _value(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _number(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _number(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _number(_UNARY[type(node.op)](_value(node.operand)))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
        if node.keywords:
            raise ValueError(f"{node.func.id}() takes no keyword arguments here")
        try:
            return _number(_FUNCTIONS[node.func.id](*(_value(arg) for arg in node.args)))
        except TypeError as e:
            raise ValueError(str(e)) from None
    if isinstance(node, ast.Tuple):
        raise ValueError("write one expression (numbers without thousands separators)")
    shown = ast.unparse(node)
    raise ValueError(f"{shown!r} is not allowed: use numbers, + - * / // % ** ( ) and {', '.join(_FUNCTIONS)}")


def _number(value: object) -> int | float:
    """`value` when it is a real number (a negative number to a fractional power is complex: refused)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"the result {value} is not a real number")
    return value


def _check_power(base: int | float, exponent: int | float) -> None:
    if abs(exponent) > _MAX_EXPONENT:
        raise ValueError(f"the exponent {format_number(exponent)} is too large (at most {_MAX_EXPONENT})")
    if isinstance(base, int) and isinstance(exponent, int) and base.bit_length() * exponent > _MAX_POW_BITS:
        raise ValueError("the result is too large")


def format_number(value: int | float) -> str:
    """An integer as it is; a float with up to 12 significant digits (3.0 -> 3, 0.1 + 0.2 -> 0.3)."""
    if isinstance(value, float):
        return format(value, ".12g")
    return str(value)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: The expression, e.g. "(12 + 8) * 3 / 4": numbers, + - * / // % and ** (or ^), parentheses,
            and the functions abs, round, min, max, sqrt.
    """
    return format_number(evaluate_arithmetic(expression))


def make_python_tool(
    cpu_time_s: int | None = None,
    wall_time_s: float | None = None,
    memory_mb: int | None = None,
    max_output_bytes: int | None = None,
    max_file_mb: int | None = None,
    disk_mb: int | None = None,
    isolation: str | None = None,
) -> Callable[[str], str]:
    """The `python` tool with other limits than task.sandbox's (those not given: task.sandbox's), for a YAML node:
    `python: {_target_: grpo_cli.episodes.builtin_tools.make_python_tool, cpu_time_s: 10, wall_time_s: 20}`."""
    given = {
        "cpu_time_s": cpu_time_s,
        "wall_time_s": wall_time_s,
        "memory_mb": memory_mb,
        "max_output_bytes": max_output_bytes,
        "max_file_mb": max_file_mb,
        "disk_mb": disk_mb,
    }
    overrides: dict[str, Any] = {key: value for key, value in given.items() if value is not None}

    def limits() -> SandboxLimits:
        return replace(current_settings().limits, **overrides)

    def python(code: str) -> str:
        return describe_run(run(code, limits(), isolation), limits())

    python.__doc__ = _python_doc(limits())
    return uses_sandbox(python)


def _python_doc(limits: SandboxLimits) -> str:
    return f"""Run a Python 3 program and return what it prints (stdout and stderr).

    Args:
        code: The program. Print the values you want to see. Each call starts a fresh interpreter in an empty
            folder, without network access, with at most {limits.cpu_time_s} s of CPU time, {limits.memory_mb} MB of
            memory and {limits.max_output_bytes} bytes of output. numpy and sympy can be imported if installed.
    """


@uses_sandbox
def python(code: str) -> str:
    limits = current_settings().limits
    return describe_run(run(code, limits), limits)


def _describe_python(settings: SandboxSettings) -> None:
    python.__doc__ = _python_doc(settings.limits)


_describe_python(current_settings())
on_configure(_describe_python)
