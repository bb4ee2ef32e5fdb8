"""TRL 1.16's conventions, proven on TRL's own files (tests/fixtures/peers/trl: its agent example's tool and
rewards, its docs' sync and async tools and async reward, copied unchanged).

The expected scores are TRL's own: the same scripted model turns parsed by TRL's parse_response (Qwen3's response
template), its tool called and its result shaped as TRL's tool loop shapes it, then TRL's reward functions called
on those messages. job=check_reward (the run's episode code: the tools in worker processes, the rewards in theirs)
must give each of them."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
import sqlite3
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from rich.console import Console

from grpo_cli.episodes.tool_calls import ToolCall
from grpo_cli.episodes.tools import ToolResult, ToolRunner, load_tools
from grpo_cli.jobs.check_reward import episode_tokenizer
from grpo_cli.jobs.check_reward import run as check_reward
from grpo_cli.tasks.custom import CustomTaskConfig, absolutize_paths
from grpo_cli.usercode.user_code import UserCodeError
from tests.conftest import compose_config

PEERS = Path(__file__).resolve().parents[2] / "fixtures" / "peers" / "trl"
REWARDS = {"correctness": "correctness_reward", "structure": "structure_reward", "query": "query_reward"}
PROMPT = [{"role": "user", "content": "Does the gene JNKK interact with MAPK8 in humans?"}]


def peer_module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"trl_peer_{name}", PEERS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def biogrid_db(folder: Path) -> None:
    """A small `biogrid.db` of the shape the example builds (its `interactions` table), where its tool reads it."""
    conn = sqlite3.connect(folder / "biogrid.db")
    conn.execute("CREATE TABLE interactions (Alt_IDs_Interactor_A TEXT, Alt_IDs_Interactor_B TEXT, Taxid TEXT)")
    conn.executemany(
        "INSERT INTO interactions VALUES (?, ?, ?)",
        [("entrez gene/locuslink:JNKK", "entrez gene/locuslink:MAPK8", "taxid:9606"),
         ("entrez gene/locuslink:TP53", "entrez gene/locuslink:MDM2", "taxid:9606")],
    )  # fmt: skip
    conn.commit()
    conn.close()


def call(sql: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'query_biogrid', 'arguments': {'sql_command': sql}})}\n</tool_call>"


HIT = "SELECT * FROM interactions WHERE Alt_IDs_Interactor_A LIKE '%JNKK%'"
CASES: list[dict[str, Any]] = [
    {"answer": "yes", "turns": [call(HIT), "They do: *yes*"], "why": "a query with hits, then the answer"},
    # the case: two calls in one turn (one generic, one without WHERE), text before them
    {"answer": "yes", "turns": [f"Let me look.\n{call(HIT + ' LIMIT 1')}\n{call('SELECT count(*) FROM interactions')}",
                                "*yes*"], "why": "two calls in one turn"},
    {"answer": "no", "turns": [call("SELECT * FROM interactions WHERE Taxid = 'taxid:1'"), "*no*"],
     "why": "no hits, answer no"},
    {"answer": "no", "turns": ["*no*"], "why": "no tool call"},
]  # fmt: skip


def trl_parsed(tokenizer: Any, text: str) -> dict[str, Any]:
    """A model turn's text as TRL 1.16 parses it: trl's parse_response with the response template TRL sets for
    Qwen2.5/Qwen3 (the turn's ids end with the stop token, as sampled)."""
    from trl.chat_template_utils import parse_response, qwen3_template

    tokenizer.response_template = qwen3_template
    ids = tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
    return parse_response(tokenizer, ids, prefix=[])


def trl_completion(tokenizer: Any, turns: list[str], tool: Any) -> list[dict[str, Any]]:
    """The completion TRL 1.16 builds for these model turns: each parsed by TRL, each call run and its result
    shaped as GRPOTrainer._tool_call_loop shapes it."""
    completion: list[dict[str, Any]] = []
    for text in turns:
        message = trl_parsed(tokenizer, text)
        completion.append(message)
        for tool_call in message.get("tool_calls") or []:
            result = tool(**tool_call["function"]["arguments"])
            content = result if isinstance(result, list) else str(result)  # trl's _tool_call_loop, as it is
            completion.append({"role": "tool", "name": tool_call["function"]["name"], "content": content})
    return completion


def test_trl_agent_examples_rewards_score_here_as_under_trl(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the example's tool reads biogrid.db in the working directory (and its workers')
    biogrid_db(tmp_path)
    agent = peer_module("grpo_agent")
    cfg = compose_config(["job=check_reward", "task=custom", f"task.base_dir={tmp_path}"])
    tokenizer, _ = episode_tokenizer(cfg.model.name_or_path, Console(file=io.StringIO()))
    rows = []
    for case in CASES:
        completion = trl_completion(tokenizer, case["turns"], agent.query_biogrid)
        expected = {key: getattr(agent, fn)([completion], answer=[case["answer"]])[0] for key, fn in REWARDS.items()}
        rows.append({"prompt": PROMPT, **case, "expected": expected})
    # The numbers: under TRL, the tool-calling turns score as such (structure 0.1, not 0; query +0.9)
    assert rows[0]["expected"]["structure"] == 0.1 and rows[1]["expected"]["query"] == pytest.approx(0.9)
    (tmp_path / "cases.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": PROMPT, "answer": "yes"}) + "\n")
    task = CustomTaskConfig(
        name="custom", train_path="train.jsonl", eval_path="train.jsonl", cases_path="cases.jsonl",
        rewards={key: f"{PEERS / 'grpo_agent.py'}:{fn}" for key, fn in REWARDS.items()},
        tools={"query_biogrid": f"{PEERS / 'grpo_agent.py'}:query_biogrid"},
    )  # fmt: skip
    absolutize_paths(task, tmp_path)
    cfg.task = task
    out = Console(file=io.StringIO(), width=240, highlight=False)
    assert check_reward(cfg, tmp_path, out) == {"n": len(CASES), "n_disagree": 0}
    assert "[tool_call query_biogrid(" in out.file.getvalue()  # the transcript shows the parsed calls


