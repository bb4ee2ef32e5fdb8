"""Tools a model calls during an episode (`task.tools.<name>=file.py:fn`): loading them, their JSON schemas, the
prompt that shows them, and running a turn's calls in the reward worker processes.

    tools = load_tools({"calculator": "grpo_cli.episodes.builtin_tools:calculator"}, base_dir)
    prompt = tool_prompt(tokenizer, tools)            # how the template shows tools, the format calls are read in
    text = prompt.render(tokenizer, messages, tokenize=False, add_generation_prompt=True)
    calls = prompt.parse(assistant_text)              # ToolCall | ToolCallError, in order
    runner = ToolRunner(tools, time_limit_s=5, workers=2)
    results = runner.run([calls_of_episode_1, calls_of_episode_2, ...])   # every call of the batch at once
    messages += [r.message() for r in results[0]]     # {"role": "tool", "name": ..., "content": ...}

A tool is a plain Python function with type hints and a Google-style docstring (an `Args:` line per argument):
`transformers.utils.get_json_schema` turns it into the JSON schema the chat template renders, TRL's convention. A
spec is what a reward's is (usercode/user_code.py): `file.py:fn`, `pkg.mod:fn`, or a node `{_target_: factory, ...}`
whose factory returns the function. The tool's name is its key in task.tools (the schema says that name).

Why the worker processes (usercode/reward_workers.py): a tool's call can hang in C code, exit the interpreter or run
out of memory; there it is killed at its time limit, its process replaced, and the model reads what happened.
Calls are submitted together, so a turn's calls (and every episode's calls of a batch) run concurrently across the
workers.
"""

from __future__ import annotations

import functools
import json
import logging
import pickle
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_cli.episodes.chat_roles import renderable
from grpo_cli.episodes.tool_calls import ParsedCall, ToolCall, ToolCallError, ToolCallFormat, parse_tool_calls
from grpo_cli.episodes.tool_calls import tool_call_format as find_tool_call_format
from grpo_cli.usercode.reward_workers import InProcessCall, PendingCall, RewardCallFailed, RewardWorkers, describe_error
from grpo_cli.usercode.timelimit import RewardTimeout
from grpo_cli.usercode.user_code import RewardSpec, UserCodeError, load_reward_spec, spec_text, with_absolute_reference

logger = logging.getLogger(__name__)

# The config key tools are given under (task.tools.<name>).
TOOLS_KEY = "task.tools"
# A tool's name as function-calling APIs accept it (OpenAI's rule).
_TOOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")
# A message's JSON schema form, as transformers' get_json_schema returns it.
JsonSchema = dict[str, Any]
Message = dict[str, Any]


@dataclass(frozen=True)
class Tool:
    """One loaded tool. `spec` has its file made absolute; `loader` (picklable) loads the function in a worker
    process; `fn` is the function loaded here (its schema; calls when there are no workers)."""

    name: str
    spec: RewardSpec
    schema: JsonSchema
    loader: Callable[[], Callable[..., Any]]
    fn: Callable[..., Any]


def tool_schema(key: str, spec: RewardSpec, fn: Callable[..., Any], name: str) -> JsonSchema:
    """`fn`'s JSON schema (transformers.utils.get_json_schema) under the name `name`; one line naming `key` when
    it has no docstring, an argument without a type hint or without an `Args:` description."""
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers' DocstringParsingException, TypeHintParsingException, ...
        detail = " ".join(str(e).split())[:240]
        raise UserCodeError(
            f"{key}={spec_text(spec)}: {detail}: a tool needs a type hint on every argument and a docstring with "
            "an Args: line for each (transformers.utils.get_json_schema)"
        ) from None
    schema["function"]["name"] = name
    return schema


