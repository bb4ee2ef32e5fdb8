"""Built-in tasks with tools (multi-turn episodes, docs/multi-turn.md): task=gsm8k_tools (GSM8K with the
`calculator` tool) and task=python_math (MATH with the sandboxed `python` tool).

Their data and graders are gsm8k's and math's (tasks/reasoning.py: the hub datasets, or local JSONL files in the
same formats through task.train_path / task.eval_path); their prompts are chat conversations with a system
message that offers the tool and asks for the final answer in a form the grader reads ("The answer is 72." /
\\boxed{...}). The tools themselves come from conf/task/<name>.yaml's task.tools (a user may swap or add some),
and the reward grades the episode's last model turn, as question_only grades a single response. No torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from grpo_cli.tasks.base import Prompt, SanityCase, TaskSpec
from grpo_cli.tasks.graders import answers_equivalent, question_only_reward_fn, vote_answer
from grpo_cli.tasks.hub import load_hub_examples
from grpo_cli.tasks.reasoning import (
    HUB_OPTIONS,
    GSM8KTaskConfig,
    MathTaskConfig,
    numeric_close_components,
    parse_gsm8k_row,
    parse_math_row,
)

GSM8K_TOOLS_SYSTEM = (
    "Solve the grade-school math problem. You can call the calculator tool to do arithmetic. When you know the "
    "result, end your reply with: The answer is <number>."
)
PYTHON_MATH_SYSTEM = (
    "Solve the math problem. You can run Python code with the python tool; print the values you want to see. "
    "Put your final answer in \\boxed{}."
)


def chat_with_system(system: str) -> Callable[[str, str], Prompt]:
    """(question, prompt style) -> the chat prompt: `system`, then the question. Episodes are conversations, so
    these tasks have only the chat style (validate_task_config rejects the others)."""

    def prompt(question: str, style: str) -> Prompt:
        if style != "chat":
            raise ValueError(f"task.prompt={style}: a task with tools has chat prompts only: use task.prompt=chat")
        return [{"role": "system", "content": system}, {"role": "user", "content": question}]

    return prompt


_CALL_48_24 = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "48 + 24"}}\n</tool_call>'
GSM8K_QUESTION = "Natalia sold 48 clips in April and 24 clips in May. How many clips did she sell in all?"

_BAD_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "48 +"}}\n</tool_call>'
GSM8K_TOOLS_CASES = tuple(
    SanityCase(
        "72",
        turns[-1],
        expected,
        why,
        turns=turns,
        prompt=chat_with_system(GSM8K_TOOLS_SYSTEM)(GSM8K_QUESTION, "chat"),
    )
    for turns, expected, why in (
        ((_CALL_48_24, "She sold 48 + 24 = 72 clips. The answer is 72."), 1.0, "calls the calculator, answers 72"),
        (("The answer is 72.",), 1.0, "answers without a tool call (the episode ends after its first turn)"),
        ((_CALL_48_24, "So the answer is 70."), 0.0, "calls the calculator, then answers wrong"),
        ((_BAD_CALL,) * 4, 0.0, "a malformed expression until task.max_turns: no answer"),
    )
)

_PY_CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(sum(range(1, 11)))"}}\n</tool_call>'
_PY_ERROR = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1 / 0)"}}\n</tool_call>'
MATH_QUESTION = "What is the sum of the integers from 1 to 10?"
PYTHON_MATH_CASES = tuple(
    SanityCase(
        truth,
        turns[-1],
        expected,
        why,
        turns=turns,
        prompt=chat_with_system(PYTHON_MATH_SYSTEM)(MATH_QUESTION, "chat"),
    )
    for truth, turns, expected, why in (
        ("55", (_PY_CALL, "The program printed 55, so the sum is $\\boxed{55}$."), 1.0, "runs code, boxes 55"),
        ("55", (_PY_CALL, "The sum is $\\boxed{56}$."), 0.0, "runs code, boxes a wrong answer"),
        ("55", ("$1 + 2 + \\dots + 10 = \\boxed{55}$",), 1.0, "answers without running code"),
        ("55", (_PY_ERROR, "The code failed; by hand the sum is $\\boxed{55}$."), 1.0, "reads the traceback, answers"),
    )
)


@dataclass
class GSM8KToolsTaskConfig(GSM8KTaskConfig):
    """task=gsm8k_tools: gsm8k's keys; conf/task/gsm8k_tools.yaml gives task.tools.calculator."""


@dataclass
class PythonMathTaskConfig(MathTaskConfig):
    """task=python_math: math's keys; conf/task/python_math.yaml gives task.tools.python."""


GSM8K_TOOLS_TASK = TaskSpec(
    schema=GSM8KToolsTaskConfig,
    name="gsm8k_tools",
    reward_fn=question_only_reward_fn,
    build=functools.partial(
        load_hub_examples, parse_row=parse_gsm8k_row, prompt_format=chat_with_system(GSM8K_TOOLS_SYSTEM)
    ),
    sanity_cases=GSM8K_TOOLS_CASES,
    options=HUB_OPTIONS,
    parse_row=parse_gsm8k_row,
    prompt_format=chat_with_system(GSM8K_TOOLS_SYSTEM),
    prompt_styles=("chat",),
    reward_components=numeric_close_components,
    reward_options=("numeric_tolerance",),
    extract_answer=vote_answer,
    same_answer=answers_equivalent,
)

PYTHON_MATH_TASK = TaskSpec(
    schema=PythonMathTaskConfig,
    name="python_math",
    reward_fn=question_only_reward_fn,
    build=functools.partial(
        load_hub_examples, parse_row=parse_math_row, prompt_format=chat_with_system(PYTHON_MATH_SYSTEM)
    ),
    sanity_cases=PYTHON_MATH_CASES,
    options=HUB_OPTIONS,
    parse_row=parse_math_row,
    prompt_format=chat_with_system(PYTHON_MATH_SYSTEM),
    prompt_styles=("chat",),
    extract_answer=vote_answer,
    same_answer=answers_equivalent,
)