def test_an_assistant_turns_message_is_trls(tmp_path):
    """The assistant message rewards see is what TRL's parse_response gives for the same text."""
    from grpo_cli.episodes.tool_calls import HERMES
    from grpo_cli.episodes.tools import assistant_message

    cfg = compose_config(["job=check_reward", "task=custom"])
    tokenizer, _ = episode_tokenizer(cfg.model.name_or_path, Console(file=io.StringIO()))
    one = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    texts = [
        call(HIT),
        f"Let me look.\n{call(HIT)}\n{call('SELECT 1')}",
        "No call, just text.",
        "  plain  \n",
        "<tool_call>\n{not json}\n</tool_call>",  # TRL falls back to the text as content, no tool_calls
        '<tool_call>["x"]</tool_call>',
        '<tool_call>{"name": "f"}</tool_call>',  # arguments {}
        'a <tool_call>{"name": "f", "arguments": {"a": 1}}',  # left open: the text
        f"<think>\nhmm\n</think>\n\nLet me.\n{one}",  # reasoning_content
        f"<think>\n\n</think>\n\n{one}",
        f"before\n{one}\nafter",  # the last stretch of text is the content
        'x<tool_call>{"name": "g", "arguments": "{\\"x\\": 2}"}</tool_call>',  # string arguments stay a string
        "mid<think>y</think>z",
    ]
    for text in texts:
        assert assistant_message(text, HERMES) == trl_parsed(tokenizer, text), text