def load_tools(specs: Mapping[str, RewardSpec], base_dir: Path) -> dict[str, Tool]:
    """The tools of task.tools (name -> `file.py:fn`, `pkg.mod:fn` or a `_target_` node), each loaded and its
    schema read here, so a wrong spec, a missing docstring or an un-hinted argument is a one-line UserFacingError
    before the run starts."""
    tools: dict[str, Tool] = {}
    for name, raw_spec in specs.items():
        key = f"{TOOLS_KEY}.{name}"
        if not _TOOL_NAME.match(str(name)):
            raise UserCodeError(
                f"{key}: a tool's name is what the model writes to call it: letters, digits, _ and -, starting with a "
                "letter or _, at most 64 characters"
            )
        given: RewardSpec = dict(raw_spec) if isinstance(raw_spec, Mapping) else str(raw_spec)
        fn = load_reward_spec(key, given, base_dir)  # errors name the spec as the user wrote it
        if isinstance(fn, type):  # calling it would build an instance, and its schema would be its __init__'s
            raise UserCodeError(
                f"{key}={spec_text(given)}: {fn.__name__} is a class, not a function: a tool is a function with a "
                "docstring (an object whose methods are the tools is an environment: task.environment)"
            )
        spec = with_absolute_reference(given, base_dir)
        loader = functools.partial(load_reward_spec, key, spec, base_dir)
        check_sendable(key, given, loader)
        tools[name] = Tool(name, spec, tool_schema(key, given, fn, name), loader, fn)
    return tools


def check_sendable(key: str, spec: RewardSpec, loader: Callable[[], Callable[..., Any]]) -> None:
    """One line naming `key` when the loader a worker process loads the tool with cannot be sent there (a
    `_target_` node holding an object pickle cannot send): the run would otherwise fail at the first call."""
    try:
        pickle.dumps(loader, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - whatever pickle raises, the tool cannot reach its worker process
        raise UserCodeError(
            f"{key}={spec_text(spec)}: cannot be sent to its worker process ({' '.join(str(e).split())[:160]}): "
            "give plain values to its _target_ node (or a file.py:function), or run tools in this process with "
            "task.reward_workers=0"
        ) from None


def _nothing() -> None:
    """What a worker calls once a tool loaded there (check_tools_load_in_worker)."""


class ToolLoadFailed(Exception):
    """A tool did not load in a worker process (check_tools_load_in_worker): its error, less the key it names."""


def _load_then_nothing(loader: Callable[[], Callable[..., Any]], said: str) -> Callable[[], None]:
    try:
        loader()
    except UserCodeError as e:  # its line starts with the key the caller's line names already
        raise ToolLoadFailed(str(e).removeprefix(said)) from None
    return _nothing


def check_tools_load_in_worker(tools: Mapping[str, Tool]) -> None:
    """Each tool loaded in a worker process as its calls will be (one worker, started and stopped here; before the
    model loads): a tool that imports here but not there (a module found only through this process's state, an
    import that fails in a fresh interpreter) is one line naming it, not an error at the run's first call."""
    if not tools:
        return
    pool = RewardWorkers(1, None)
    try:
        for tool in tools.values():
            said = f"{TOOLS_KEY}.{tool.name}={spec_text(tool.spec)}: "
            loader = functools.partial(_load_then_nothing, tool.loader, said)
            try:
                pool.submit(loader, (), {}, label=f"tool {tool.name}").result()
            except RewardCallFailed as e:
                raise UserCodeError(
                    f"{said}{e.what}: a tool runs in a worker process "
                    "(task.reward_workers), so it must import there from its file or module alone; or run tools "
                    "in this process with task.reward_workers=0"
                ) from None
    finally:
        pool.close()


# ------------------------------------------------------------------------------------------ showing the tools


def default_tool_prompt(schemas: Sequence[JsonSchema], fmt: ToolCallFormat) -> str:
    """The system text that shows the tools to a model whose chat template does not render them: `fmt`'s
    instructions with each tool's JSON schema on a line (for hermes: Qwen2.5's layout, <tools></tools> and
    <tool_call>{"name": ..., "arguments": {...}}</tool_call>)."""
    return fmt.instructions.format(tools="\n".join(json.dumps(schema) for schema in schemas))


def _renders(tokenizer: Any, messages: list[Message], **kwargs: Any) -> str | None:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception:  # noqa: BLE001 - a template that raises on this input does not support it
        return None
    return text if isinstance(text, str) else None


_PROBE_TOOL: JsonSchema = {
    "type": "function",
    "function": {
        "name": "probe_tool_7c1e",
        "description": "Probe.",
        "parameters": {"type": "object", "properties": {}, "required": []},
    },
}
_PROBE_RESULT = "probe_result_4b9d"


def template_renders_tools(tokenizer: Any) -> bool:
    """Does the chat template show tools (renders a conversation differently with tools=...)?"""
    hello: list[Message] = [{"role": "user", "content": "hi"}]
    with_tools = _renders(tokenizer, hello, tools=[_PROBE_TOOL])
    return with_tools is not None and with_tools != _renders(tokenizer, hello)


def template_renders_tool_messages(tokenizer: Any, with_tools: bool) -> bool:
    """Does the chat template render a `tool` message (its content appears, nothing raises)?"""
    conversation: list[Message] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "calling"},
        {"role": "tool", "name": "probe_tool_7c1e", "content": _PROBE_RESULT},
    ]
    text = _renders(tokenizer, conversation, tools=[_PROBE_TOOL] if with_tools else None)
    return text is not None and _PROBE_RESULT in text


