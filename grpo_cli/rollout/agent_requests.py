"""The agent endpoint's request and response bodies (rollout/agent_server.py): what each route accepts, checked
with pydantic, and the replies built with the openai package's own response types. No HTTP, no engine here."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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


_MODELS: dict[str, type[BaseModel]] = {"chat": ChatRequest, "completions": CompletionRequest, "end": EndRequest}


def check_body(route: str, raw: Any) -> tuple[dict[str, Any], str | None]:
    """(the body, None) or ({}, the one line saying what is wrong with it)."""
    model = _MODELS.get(route)
    if model is None:
        from grpo_cli.rollout.verifiers_route import check_generate_body

        return check_generate_body(raw)
    try:
        body = model.model_validate(raw).model_dump()
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        return {}, f"{where}: {first['msg']}"
    if body.get("stream"):
        return {}, "stream=true is not served: the endpoint answers each call whole (leave stream unset)"
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


def _usage(plan: CallPlan, replies: Sequence[Reply]) -> Any:
    from openai.types import CompletionUsage

    sampled = sum(len(r.turn.ids) for r in replies)
    return CompletionUsage(
        prompt_tokens=len(plan.prompt_ids), completion_tokens=sampled, total_tokens=len(plan.prompt_ids) + sampled
    )


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
    completion = ChatCompletion(
        id=f"chatcmpl-{plan.turn}-{time.monotonic_ns()}",
        object="chat.completion",
        created=int(time.time()),
        model=model,
        choices=[],
        usage=_usage(plan, replies),
    )
    return {**completion.model_dump(), "choices": choices, "prompt_token_ids": list(plan.prompt_ids)}


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
        reason = "stop" if reply.finish_reason != "length" else "length"
        choice = CompletionChoice(index=index, text=reply.text, finish_reason=reason, logprobs=entries)
        choices.append({**choice.model_dump(), "token_ids": list(reply.turn.ids)})
    completion = Completion(
        id=f"cmpl-{plan.turn}-{time.monotonic_ns()}",
        object="text_completion",
        created=int(time.time()),
        model=model,
        choices=[],
        usage=_usage(plan, replies),
    )
    return {**completion.model_dump(), "choices": choices, "prompt_token_ids": list(plan.prompt_ids)}


def _logprobs(reply: Reply) -> list[float]:
    return [float(x) for x in reply.turn.logprobs or ()]
