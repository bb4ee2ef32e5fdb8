"""Tool calls read from an assistant turn's text, in the chat template's format (no torch, no I/O).

A model calls a tool by writing it into its turn, in the format its chat template taught it: Qwen2.5 and the Hermes
models write `<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>`, several per
turn. Each format is one entry of TOOL_CALL_FORMATS (the one place to add another): how to find the calls in a turn,
and the text in a chat template that says the template uses it. A call the model got wrong (text that is not JSON,
a tool that does not exist, arguments the tool does not take) is not dropped: it becomes a ToolCallError whose
message the model reads as that call's tool message, so it can correct itself in its next turn.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grpo_cli.errors import UserFacingError


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call of a known tool, its arguments checked against the tool's JSON schema."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolCallError:
    """A call the model got wrong: `message` is the text it reads back as the call's tool message; `name` is the
    tool it named (None when it could not be read)."""

    name: str | None
    message: str


ParsedCall = ToolCall | ToolCallError

# What a format's `find` returns for each call written in a turn, in order: the call's JSON text (parsed and
# checked here, the same way for every format).
RawCalls = list[str]


@dataclass(frozen=True)
class ToolCallFormat:
    """How one family of chat templates writes tool calls.

    name: the key users give (task.tool_call_format).
    template_marker: text whose presence in a chat template says the template uses this format.
    find: the JSON text of each call in an assistant turn, in order.
    instructions: how to call a tool, the end of the default tool prompt (tools.default_tool_prompt) for a template
        that does not render tools itself; `{tools}` is replaced by the tools' JSON schemas, one per line.
    wrap_result: how a tool's result reads inside a user turn, for a template that cannot render `tool` messages.
    write_call: a call (name, arguments) as the model writes it, for a template that does not render an assistant
        message's `tool_calls` (an agent's earlier turns, endpoint/recording.py).
    """

    name: str
    template_marker: str
    find: Callable[[str], RawCalls]
    instructions: str
    wrap_result: Callable[[str], str]
    write_call: Callable[[str, Any], str]


_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def find_hermes_calls(text: str) -> RawCalls:
    """The body of each `<tool_call>...</tool_call>` in `text`; a last one left open (the turn was cut at its
    token limit) runs to the end of the text, and reads as invalid JSON when the cut fell inside it."""
    return [body.strip() for body in _HERMES_CALL.findall(text)]


def write_hermes_call(name: str, arguments: Any) -> str:
    """A call as Qwen2.5's template writes it in an assistant turn."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def wrap_hermes_result(content: str) -> str:
    """A tool's result as Qwen2.5's template shows it in a user turn."""
    return f"<tool_response>\n{content}\n</tool_response>"


HERMES_INSTRUCTIONS = """# Tools

You may call one or more functions to help with the user's request.

The functions you can call are described by these JSON signatures, within <tools></tools> XML tags:
<tools>
{tools}
</tools>

To call a function, write a JSON object with the function's name and its arguments within <tool_call></tool_call> \
XML tags, one block per call:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>
The results come back within <tool_response></tool_response> XML tags."""

HERMES = ToolCallFormat(
    name="hermes",
    template_marker="<tool_call>",
    find=find_hermes_calls,
    instructions=HERMES_INSTRUCTIONS,
    wrap_result=wrap_hermes_result,
    write_call=write_hermes_call,
)

# Every tool-call format grpo-run reads, by the name task.tool_call_format takes. Add a format here, and its name
# to tasks/schema.py's TOOL_CALL_FORMAT_NAMES (the names a task may declare; a test keeps the two in step).
TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {HERMES.name: HERMES}

# The format of the default tool prompt (a chat template that does not render tools).
DEFAULT_FORMAT = HERMES.name


def tool_call_format(name: str | None, chat_template: str | None, renders_tools: bool) -> ToolCallFormat:
    """The format to read tool calls in: `name` when given (task.tool_call_format), else the first format whose
    marker the chat template contains, else (a template that does not render tools, so the default tool prompt
    teaches the format) DEFAULT_FORMAT. A template that renders tools in a format none of TOOL_CALL_FORMATS
    recognizes is a one-line error: its calls could not be read."""
    known = ", ".join(TOOL_CALL_FORMATS)
    if name is not None:
        if name not in TOOL_CALL_FORMATS:
            raise UserFacingError(f"task.tool_call_format={name} is not a tool-call format grpo-run reads: use {known}")
        return TOOL_CALL_FORMATS[name]
    for fmt in TOOL_CALL_FORMATS.values():
        if chat_template and fmt.template_marker in chat_template:
            return fmt
    if not renders_tools:
        return TOOL_CALL_FORMATS[DEFAULT_FORMAT]
    raise UserFacingError(
        f"the model's chat template renders tools, but in none of the tool-call formats grpo-run reads ({known}): "
        "set task.tool_call_format to the one it uses, or add a parser to tool_calls.TOOL_CALL_FORMATS"
    )


# ----------------------------------------------------------------------------------------------- reading calls