@dataclass(frozen=True)
class ToolPrompt:
    """How an episode's conversation is shown to the model with its tools, and how its calls are read.

    native: the chat template renders the tools itself (apply_chat_template(..., tools=schemas)); otherwise the
        default tool prompt is the system message (appended to the conversation's own system message if it has one).
    tool_messages_native: the template renders `tool` messages; otherwise each run of consecutive tool messages is
        shown as one user turn of results wrapped by the format (hermes: <tool_response>...</tool_response>).
    """

    schemas: tuple[JsonSchema, ...]
    fmt: ToolCallFormat
    native: bool
    tool_messages_native: bool

    def messages(self, messages: Sequence[Message]) -> list[Message]:
        """The conversation as the chat template is given it (the episode's own messages are not changed)."""
        shown = [dict(m) for m in messages]
        if not self.native:
            text = default_tool_prompt(self.schemas, self.fmt)
            if shown and shown[0].get("role") == "system":
                shown[0]["content"] = f"{shown[0].get('content') or ''}\n\n{text}".lstrip("\n")
            else:
                shown.insert(0, {"role": "system", "content": text})
        shown = [{**m, "content": shown_content(m.get("content", ""))} if m.get("role") == "tool" else m for m in shown]
        if self.tool_messages_native:
            return shown
        merged: list[Message] = []
        after_tool = False  # consecutive tool messages share one user turn, as in Qwen2.5's template
        for message in shown:
            if message.get("role") != "tool":
                merged.append(message)
                after_tool = False
                continue
            result = self.fmt.wrap_result(block_text(message.get("content", "")))
            if after_tool:
                merged[-1]["content"] += "\n" + result
            else:
                merged.append({"role": "user", "content": result})
            after_tool = True
        return merged

    def render(self, tokenizer: Any, messages: Sequence[Message], **kwargs: Any) -> Any:
        """tokenizer.apply_chat_template of the conversation with the tools (kwargs: tokenize,
        add_generation_prompt, ...)."""
        tools = list(self.schemas) if self.native else None
        shown = renderable(tokenizer, self.messages(messages))  # a template without a system role: folded
        return tokenizer.apply_chat_template(shown, tools=tools, **kwargs)

    def parse(self, text: str) -> list[ParsedCall]:
        """The tool calls of an assistant turn's text (tool_calls.parse_tool_calls in this prompt's format)."""
        return parse_tool_calls(text, self.fmt, {s["function"]["name"]: s for s in self.schemas})

    def assistant_message(self, text: str) -> Message:
        """The assistant turn `text` as TRL 1.16 gives it to rewards (tools.assistant_message)."""
        return assistant_message(text, self.fmt)


