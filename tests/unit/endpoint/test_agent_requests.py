"""The agent endpoint's request schema (grpo_cli/endpoint/requests.py) and its server's edges
(grpo_cli/endpoint/server.py): every malformed request is a 4xx in OpenAI's error shape naming its field, a
field that would sample from another distribution than the learner scores is refused, a huge or deeply nested body
is refused before it is parsed whole, and closing answers every pending call and ends uvicorn's thread. No model."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from grpo_cli.endpoint.requests import SamplingPolicy, check_body, check_request, sampling_of

pytest.importorskip("fastapi")

POLICY = SamplingPolicy(temperature=0.7, top_p=1.0, min_tokens=4, vocab_size=100)
CHAT = {"model": "p", "messages": [{"role": "user", "content": "Hi"}]}


def generate(**params: object) -> dict:
    return {"model": "p", "token_ids": [1, 2, 3], "sampling_params": params}


@pytest.mark.parametrize(
    ("route", "raw", "param", "code"),
    [
        # the token route's sampling_params, which today's code did not check at all
        ("generate", generate(temperature="hot"), "sampling_params.temperature", "invalid_value"),
        ("generate", generate(stop=5), "sampling_params.stop", "invalid_value"),
        ("generate", generate(temperature=-3), "sampling_params.temperature", "invalid_value"),
        ("generate", generate(top_p=7), "sampling_params.top_p", "invalid_value"),
        ("generate", generate(n="x"), "sampling_params.n", "invalid_value"),
        ("generate", generate(max_tokens=True), "sampling_params.max_tokens", "invalid_value"),
        ("generate", generate(top_k=5), "sampling_params.top_k", "unsupported_parameter"),
        ("generate", generate(logit_bias={"3": 5}), "sampling_params.logit_bias", "unsupported_parameter"),
        ("generate", generate(min_p=0.1), "sampling_params.min_p", "unsupported_parameter"),
        ("generate", generate(repetition_penalty=1.3), "sampling_params.repetition_penalty", "unsupported_parameter"),
        ("generate", generate(allowed_token_ids=[1, 2]), "sampling_params.allowed_token_ids", "unsupported_parameter"),
        (
            "generate",
            generate(structured_outputs={"regex": "a+"}),
            "sampling_params.structured_outputs",
            "unsupported_parameter",
        ),
        ("generate", generate(temperature=0.2), "sampling_params.temperature", "unsupported_parameter"),
        ("generate", generate(frobnicate=1), "sampling_params.frobnicate", "unknown_parameter"),
        ("generate", {"token_ids": [1, 100]}, "token_ids", "invalid_value"),  # past the vocabulary
        ("generate", {"token_ids": [-1]}, "token_ids.0", "invalid_value"),
        ("generate", {"token_ids": "1 2"}, "token_ids", "invalid_value"),
        # chat completions and completions: the same schema
        ("chat", {**CHAT, "temperature": 0.3}, "temperature", "unsupported_parameter"),
        ("chat", {**CHAT, "top_p": 0.5}, "top_p", "unsupported_parameter"),
        ("chat", {**CHAT, "temperature": "0.7"}, "temperature", "invalid_value"),
        ("chat", {**CHAT, "presence_penalty": 0.5}, "presence_penalty", "unsupported_parameter"),
        ("chat", {**CHAT, "frequency_penalty": 0.5}, "frequency_penalty", "unsupported_parameter"),
        ("chat", {**CHAT, "response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter"),
        ("chat", {**CHAT, "tool_choice": "required"}, "tool_choice", "unsupported_parameter"),
        ("chat", {**CHAT, "guided_regex": "a+"}, "guided_regex", "unsupported_parameter"),
        ("chat", {**CHAT, "min_tokens": 0}, "min_tokens", "unsupported_parameter"),
        ("chat", {**CHAT, "n": 0}, "n", "invalid_value"),
        ("chat", {**CHAT, "stop": [""]}, "stop.0", "invalid_value"),
        ("chat", {**CHAT, "max_tokens": 4.5}, "max_tokens", "invalid_value"),
        ("chat", {**CHAT, "messages": []}, "messages", "invalid_value"),
        ("chat", {**CHAT, "stream": "yes"}, "stream", "invalid_value"),
        ("chat", {**CHAT, "echo": True}, "echo", "unknown_parameter"),
        ("chat", ["not", "an", "object"], None, "invalid_value"),
        ("completions", {"prompt": [1, 2, 100]}, "prompt", "invalid_value"),
        ("completions", {"prompt": "Hi", "top_k": 3}, "top_k", "unsupported_parameter"),
        ("completions", {"prompt": 5}, "prompt", "invalid_value"),
    ],
)
def test_a_malformed_or_distribution_changing_field_is_refused_naming_it(route, raw, param, code) -> None:
    body, problem = check_body(route, raw, POLICY)
    assert problem is not None and body == {}, body
    assert (problem.status, problem.param, problem.code) == (400, param, code), problem
    error = problem.body()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert "\n" not in error["message"] and (param is None or param in error["message"])


def test_what_leaves_the_learners_distribution_is_served() -> None:
    """The run's own temperature and top_p (or 1: the whole vocabulary the learner scores), neutral values of the
    refused fields, and the fields verifiers' trainer client sends."""
    body, problem = check_body(
        "generate",
        generate(max_tokens=4, logprobs=1, stop_token_ids=[2], skip_special_tokens=False, temperature=0.7, top_k=-1),
        POLICY,
    )
    assert problem is None and body["prompt"] == [1, 2, 3] and body["max_tokens"] == 4
    assert sampling_of(body, 0.7, 1.0).temperature == 0.7
    body, problem = check_body(
        "chat",
        {
            **CHAT,
            "temperature": 0.7,
            "top_p": 1,
            "presence_penalty": 0,
            "response_format": {"type": "text"},
            "tool_choice": "auto",
            "seed": 3,
            "user": "me",
            "min_tokens": 4,
            "stop": ["\n\n"],
        },
        POLICY,
    )
    assert problem is None and sampling_of(body, 0.7, 1.0).stop == ("\n\n",)
    nucleus = SamplingPolicy(temperature=0.7, top_p=0.9, min_tokens=0)
    assert check_body("chat", {**CHAT, "top_p": 0.9}, nucleus)[1] is None  # the run's own nucleus
    assert check_body("chat", {**CHAT, "top_p": 1.0}, nucleus)[1] is None  # the whole vocabulary
    assert check_body("chat", {**CHAT, "top_p": 0.5}, nucleus)[1].param == "top_p"


