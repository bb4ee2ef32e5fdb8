"""The agent endpoint's request and response bodies (rollout/agent_server.py): what each route accepts, checked
with pydantic, and the replies built with the openai package's own response types. No HTTP, no engine here."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from grpo_cli.rollout.agent_episodes import CallPlan, Reply


class _Sampling(BaseModel):
    """The sampling fields every generating route shares (OpenAI's names); the others a client sends are ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = Field(1, ge=1, le=64)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = Field(None, ge=0)
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]


class EndRequest(BaseModel):
    """The agent runner's report (tasks/agents.py): the agent's reward (a number, {name: number}, or None) or the
    error that ended it."""

    reward: float | dict[str, float] | None = None
    error: str | None = None


class GenerateRequest(BaseModel):
    """vLLM's token-in route (vllm/entrypoints/scale_out/token_in_token_out/protocol.py, GenerateRequest), as
    verifiers' trainer client (renderers.client.generate) sends it: the prompt's token ids and vLLM's sampling
    parameters, of which these are read (the others it sends, stop_token_ids and skip_special_tokens among them,
    are the engine's own behaviour here: it stops at the model's end-of-turn tokens and returns ids)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool | None = None


_MODELS: dict[str, type[BaseModel]] = {
    "chat": ChatRequest,
    "completions": CompletionRequest,
    "end": EndRequest,
    "generate": GenerateRequest,
}


def _validated(route: str, raw: Any) -> tuple[dict[str, Any], str | None]:
    try:
        return _MODELS[route].model_validate(raw).model_dump(), None
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        return {}, f"{where}: {first['msg']}"


def field_problem(route: str, raw: Any) -> str | None:
    """The one line saying which of the route's fields is malformed, or None (the fields' types only)."""
    return _validated(route, raw)[1]


def check_body(route: str, raw: Any) -> tuple[dict[str, Any], str | None]:
    """(the body, None) or ({}, the one line saying what is wrong with it)."""
    body, problem = _validated(route, raw)
    if problem is not None:
        return {}, problem
    if route == "generate":
        if body.get("stream"):
            return {}, "stream=true is not served on /inference/v1/generate (vLLM's tokens mode answers whole)"
        params = body.pop("sampling_params")
        if int(params.get("n", 1)) != 1:
            return {}, "sampling_params.n: one sample per call on /inference/v1/generate"
        body.update(
            prompt=body.pop("token_ids"),
            temperature=params.get("temperature"),
            top_p=params.get("top_p"),
            max_tokens=params.get("max_tokens"),
            stop=params.get("stop"),
            logprobs=True,
        )
        return body, None
    top = body.get("top_logprobs") or (body.get("logprobs") if route == "completions" else 0)
    if isinstance(top, int) and not isinstance(top, bool) and top > (0 if route == "chat" else 1):
        return {}, "top_logprobs is not served: the engine gives the sampled tokens' log-probs only (logprobs=true)"
    if route == "completions":
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                return {}, "prompt: one prompt per call (an episode is one conversation); send the others on their own"
            body["prompt"] = prompt[0]
    return body, None


@dataclass(frozen=True)
class Sampling:
    """One call's sampling, the run's rollout settings where the call is silent."""

    n: int
    temperature: float
    top_p: float
    max_tokens: int | None
    stop: tuple[str, ...]


def sampling_of(body: dict[str, Any], temperature: float, top_p: float) -> Sampling:
    """The call's sampling fields with the run's temperature and top_p as defaults."""
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    return Sampling(
        body.get("n", 1),
        temperature if body.get("temperature") is None else float(body["temperature"]),
        top_p if body.get("top_p") is None else float(body["top_p"]),
        limit,
        stops,
    )


def _envelope(
    kind: Any, name: str, plan: CallPlan, replies: Sequence[Reply], model: str, choices: list[dict[str, Any]]
) -> dict[str, Any]:
    """The reply around its choices (openai's `kind`: ChatCompletion, Completion), with its usage, and the prompt's
    token ids as vLLM adds them."""
    from openai.types import CompletionUsage

    sampled = sum(len(r.turn.ids) for r in replies)
    usage = CompletionUsage(
        prompt_tokens=len(plan.prompt_ids), completion_tokens=sampled, total_tokens=len(plan.prompt_ids) + sampled
    )
    prefix = "chatcmpl" if name == "chat.completion" else "cmpl"
    envelope = kind(
        id=f"{prefix}-{plan.turn}-{time.monotonic_ns()}",
        object=name,
        created=int(time.time()),
        model=model,
        choices=[],
        usage=usage,
    )
    return {**envelope.model_dump(), "choices": choices, "prompt_token_ids": list(plan.prompt_ids)}


def chat_response(
    plan: CallPlan, replies: Sequence[Reply], model: str, logprobs: bool, token_text: Callable[[int], str]
) -> dict[str, Any]:
    """A chat.completion of the replies; `token_text` gives a token's text for the log-prob entries."""
    from openai.types.chat import ChatCompletion, ChatCompletionMessage, ChatCompletionTokenLogprob
    from openai.types.chat.chat_completion import Choice, ChoiceLogprobs

    choices = []
    for index, reply in enumerate(replies):
        entries = None
        if logprobs and reply.turn.logprobs is not None:  # an engine that gives none: null, as OpenAI allows
            entries = ChoiceLogprobs(
                content=[
                    ChatCompletionTokenLogprob(
                        token=token_text(t), bytes=list(token_text(t).encode()), logprob=lp, top_logprobs=[]
                    )
                    for t, lp in zip(reply.turn.ids, _logprobs(reply), strict=True)
                ]
            )
        message = ChatCompletionMessage.model_validate(reply.message)
        choice = Choice(index=index, message=message, finish_reason=reply.finish_reason, logprobs=entries)
        choices.append({**choice.model_dump(exclude_none=False), "token_ids": list(reply.turn.ids)})
    return _envelope(ChatCompletion, "chat.completion", plan, replies, model, choices)


def completion_response(
    plan: CallPlan, replies: Sequence[Reply], model: str, logprobs: bool, token_text: Callable[[int], str]
) -> dict[str, Any]:
    """A text_completion of the replies (their text as sampled, stop token left out)."""
    from openai.types import Completion, CompletionChoice
    from openai.types.completion_choice import Logprobs

    choices = []
    for index, reply in enumerate(replies):
        entries = None
        if logprobs and reply.turn.logprobs is not None:
            tokens = [token_text(t) for t in reply.turn.ids]
            offsets = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
            entries = Logprobs(tokens=tokens, token_logprobs=_logprobs(reply), text_offset=offsets, top_logprobs=None)
        reason: Literal["stop", "length"] = "length" if reply.finish_reason == "length" else "stop"
        choice = CompletionChoice(index=index, text=reply.text, finish_reason=reason, logprobs=entries)
        choices.append({**choice.model_dump(), "token_ids": list(reply.turn.ids)})
    return _envelope(Completion, "text_completion", plan, replies, model, choices)


def _logprobs(reply: Reply) -> list[float]:
    return [float(x) for x in reply.turn.logprobs or ()]


def generate_response(plan: CallPlan, reply: Reply) -> dict[str, Any]:
    """vLLM's GenerateTokensResponse (tokens mode) of one reply, each log-prob entry also carrying
    "token": "token_id:<id>", which verifiers' renderers 0.1.12 requires (and vLLM 0.32 does not send)."""
    entries = None
    if reply.turn.logprobs is not None:
        entries = {
            "content": [
                {"token": f"token_id:{t}", "token_id": t, "logprob": lp, "top_logprobs": []}
                for t, lp in zip(reply.turn.ids, _logprobs(reply), strict=True)
            ]
        }
    reason = "stop" if reply.finish_reason != "length" else "length"
    sampled = len(reply.turn.ids)
    return {
        "request_id": f"generate-{plan.turn}-{time.monotonic_ns()}",
        "prompt_token_ids": list(plan.prompt_ids),
        "choices": [{"index": 0, "token_ids": list(reply.turn.ids), "finish_reason": reason, "logprobs": entries}],
        "usage": {
            "prompt_tokens": len(plan.prompt_ids),
            "completion_tokens": sampled,
            "total_tokens": len(plan.prompt_ids) + sampled,
        },
    }


def stream_events(route: str, answer: dict[str, Any], include_usage: bool) -> list[str]:
    """A whole answer as the server-sent events a streaming client reads: chat.completion.chunk (or a
    text_completion per choice) events, the usage when asked for, then [DONE]. The reply is sampled whole
    before the first event (the recorded tokens are what trains), so the stream is its chunks in one go."""
    events = []
    if route == "chat":
        from openai.types.chat import ChatCompletionChunk

        for choice in answer["choices"]:
            message = choice["message"]
            delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{**call, "index": k} for k, call in enumerate(message["tool_calls"])]
            for part, reason in ((delta, None), ({}, choice["finish_reason"])):
                chunk = ChatCompletionChunk.model_validate(
                    {
                        "id": answer["id"],
                        "object": "chat.completion.chunk",
                        "created": answer["created"],
                        "model": answer["model"],
                        "choices": [
                            {
                                "index": choice["index"],
                                "delta": part,
                                "finish_reason": reason,
                                "logprobs": choice.get("logprobs") if reason is None else None,
                            }
                        ],
                    }
                )
                events.append(chunk.model_dump_json(exclude_unset=True))
        usage_chunk = {
            "id": answer["id"],
            "object": "chat.completion.chunk",
            "created": answer["created"],
            "model": answer["model"],
            "choices": [],
            "usage": answer["usage"],
        }
    else:
        for choice in answer["choices"]:
            events.append(json.dumps({**answer, "choices": [choice], "usage": None}))
        usage_chunk = {**answer, "choices": [], "usage": answer["usage"]}
    if include_usage:
        events.append(json.dumps(usage_chunk))
    return [f"data: {event}\n\n" for event in [*events, "[DONE]"]]