def tool_prompt(
    tokenizer: Any,
    tools: Mapping[str, Tool],
    tool_call_format: str | None = None,
    model_name: str = "the model",
) -> ToolPrompt:
    """How `tokenizer`'s chat template shows `tools` and the format their calls are read in
    (tool_calls.tool_call_format: task.tool_call_format, else the template's own, else hermes). A template that
    does not render tools gets the default tool prompt, said in one log line."""
    native = template_renders_tools(tokenizer)
    fmt = find_tool_call_format(tool_call_format, getattr(tokenizer, "chat_template", None), native)
    if not native:
        logger.warning(
            "the chat template of %s does not render tools: they are listed in a system message, the default tool "
            "prompt of the %s format (docs/multi-turn.md#tools)",
            model_name,
            fmt.name,
        )
    return prompt_for_schemas(tokenizer, [t.schema for t in tools.values()], tool_call_format)


def prompt_for_schemas(
    tokenizer: Any, schemas: Sequence[Mapping[str, Any]], tool_call_format: str | None = None
) -> ToolPrompt:
    """tool_prompt for tools given as OpenAI's JSON schemas ({"type": "function", "function": {...}}), as an
    agent's call gives them (endpoint/recording.py); a schema without the "function" wrapper is wrapped."""
    wrapped = tuple(dict(s) if "function" in s else {"type": "function", "function": dict(s)} for s in schemas)
    native = template_renders_tools(tokenizer)
    fmt = find_tool_call_format(tool_call_format, getattr(tokenizer, "chat_template", None), native)
    renders_tool_messages = native and template_renders_tool_messages(tokenizer, with_tools=True)
    return ToolPrompt(wrapped, fmt, native, renders_tool_messages)


# ---------------------------------------------------------------------------------- TRL 1.16's message shapes


# TRL 1.16's response template for the hermes tags (trl.chat_template_utils.qwen3_template, which TRL also gives
# Qwen2.5): a turn is segments, each <think>...</think> and each <tool_call>...</tool_call> (with the whitespace
# after it) a field of its own, the text between them the content.
_TRL_SEGMENT = re.compile(r"<think>(.*?)</think>\s*|<tool_call>(.*?)</tool_call>\s*", re.DOTALL)


def assistant_message(text: str, fmt: ToolCallFormat) -> Message:
    """An assistant turn's text as TRL 1.16 hands it to rewards (trl.chat_template_utils.parse_response with the
    response template it sets for Qwen2.5/Qwen3, as transformers 5 parses it): `tool_calls` each call's JSON
    object as written, as {"type": "function", "function": {"name": ..., "arguments": ...}} (`arguments` {} when
    missing), `reasoning_content` the <think> text when not blank, and `content` the last stretch of other text,
    stripped ("" when none). A turn whose calls do not all read (not JSON, not an object with a string name, or a
    call left open) is `{"role": "assistant", "content": <its text>}` with no `tool_calls`, TRL's fallback (the
    calls that do read are still run here, and the model reads the others' errors). A format other than hermes:
    its calls, and the text before them as content."""
    plain: Message = {"role": "assistant", "content": text}
    if fmt.name != "hermes":
        return _assistant_message_of(text, fmt, plain)
    segments, calls, reasoning, at = [], [], "", 0
    for match in _TRL_SEGMENT.finditer(text):
        segments.append(text[at : match.start()])
        at = match.end()
        if match.group(1) is not None:
            reasoning = match.group(1).strip()
            continue
        call = _call_entry(match.group(2))
        if call is None:
            return plain
        calls.append(call)
    segments.append(text[at:])
    if any("<tool_call>" in part or "<think>" in part for part in segments):  # a field left open
        return plain
    content = next((part.strip() for part in reversed(segments) if part.strip()), "")
    message: Message = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def _call_entry(raw: str) -> dict[str, Any] | None:
    """One call's JSON as TRL writes it in `tool_calls`; None when it does not read as an object with a name."""
    try:
        call = json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    function = dict(call)
    if function.get("arguments") is None:
        function["arguments"] = {}
    return {"type": "function", "function": function}


def _assistant_message_of(text: str, fmt: ToolCallFormat, plain: Message) -> Message:
    calls = [_call_entry(raw) for raw in fmt.find(text)]
    if not calls or any(call is None for call in calls):
        return plain
    at = text.find(fmt.template_marker)
    return {"role": "assistant", "content": (text[:at] if at >= 0 else "").strip(), "tool_calls": calls}


