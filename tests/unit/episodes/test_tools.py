"""Tools (grpo_cli/episodes/tools.py): loading a user's functions, their schemas, the prompt that shows them with the
real SmolLM2 tokenizer (no tool support in its template) and the project's Hermes-style template, and running calls
in the reward worker processes."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path
from typing import Any

import pytest

from grpo_cli.episodes.tool_calls import HERMES, ToolCall, ToolCallError
from grpo_cli.episodes.tools import ToolResult, ToolRunner, default_tool_prompt, load_tools, tool_prompt
from grpo_cli.errors import UserFacingError
from tests.conftest import write_my_tools

HERMES_TEMPLATE = Path(__file__).parents[2] / "fixtures" / "chat_templates" / "hermes_tools.jinja"


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("user")
    write_my_tools(folder)
    return folder


@pytest.fixture(scope="module")
def tools(user_dir: Path) -> dict[str, Any]:
    names = ["add", "fails", "leaves", "sleeps", "meet"]
    return load_tools({name: f"my_tools.py:{name}" for name in names}, user_dir)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from grpo_cli.models import TINY_RANDOM, load_tokenizer

    return load_tokenizer(TINY_RANDOM)  # SmolLM2-135M-Instruct's: its template ignores tools=


# ------------------------------------------------------------------------------------------------ loading


def test_tools_load_from_a_file_a_module_or_a_factory_node(user_dir: Path, tools: dict[str, Any]) -> None:
    assert tools["add"].schema == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first."},
                    "b": {"type": "integer", "description": "The second."},
                },
                "required": ["a", "b"],
            },
            "return": {"type": "integer"},
        },
    }
    assert tools["add"].fn(2, 3) == 5
    assert tools["add"].spec == f"{user_dir / 'my_tools.py'}:add"  # absolute: workers find it from anywhere
    loaded = load_tools(
        {
            "calc": "grpo_cli.episodes.builtin_tools:calculator",
            "triple": {"_target_": "my_tools.py:make_multiplier", "factor": 3},
        },
        user_dir,
    )
    assert loaded["calc"].schema["function"]["name"] == "calc"  # the key is the name the model calls
    assert loaded["triple"].fn(5) == 15 and loaded["triple"].schema["function"]["name"] == "triple"
    assert loaded["triple"].loader()(2) == 6  # what a worker process runs


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("my_tools.py", "task.tools.t=my_tools.py: give a function as path/to/file.py:function or package.module"),
        ("missing.py:f", "task.tools.t=missing.py:f: no such file"),
        ("my_tools.py:nope", "task.tools.t=my_tools.py:nope: my_tools.py has no function nope (it defines add,"),
        ("my_tools.py:no_doc", "task.tools.t=my_tools.py:no_doc: Cannot generate JSON schema for no_doc because it "
         "has no docstring!: a tool needs a type hint on every argument and a docstring with an Args: line for each"),
        ("my_tools.py:no_hint", "task.tools.t=my_tools.py:no_hint: Argument x is missing a type hint in function "
         "no_hint: a tool needs"),
        ("my_tools.py:no_arg_doc", "task.tools.t=my_tools.py:no_arg_doc: Cannot generate JSON schema for no_arg_doc "
         "because the docstring has no description for the argument 'x': a tool needs"),
    ],
)  # fmt: skip
def test_a_bad_tool_is_one_line_naming_its_key(user_dir: Path, spec: str, error: str) -> None:
    with pytest.raises(UserFacingError) as excinfo:
        load_tools({"t": spec}, user_dir)
    message = str(excinfo.value)
    assert "\n" not in message and message.startswith(error)


def test_a_class_or_a_missing_dotted_target_as_a_tool_is_one_line_in_the_users_words(user_dir: Path) -> None:
    (user_dir / "classy.py").write_text(
        'class Search:\n    """Search."""\n\n    def __init__(self, q: str):\n'
        '        """Args:\n            q: what.\n        """\n'
    )
    with pytest.raises(UserFacingError, match=r"^task.tools.t=classy.py:Search: Search is a class, not a function"):
        load_tools({"t": "classy.py:Search"}, user_dir)
    with pytest.raises(UserFacingError) as excinfo:
        load_tools({"t": {"_target_": "nonexist.factory"}}, user_dir)
    message = str(excinfo.value)
    assert message.startswith("task.tools.t._target_=nonexist.factory: no module named nonexist"), message
    with pytest.raises(UserFacingError, match="a reward \\(or tool\\) given as a node names what to call"):
        load_tools({"t": {"x": 1}}, user_dir)


def test_a_tool_name_must_be_callable_by_the_model(user_dir: Path) -> None:
    with pytest.raises(UserFacingError, match=r"^task.tools.my tool: a tool's name is what the model writes"):
        load_tools({"my tool": "my_tools.py:add"}, user_dir)


# ------------------------------------------------------------------------------------------------ the prompt

CONVERSATION = [
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'},
    {"role": "tool", "name": "add", "content": "5"},
    {"role": "tool", "name": "add", "content": "6"},
]


def test_a_template_without_tools_gets_the_default_tool_prompt_said_once(
    tokenizer: Any, tools: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="grpo_cli.episodes.tools"):
        prompt = tool_prompt(tokenizer, tools, model_name="SmolLM2")
    assert [r.getMessage() for r in caplog.records] == [
        "the chat template of SmolLM2 does not render tools: they are listed in a system message, the default tool "
        "prompt of the hermes format (docs/multi-turn.md#tools)"
    ]
    assert (prompt.native, prompt.tool_messages_native, prompt.fmt) == (False, False, HERMES)
    text = prompt.render(tokenizer, CONVERSATION, tokenize=False, add_generation_prompt=True)
    system = default_tool_prompt([t.schema for t in tools.values()], HERMES)
    assert json.dumps(tools["add"].schema) in system and '<tool_call>\n{"name": <function-name>' in system
    assert text == (
        f"<|im_start|>system\n{system}<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        f"<|im_start|>assistant\n{CONVERSATION[1]['content']}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n6\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # The conversation's own system message keeps its text, the tools after it.
    with_system = prompt.messages([{"role": "system", "content": "Be brief."}, CONVERSATION[0]])
    assert with_system[0] == {"role": "system", "content": f"Be brief.\n\n{system}"}
    assert CONVERSATION[2] == {"role": "tool", "name": "add", "content": "5"}  # the episode's messages unchanged


def test_a_hermes_template_renders_the_tools_itself(tokenizer: Any, tools: dict[str, Any]) -> None:
    hermes = _with_template(tokenizer, HERMES_TEMPLATE.read_text())
    prompt = tool_prompt(hermes, tools)
    assert (prompt.native, prompt.tool_messages_native, prompt.fmt) == (True, True, HERMES)
    assert pickle.loads(pickle.dumps(prompt)) == prompt  # plain data: it can travel to a Ray actor or a worker
    schemas = [t.schema for t in tools.values()]
    text = prompt.render(hermes, CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert text == hermes.apply_chat_template(CONVERSATION, tools=schemas, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n")
    assert f"<tools>\n{json.dumps(schemas[0])}\n" in text
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n6\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # Token ids, as the rollout asks for them.
    ids = prompt.render(hermes, CONVERSATION[:1], add_generation_prompt=True)
    assert hermes.decode(ids) == prompt.render(hermes, CONVERSATION[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.parse(CONVERSATION[1]["content"]) == [ToolCall("add", {"a": 2, "b": 3})]
    # An assistant message with structured tool_calls renders as the same text the model writes.
    structured = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "add", "arguments": {"a": 2, "b": 3}}}]}  # fmt: skip
    rendered = hermes.apply_chat_template([CONVERSATION[0], structured], tools=schemas, tokenize=False)
    assert rendered.endswith(f"<|im_start|>assistant\n{CONVERSATION[1]['content']}<|im_end|>\n")


@pytest.mark.parametrize("template", ["smollm2", "hermes"])
def test_a_turns_tool_results_extend_the_rendered_conversation(
    tokenizer: Any, tools: dict[str, Any], template: str
) -> None:
    """The episode builder appends the text of a turn's tool messages after the text so far: rendering the
    conversation with them starts with the rendering without them (when all of a turn's results are appended at
    once: consecutive tool messages share one user turn)."""
    chat = tokenizer if template == "smollm2" else _with_template(tokenizer, HERMES_TEMPLATE.read_text())
    prompt = tool_prompt(chat, tools)
    before = prompt.render(chat, CONVERSATION[:2], tokenize=False)
    after = prompt.render(chat, CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert after.startswith(before) and after[len(before) :].startswith("<|im_start|>user\n<tool_response>\n5")


def _with_template(tokenizer: Any, template: str) -> Any:
    import copy

    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


# ------------------------------------------------------------------------------------------------ running


@pytest.fixture(scope="module")
def runner(tools: dict[str, Any]) -> Any:
    runner = ToolRunner(tools, time_limit_s=30, workers=2)
    yield runner
    runner.close()


def test_results_errors_and_exits_become_tool_messages(runner: ToolRunner) -> None:
    calls = [
        [ToolCall("add", {"a": 2, "b": 3}), ToolCallError("weather", "error: there is no tool named 'weather'")],
        [ToolCall("fails", {"x": "luck"}), ToolCall("leaves", {"x": ""})],
        [],
    ]
    results = runner.run(calls)
    assert results == [
        [ToolResult("add", "5"), ToolResult("weather", "error: there is no tool named 'weather'", error=True)],
        [
            ToolResult("fails", "error: tool fails raised RuntimeError: no luck", error=True),
            ToolResult("leaves", "error: tool leaves called sys.exit(3)", error=True),
        ],
        [],
    ]
    assert results[0][0].message() == {"role": "tool", "name": "add", "content": "5"}
    assert runner.run([[ToolCall("add", {"a": 1, "b": 1})]]) == [[ToolResult("add", "2")]]  # a new worker took over


def test_the_calls_of_a_batch_run_concurrently(runner: ToolRunner, tmp_path: Path) -> None:
    """Each call returns only once the other one is running too: run one after the other, the first would wait
    until its time limit."""
    folder = str(tmp_path)
    first = ToolCall("meet", {"folder": folder, "me": "a", "other": "b"})
    second = ToolCall("meet", {"folder": folder, "me": "b", "other": "a"})
    [[a], [b]] = runner.run([[first], [second]])
    assert (a.error, b.error) == (False, False)
    assert a.content.startswith("a met b in process ") and b.content.startswith("b met a in process ")
    assert a.content.split()[-1] != b.content.split()[-1]  # two worker processes


def test_a_call_past_its_time_limit_is_killed_and_says_so(tools: dict[str, Any]) -> None:
    runner = ToolRunner(tools, time_limit_s=1, workers=1)
    try:
        [[result]] = runner.run([[ToolCall("sleeps", {"seconds": 600})]])
    finally:
        runner.close()
    assert result == ToolResult("sleeps", "error: tool sleeps timed out after 1 s", error=True, timed_out=True)


def test_without_workers_calls_run_in_this_process(tools: dict[str, Any]) -> None:
    runner = ToolRunner(tools, time_limit_s=5, workers=0)
    results = runner.run([[ToolCall("add", {"a": 4, "b": 4}), ToolCall("fails", {"x": "way"})]])
    assert results == [
        [ToolResult("add", "8"), ToolResult("fails", "error: tool fails raised RuntimeError: no way", True)]
    ]