def parse_tool_calls(text: str, fmt: ToolCallFormat, schemas: Mapping[str, Mapping[str, Any]]) -> list[ParsedCall]:
    """Every tool call in an assistant turn's `text`, in order: a ToolCall, or a ToolCallError (the model's
    mistake, its message for the model) when the call is not a JSON object {"name": ..., "arguments": {...}}, names
    a tool that is not in `schemas` (tool name -> its JSON schema, transformers' get_json_schema form), or gives
    arguments the schema does not allow. No calls: an empty list (the episode's final answer)."""
    return [_parse_or_say_why(raw, fmt, schemas) for raw in fmt.find(text)]


_EXAMPLE = '{"name": <function-name>, "arguments": <args-json-object>}'
# Deeper JSON than this is refused as the model's mistake: json.loads raises RecursionError near 1,000 levels, and
# pickling the arguments for a tool's worker process fails well before that (what a degenerate repetition writes).
MAX_ARGUMENT_DEPTH = 64


def _parse_or_say_why(raw: str, fmt: ToolCallFormat, schemas: Mapping[str, Mapping[str, Any]]) -> ParsedCall:
    """`_parse_one`, with any exception while reading the call made the model's error text, never the run's."""
    try:
        return _parse_one(raw, fmt, schemas)
    except RecursionError:
        return ToolCallError(None, f"error: the tool call is nested too deeply to read: write {_EXAMPLE}")
    except Exception as e:  # noqa: BLE001 - the model's text: whatever it makes the parser do is its mistake
        what = " ".join(f"{type(e).__name__}: {e}".split())
        return ToolCallError(None, f"error: the tool call could not be read ({what:.200}): write {_EXAMPLE}")


def _depth(value: Any) -> int:
    """How deeply a JSON value nests lists and objects (iterative: no recursion on the model's text)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _parse_one(raw: str, fmt: ToolCallFormat, schemas: Mapping[str, Mapping[str, Any]]) -> ParsedCall:
    example = _EXAMPLE
    try:
        call = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCallError(None, f"error: the tool call is not valid JSON ({e}): write {example}")
    if _depth(call) > MAX_ARGUMENT_DEPTH:
        return ToolCallError(
            None, f"error: the tool call nests lists or objects more than {MAX_ARGUMENT_DEPTH} deep: write {example}"
        )
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCallError(None, f"error: a tool call is a JSON object with a name: write {example}")
    name = call["name"]
    if name not in schemas:
        return ToolCallError(name, f"error: there is no tool named {name!r}; the tools are: {', '.join(schemas)}")
    # "arguments" (Qwen2.5, Hermes, OpenAI); "parameters" (Llama 3.1's JSON calls); OpenAI also sends them as a
    # JSON string.
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass
        if _depth(arguments) > MAX_ARGUMENT_DEPTH:
            return ToolCallError(name, f"error: the arguments of tool {name} nest more than {MAX_ARGUMENT_DEPTH} deep")
    if not isinstance(arguments, dict):
        return ToolCallError(
            name, f"error: the arguments of tool {name} are a JSON object, not {_json_type(arguments)}"
        )
    problem = argument_problem(arguments, schemas[name])
    if problem is not None:
        return ToolCallError(name, f"error: tool {name} {problem}")
    return ToolCall(name, arguments)


# JSON schema type -> the Python types json.loads gives for it (bool is an int in Python, not a JSON number).
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def _json_type(value: Any) -> str:
    """How a JSON value's type reads in an error line."""
    kinds = ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"), (list, "an array"))
    for kind, text in (*kinds, (dict, "an object"), (type(None), "null")):
        if isinstance(value, kind):
            return text
    return type(value).__name__


def _matches(value: Any, schema: Mapping[str, Any]) -> bool:
    """Does `value` have a type `schema` allows? (The top-level `type` only, and `enum`; nested items unchecked.)"""
    allowed = schema.get("type")
    if "enum" in schema and value not in schema["enum"]:
        return False
    if allowed is None:
        return True
    names = allowed if isinstance(allowed, list) else [allowed]
    if schema.get("nullable"):
        names = [*names, "null"]
    for name in names:
        types = _JSON_TYPES.get(name)
        if types is None:
            return True  # a type this check does not know: the tool sees the value as given
        if isinstance(value, bool) and name in ("integer", "number"):
            continue
        if isinstance(value, types):
            return True
    return False


def argument_problem(arguments: Mapping[str, Any], schema: Mapping[str, Any]) -> str | None:
    """What is wrong with `arguments` for the tool `schema` describes (as "misses argument x", ...), or None."""
    parameters = schema.get("function", schema).get("parameters", {}) or {}
    properties: Mapping[str, Any] = parameters.get("properties", {}) or {}
    required: Sequence[str] = parameters.get("required", []) or []
    missing = [name for name in required if name not in arguments]
    if missing:
        return f"misses argument{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
    unknown = [name for name in arguments if name not in properties]
    if unknown:
        takes = ", ".join(properties) or "no arguments"
        return f"has no argument{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} (it takes {takes})"
    for name, value in arguments.items():
        expected = properties[name]
        if not _matches(value, expected):
            want = expected.get("enum") or expected.get("type")
            return f"argument {name} must be {want}, not {_json_type(value)} ({json.dumps(value)[:80]})"
    return None