def tool_content(value: Any) -> Any:
    """A tool's return value as the content of its `tool` message, as TRL 1.16 gives it: a list as it is
    (content blocks, or rows a reward reads back), anything else `str(value)`."""
    return value if isinstance(value, list) else str(value)


def _is_block(part: Any) -> bool:
    return isinstance(part, Mapping) and isinstance(part.get("type"), str)


def block_text(content: Any) -> str:
    """The text a tool message's content reads as: a string as it is, the text parts of content blocks joined
    by newlines, any other list as `str(list)` (what a template printing it would show)."""
    if isinstance(content, list) and content and all(_is_block(p) for p in content):
        return "\n".join(str(p.get("text", "")) for p in content if p.get("type") == "text")
    return content if isinstance(content, str) else str(content)


def shown_content(content: Any) -> Any:
    """A tool message's content as the chat template is given it: content blocks as they are (templates render
    their text parts), any other list as its text (a list of rows is not something a template can render)."""
    if isinstance(content, list) and content and all(_is_block(p) for p in content):
        return content
    return block_text(content)


# ------------------------------------------------------------------------------------------------ running calls


@dataclass(frozen=True)
class ToolResult:
    """What one call gave: its result (tool_content), or the error text the model reads instead."""

    name: str
    content: Any  # a string, or the list a tool returned (tool_content: TRL 1.16's shape)
    error: bool = False
    timed_out: bool = False

    def message(self) -> Message:
        """The `tool` message appended to the conversation (Qwen2.5's template reads its content; TRL's and
        OpenAI's messages also carry the tool's name). A list stays a list here (what rewards and transcripts
        see); the chat template is given its text (shown_content)."""
        return {"role": "tool", "name": self.name, "content": self.content}


class ToolRunner:
    """Runs tool calls in `workers` reward worker processes (0: in this process, one at a time, under the
    in-process time limit), each killed at `time_limit_s` (None: no limit)."""

    def __init__(self, tools: Mapping[str, Tool], time_limit_s: float | None, workers: int = 2) -> None:
        self.tools = dict(tools)
        self.time_limit_s = time_limit_s or None
        self.workers = workers
        self._pool: RewardWorkers | None = None

    def run(self, calls: Sequence[Sequence[ParsedCall]]) -> list[list[ToolResult]]:
        """The results of every episode's calls (`calls[i]`: episode i's turn), in order. All calls are started
        before any result is read, so they run concurrently across the workers."""
        started = [[self._start(call) for call in episode] for episode in calls]
        return [
            [self._finish(call, pending) for call, pending in zip(episode, episode_started, strict=True)]
            for episode, episode_started in zip(calls, started, strict=True)
        ]

    def close(self) -> None:
        """Stop the worker processes (a later run starts new ones)."""
        if self._pool is not None:
            self._pool.close()

    def _start(self, call: ParsedCall) -> PendingCall | InProcessCall | None:
        if isinstance(call, ToolCallError):
            return None
        tool = self.tools[call.name]
        if not self.workers:
            return InProcessCall(tool.fn, (), dict(call.arguments), self.time_limit_s)
        if self._pool is None:
            self._pool = RewardWorkers(self.workers, self.time_limit_s)
        return self._pool.submit(tool.loader, (), call.arguments, label=f"tool {call.name}")

    def _finish(self, call: ParsedCall, pending: PendingCall | InProcessCall | None) -> ToolResult:
        if isinstance(call, ToolCallError) or pending is None:
            assert isinstance(call, ToolCallError)
            return ToolResult(call.name or "unknown", call.message, error=True)
        assert isinstance(call, ToolCall)
        try:
            value = pending.result()
        except RewardTimeout:
            limit = f"{self.time_limit_s:g}" if self.time_limit_s is not None else "?"
            return ToolResult(call.name, f"error: tool {call.name} timed out after {limit} s", True, True)
        except RewardCallFailed as e:
            return ToolResult(call.name, f"error: tool {call.name} {e.what}", error=True)
        except Exception as e:  # noqa: BLE001 - in-process: the tool's own error is the model's to read
            return ToolResult(call.name, f"error: tool {call.name} {describe_error(e)}", error=True)
        return ToolResult(call.name, tool_content(value))
