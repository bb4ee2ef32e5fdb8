"""Reading tool calls from an assistant turn (grpo_cli/episodes/tool_calls.py): pure functions, no model."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import pytest

from grpo_cli.episodes.tool_calls import (
    HERMES,
    TOOL_CALL_FORMATS,
    ToolCall,
    ToolCallError,
    ToolCallFormat,
    argument_problem,
    parse_tool_calls,
    tool_call_format,
)
from grpo_cli.errors import UserFacingError

SCHEMAS = {
    "calculator": {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
    "search": {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "limit": {"type": "integer"},
                    "score": {"type": "number"},
                    "mode": {"type": "string", "enum": ["fast", "exact"]},
                },
                "required": ["query"],
            },
        },
    },
}


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_hermes_reads_every_call_of_a_turn_in_order() -> None:
    text = f"Let me compute.\n{call('calculator', expression='2+3')}\nand\n{call('search', query='x', limit=3)}"
    assert parse_tool_calls(text, HERMES, SCHEMAS) == [
        ToolCall("calculator", {"expression": "2+3"}),
        ToolCall("search", {"query": "x", "limit": 3}),
    ]


def test_a_turn_without_calls_is_a_final_answer() -> None:
    assert parse_tool_calls("The answer is 5.", HERMES, SCHEMAS) == []


def test_a_call_left_open_at_the_end_is_read_and_a_cut_one_is_invalid_json() -> None:
    whole = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}'
    assert parse_tool_calls(whole, HERMES, SCHEMAS) == [ToolCall("calculator", {"expression": "1+1"})]
    [cut] = parse_tool_calls('<tool_call>{"name": "calculator", "argu', HERMES, SCHEMAS)
    assert isinstance(cut, ToolCallError) and cut.message.startswith("error: the tool call is not valid JSON")


def test_mistakes_become_error_texts_the_model_reads() -> None:
    text = "".join(
        [
            "<tool_call>{not json}</tool_call>",
            '<tool_call>["calculator"]</tool_call>',
            call("weather", city="Paris"),
            call("calculator"),
            call("calculator", expression="1", precision=3),
            call("search", query="x", limit="3"),
            call("search", query="x", limit=True),
            call("search", query="x", mode="slow"),
            '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>',
        ]
    )
    errors = parse_tool_calls(text, HERMES, SCHEMAS)
    assert all(isinstance(e, ToolCallError) for e in errors)
    messages = [e.message for e in errors if isinstance(e, ToolCallError)]
    assert messages[0].startswith("error: the tool call is not valid JSON (Expecting property name")
    assert messages[0].endswith('write {"name": <function-name>, "arguments": <args-json-object>}')
    assert messages[1] == (
        'error: a tool call is a JSON object with a name: write {"name": <function-name>, "arguments": '
        "<args-json-object>}"
    )
    assert messages[2] == "error: there is no tool named 'weather'; the tools are: calculator, search"
    assert messages[3] == "error: tool calculator misses argument expression"
    assert messages[4] == "error: tool calculator has no argument precision (it takes expression)"
    assert messages[5] == 'error: tool search argument limit must be integer, not a string ("3")'
    assert messages[6] == "error: tool search argument limit must be integer, not a boolean (true)"
    assert messages[7] == "error: tool search argument mode must be ['fast', 'exact'], not a string (\"slow\")"
    assert messages[8] == "error: the arguments of tool calculator are a JSON object, not an array"
    assert [e.name for e in errors if isinstance(e, ToolCallError)] == [
        None, None, "weather", "calculator", "calculator", "search", "search", "search", "calculator"
    ]  # fmt: skip


def test_arguments_as_a_json_string_and_llama_parameters_are_read() -> None:
    as_string = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"4*2\\"}"}</tool_call>'
    as_parameters = '<tool_call>{"name": "calculator", "parameters": {"expression": "4*2"}}</tool_call>'
    expected = [ToolCall("calculator", {"expression": "4*2"})]
    assert parse_tool_calls(as_string, HERMES, SCHEMAS) == expected
    assert parse_tool_calls(as_parameters, HERMES, SCHEMAS) == expected


def test_numbers_integers_and_nullable_arguments() -> None:
    schema = {"parameters": {"properties": {"x": {"type": "number"}, "y": {"type": "integer", "nullable": True}}}}
    assert argument_problem({"x": 1, "y": None}, schema) is None
    assert argument_problem({"x": 1.5, "y": 2}, schema) is None
    assert argument_problem({"y": 2.5}, schema) == "argument y must be integer, not a number (2.5)"


def test_the_format_comes_from_the_key_the_template_or_the_default() -> None:
    assert tool_call_format("hermes", None, renders_tools=False) is HERMES
    assert tool_call_format(None, "... {{- '<tool_call>' }} ...", renders_tools=True) is HERMES
    assert tool_call_format(None, "{{ message.content }}", renders_tools=False) is HERMES  # the default prompt's
    with pytest.raises(UserFacingError) as unknown_key:
        tool_call_format("pythonic", None, renders_tools=False)
    assert (
        str(unknown_key.value) == "task.tool_call_format=pythonic is not a tool-call format grpo-run reads: use hermes"
    )
    with pytest.raises(UserFacingError, match=r"renders tools, but in none of the tool-call formats grpo-run reads"):
        tool_call_format(None, "{{ tools | tojson }}<|python_tag|>", renders_tools=True)


def test_the_names_a_task_may_declare_are_the_formats_read_here() -> None:
    """task.tool_call_format's allowed values are declared in tasks/ (the schema imports no episode code); each must
    be a format this module reads, and each format read here must be one a task can name."""
    from grpo_cli.tasks.schema import TOOL_CALL_FORMAT_NAMES

    assert sorted(TOOL_CALL_FORMAT_NAMES) == sorted(TOOL_CALL_FORMATS)
    assert len(set(TOOL_CALL_FORMAT_NAMES)) == len(TOOL_CALL_FORMAT_NAMES)
    assert all(fmt.name == name for name, fmt in TOOL_CALL_FORMATS.items())


def test_a_format_added_to_the_registry_is_found_by_its_marker_and_used(monkeypatch: pytest.MonkeyPatch) -> None:
    def find_bracketed(text: str) -> list[str]:
        return [line.removeprefix("[CALL]") for line in text.splitlines() if line.startswith("[CALL]")]

    def write_bracketed(name: str, arguments: object) -> str:
        return "[CALL]" + json.dumps({"name": name, "arguments": arguments})

    bracketed = ToolCallFormat(
        "bracketed", "[CALL]", find_bracketed, "{tools}", lambda content: content, write_bracketed
    )
    monkeypatch.setitem(TOOL_CALL_FORMATS, "bracketed", bracketed)
    fmt = tool_call_format(None, "{{ '[CALL]' }}", renders_tools=True)
    assert fmt is bracketed
    text = 'ok\n[CALL]{"name": "calculator", "arguments": {"expression": "7"}}'
    assert parse_tool_calls(text, fmt, SCHEMAS) == [ToolCall("calculator", {"expression": "7"})]
    # What a format writes, it reads back.
    written = fmt.write_call("calculator", {"expression": "7"})
    assert parse_tool_calls(written, fmt, SCHEMAS) == [ToolCall("calculator", {"expression": "7"})]


@pytest.fixture
def python_recursion_limit() -> Iterator[None]:
    """Python's default recursion limit (1,000) for the test: libraries imported earlier in a run (torch's
    compiler, sympy) may have raised it, and then json reads 1,000 brackets."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    yield
    sys.setrecursionlimit(before)