def test_vllms_front_checks_the_same_schema_and_leaves_vllms_own_fields_to_vllm() -> None:
    policy = SamplingPolicy(temperature=0.7, top_p=1.0, min_tokens=4)
    own = {**CHAT, "chat_template_kwargs": {"enable_thinking": False}, "top_logprobs": 2, "logprobs": True}
    assert check_request("chat", own, policy, unknown_fields=True)[1] is None
    for field, value in [
        ("top_k", 20),
        ("min_p", 0.05),
        ("logit_bias", {"5": -100}),
        ("temperature", 1.0),
        ("allowed_token_ids", [1]),
        ("structured_outputs", {"json": {}}),
        ("guided_json", {}),
    ]:
        _, problem = check_request("chat", {**own, field: value}, policy, unknown_fields=True)
        assert problem is not None and problem.param == field, (field, problem)
    _, problem = check_request("generate", generate(presence_penalty=1.0), policy, unknown_fields=True)
    assert problem is not None and problem.param == "sampling_params.presence_penalty"


# --------------------------------------------------------------------------------------------- the server's edges
@pytest.fixture
def server():
    from grpo_cli.endpoint.server import AgentServer

    served = AgentServer("tiny")
    served.known.add("ep")
    served.policy = POLICY
    yield served
    served.close()


def post(server, path: str, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {server.token}"}
    return httpx.post(f"http://127.0.0.1:{server.port}/ep{path}", headers=headers, timeout=30, **kwargs)


def test_a_huge_or_deeply_nested_body_is_refused_in_openais_shape(server) -> None:
    from grpo_cli.endpoint.server import MAX_BODY_BYTES

    huge = b'{"messages": "' + b"x" * (MAX_BODY_BYTES + 1) + b'"}'
    reply = post(server, "/v1/chat/completions", content=huge)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: refused once the limit is read, not after the whole body
        for _ in range(MAX_BODY_BYTES // 2**20 + 2):
            yield b" " * 2**20

    reply = post(server, "/v1/chat/completions", content=chunks())
    assert reply.status_code == 413
    nested = b"[" * 100_000 + b"]" * 100_000  # json.loads raises RecursionError on it
    reply = post(server, "/inference/v1/generate", content=nested)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json"
    reply = post(server, "/inference/v1/generate", json=generate(temperature="hot"))
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "sampling_params.temperature"
    headers = {"Authorization": f"Bearer {server.token}"}
    wrong_method = httpx.get(f"http://127.0.0.1:{server.port}/ep/v1/chat/completions", headers=headers, timeout=30)
    no_route = post(server, "/v1/embeddings", json={"input": "x"})
    assert (wrong_method.status_code, no_route.status_code) == (405, 404)
    assert wrong_method.json()["error"]["code"] == "http_405" and no_route.json()["error"]["code"] == "http_404"
    assert server.calls.empty()  # none reached the rollout thread


def test_closing_answers_a_call_the_rollout_thread_took_and_ends_the_server_thread(server) -> None:
    replies: list[httpx.Response] = []
    asking = threading.Thread(target=lambda: replies.append(post(server, "/v1/chat/completions", json=CHAT)))
    asking.start()
    taken = server.calls.get(timeout=30)  # the rollout thread took it and, stopping, never answers it
    queued = threading.Thread(target=lambda: replies.append(post(server, "/v1/completions", json={"prompt": "x"})))
    queued.start()
    deadline = time.monotonic() + 30
    while server.calls.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    server.close()
    took = time.monotonic() - started
    asking.join(10)
    queued.join(10)
    assert taken.answer.done() and [r.status_code for r in replies] == [503, 503]
    assert all(r.json()["error"]["code"] == "stopping" for r in replies)
    assert took < 3.0 and not server._thread.is_alive()