def test_trl_docs_tools_sync_and_async_run_as_tools(tmp_path):
    docs = str(PEERS / "docs_tools.py")
    tools = load_tools({"multiply": f"{docs}:multiply", "async_add": f"{docs}:async_add"}, tmp_path)
    assert tools["async_add"].schema["function"]["parameters"]["required"] == ["a", "b"]
    calls = [[ToolCall("multiply", {"a": 6, "b": 7}), ToolCall("async_add", {"a": 40, "b": 2})]]
    expected = [[ToolResult("multiply", "42"), ToolResult("async_add", "42")]]
    for workers in (2, 0):  # awaited in the worker processes, and in this process (task.reward_workers=0)
        runner = ToolRunner(tools, time_limit_s=30, workers=workers)
        try:
            assert runner.run(calls) == expected
        finally:
            runner.close()


def test_a_tool_returning_a_list_keeps_it_as_trl_does(tmp_path):
    (tmp_path / "rows.py").write_text(
        'def rows(n: int) -> list:\n    """Rows.\n\n    Args:\n        n: How many.\n    """\n'
        "    return [(i, str(i)) for i in range(n)]\n"
    )
    runner = ToolRunner(load_tools({"rows": "rows.py:rows"}, tmp_path), time_limit_s=30, workers=1)
    try:
        (result,) = runner.run([[ToolCall("rows", {"n": 2})]])[0]
    finally:
        runner.close()
    assert result.message() == {"role": "tool", "name": "rows", "content": [(0, "0"), (1, "1")]}


@pytest.mark.parametrize("workers", [1, 0])  # awaited in its worker process, and in this one
def test_trl_docs_async_reward_is_awaited(tmp_path, workers):
    docs = peer_module("docs_tools")
    expected = asyncio.run(docs.async_reward_func(prompts=[PROMPT, PROMPT], completions=["a", ""]))
    cases = [
        {"prompt": PROMPT, "answer": "x", "response": "a", "expected": {"r": expected[0]}},
        {"prompt": PROMPT, "answer": "x", "response": "", "expected": {"r": expected[1]}},
    ]
    (tmp_path / "cases.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cases))
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": PROMPT, "answer": "x"}) + "\n")
    task = CustomTaskConfig(
        name="custom", train_path="train.jsonl", eval_path="train.jsonl", cases_path="cases.jsonl",
        rewards={"r": f"{PEERS / 'docs_tools.py'}:async_reward_func"}, completion_format="text",
        reward_workers=workers,
    )  # fmt: skip
    absolutize_paths(task, tmp_path)
    cfg = compose_config(["job=check_reward", "task=custom", f"task.base_dir={tmp_path}"])
    cfg.task = task
    assert check_reward(cfg, tmp_path, Console(file=io.StringIO())) == {"n": 2, "n_disagree": 0}


def test_a_tool_that_does_not_load_in_a_worker_is_one_line_before_the_run(tmp_path, monkeypatch):
    from grpo_cli.jobs.preflight import check_tools_in_workers

    # importable here only through this process's sys.modules: a fresh worker cannot import it
    (tmp_path / "here_only.py").write_text(
        'import only_in_the_parent\n\ndef t(a: int) -> int:\n    """T.\n\n    Args:\n        a: A.\n    """\n'
        "    return a\n"
    )
    monkeypatch.setitem(__import__("sys").modules, "only_in_the_parent", ModuleType("only_in_the_parent"))
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": PROMPT, "answer": "x"}) + "\n")
    cfg = compose_config(["task=custom", f"task.base_dir={tmp_path}"])
    cfg.task = CustomTaskConfig(
        name="custom", train_path="train.jsonl", eval_path="train.jsonl", rewards={"r": "here_only.py:t"},
        tools={"t": "here_only.py:t"}, base_dir=str(tmp_path),
    )  # fmt: skip
    load_tools({"t": "here_only.py:t"}, tmp_path)  # it loads here (validation's check passes)
    with pytest.raises(UserCodeError) as raised:
        check_tools_in_workers(cfg)  # preflight: before the model loads
    line = str(raised.value)
    assert "\n" not in line and "task.tools.t=" in line and "only_in_the_parent" in line
    assert "task.reward_workers=0" in line