def test_a_call_nested_past_what_python_can_read_is_the_models_error_not_the_runs(python_recursion_limit) -> None:
    # What a degenerate repetition writes: ~1,000 nested brackets. json.loads raises RecursionError on it, which
    # reached the rollout before; now it is the model's error text, and the next call of the turn still reads.
    deep = "<tool_call>" + '{"name": "calculator", "arguments": ' + "[" * 1000 + "]" * 1000 + "}</tool_call>"
    with pytest.raises(RecursionError):
        json.loads(deep.removeprefix("<tool_call>").removesuffix("</tool_call>"))
    first, second = parse_tool_calls(deep + call("calculator", expression="1+1"), HERMES, SCHEMAS)
    assert isinstance(first, ToolCallError) and first.message.startswith("error: the tool call is nested too deeply")
    assert second == ToolCall("calculator", {"expression": "1+1"})
    # Shallower, json reads it, but its worker could not be sent it (pickle recurses): refused as too deep too,
    # for an argument whose schema takes any value.
    untyped = {"anything": {"type": "function", "function": {"name": "anything", "parameters": {
        "type": "object", "properties": {"value": {}}, "required": ["value"]}}}}  # fmt: skip
    nested = '<tool_call>{"name": "anything", "arguments": {"value": ' + "[" * 900 + "]" * 900 + "}}</tool_call>"
    [refused] = parse_tool_calls(nested, HERMES, untyped)
    assert isinstance(refused, ToolCallError) and "more than 64 deep" in refused.message
    ok = '<tool_call>{"name": "anything", "arguments": {"value": ' + "[" * 10 + "]" * 10 + "}}</tool_call>"
    assert parse_tool_calls(ok, HERMES, untyped) == [ToolCall("anything", {"value": json.loads("[" * 10 + "]" * 10)})]


def test_any_exception_while_reading_a_call_is_the_models_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import grpo_cli.episodes.tool_calls as module

    def broken(value: object, schema: object) -> bool:
        raise TypeError("unhashable type: 'dict'")  # e.g. an enum check on a value the schema did not foresee

    monkeypatch.setattr(module, "_matches", broken)
    [error] = parse_tool_calls(call("search", query="x"), HERMES, SCHEMAS)
    assert isinstance(error, ToolCallError)
    assert error.message.startswith("error: the tool call could not be read (TypeError: unhashable type: 'dict')")


def test_hermes_reads_back_the_calls_it_writes() -> None:
    written = HERMES.write_call("calculator", {"expression": "6*7"})
    assert parse_tool_calls(written, HERMES, SCHEMAS) == [ToolCall("calculator", {"expression": "6*7"})]
