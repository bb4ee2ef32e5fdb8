"""The agent endpoint's request and response bodies (endpoint/server.py, and the checks vLLM's front makes,
endpoint/vllm_front.py): what each route accepts, checked with pydantic, and the replies built with the openai
package's own response types. No HTTP, no engine here.

One schema (`SamplingFields`) holds the sampling fields of chat completions, completions and
/inference/v1/generate's `sampling_params` (OpenAI's names and vLLM's), and `check_request` applies it with the
run's own bounds (`SamplingPolicy`):

- types are checked strictly, as OpenAI's API checks them: "0.7" is not a number, true is not an integer, NaN is
  refused, and so is a field this endpoint does not know (vLLM's front passes fields it does not know on to vLLM,
  whose own request checks answer them);
- a field that changes the distribution a reply is sampled from is refused unless it leaves that distribution as the
  learner scores it. The learner trains each sampled token on log softmax(logits / rollout.temperature) over the
  whole vocabulary (batch/settings.py), so `temperature` must be rollout.temperature, `top_p` 1 or rollout.top_p
  (the nucleus the run's own rollouts use too), `min_tokens` rollout.min_tokens; top_k, min_p, the penalties,
  logit_bias, allowed_token_ids, bad_words, structured outputs (response_format json_object / json_schema,
  structured_outputs, guided_*), a tool_choice that forces a call, ignore_eos, beam search, logits processors and
  vLLM's extra arguments are refused at any value but their neutral one. Refusing is the honest choice: applying one
  when sampling and not when scoring trains on log-probs of a distribution the tokens were not sampled from;
- a token prompt's ids lie in the model's vocabulary.

Every refusal is HTTP 400 in OpenAI's error shape, `param` naming the field, so an agent's malformed call is that
call's error and never reaches the engine."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from grpo_cli.endpoint.recording import CallPlan, Reply

MAX_N = 64  # replies per call: n samples of one prompt in one engine call
MAX_STOP = 16  # stop strings per call (OpenAI allows 4; vLLM any number)


def error_body(
    message: str, code: str, kind: str = "invalid_request_error", param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape, which its clients raise as APIStatusError with this message (`param`: the field)."""
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


@dataclass(frozen=True)
class Problem:
    """Why a request is refused: its HTTP status, one line, OpenAI's error code and the field it names."""

    status: int
    message: str
    code: str
    param: str | None = None

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.code, param=self.param)


@dataclass(frozen=True)
class SamplingPolicy:
    """The run's sampling, which a call's sampling fields must leave as it is (module docstring): the step's
    temperature, top_p and min_tokens (rollout.*), and the model's vocabulary size (None: not checked here, as on
    vLLM's front, where vLLM checks prompt ids itself)."""

    temperature: float
    top_p: float
    min_tokens: int
    vocab_size: int | None = None


_STRICT = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
_Stops = Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)]
_TokenIds = list[Annotated[int, Field(ge=0)]]


class SamplingFields(BaseModel):
    """The sampling fields of every generating route (OpenAI's and vLLM's names): what is served, what is accepted
    and not used (documented in docs/multi-turn.md), and the fields that change the sampled distribution
    (`NEUTRAL`: refused but at their neutral value)."""

    model_config = _STRICT

    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    min_tokens: int | None = Field(None, ge=0)
    stop: Annotated[str, Field(min_length=1)] | _Stops | None = None
    logprobs: bool | Annotated[int, Field(ge=0, le=20)] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Accepted, with no effect on what is sampled: a call's seed (each call is sampled from its episode's own
    # random streams), how ids are detokenized or returned, a client's bookkeeping.
    seed: int | None = None
    stop_token_ids: _TokenIds | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    detokenize: bool | None = None
    flat_logprobs: bool | None = None
    return_token_ids: bool | None = None
    # The distribution's own fields (NEUTRAL).
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: _TokenIds | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    tool_choice: str | dict[str, Any] | None = None
    use_beam_search: bool | None = None
    best_of: int | None = Field(None, ge=1)
    length_penalty: float | None = None
    logits_processors: list[Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    extra_args: dict[str, Any] | None = None
    truncate_prompt_tokens: int | None = None


class _Request(SamplingFields):
    """A body's fields besides the sampling ones, accepted and not used (a client's bookkeeping)."""

    model: str | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    cache_salt: str | None = None
    priority: int | None = None
    request_id: str | None = None


class ChatRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]


class EndRequest(BaseModel):
    """The agent runner's report (usercode/agents.py): the agent's reward (a number, {name: number}, or None) or the
    error that ended it."""

    model_config = ConfigDict(allow_inf_nan=False)

    reward: float | dict[str, float] | None = None
    error: str | None = None


class GenerateRequest(BaseModel):
    """vLLM's token-in route (vllm/entrypoints/scale_out/token_in_token_out/protocol.py, GenerateRequest), as
    verifiers' trainer client (renderers.client.generate) sends it: the prompt's token ids and vLLM's sampling
    parameters (SamplingFields: stop_token_ids and skip_special_tokens, which it sends, are accepted and not used:
    the engine stops at the model's end-of-turn tokens and returns ids)."""

    model_config = _STRICT

    model: str | None = None
    token_ids: _TokenIds = Field(min_length=1)
    sampling_params: SamplingFields = Field(default_factory=lambda: SamplingFields.model_validate({}))
    stream: bool | None = None
    cache_salt: str | None = None
    priority: int | None = None
    request_id: str | None = None


_MODELS: dict[str, type[BaseModel]] = {
    "chat": ChatRequest,
    "completions": CompletionRequest,
    "end": EndRequest,
    "generate": GenerateRequest,
}


def _same(value: float, wanted: float) -> bool:
    return math.isclose(value, wanted, rel_tol=1e-9, abs_tol=1e-12)


# Each field that changes the sampled distribution, and the values that leave it as the learner scores it.
NEUTRAL: dict[str, Callable[[Any, SamplingPolicy], bool]] = {
    "temperature": lambda v, p: v is None or _same(v, p.temperature),
    "top_p": lambda v, p: v is None or v == 1.0 or _same(v, p.top_p),
    "min_tokens": lambda v, p: v is None or v == p.min_tokens,
    "top_k": lambda v, p: v in (None, 0, -1),
    "min_p": lambda v, p: v in (None, 0.0),
    "presence_penalty": lambda v, p: v in (None, 0.0),
    "frequency_penalty": lambda v, p: v in (None, 0.0),
    "repetition_penalty": lambda v, p: v in (None, 1.0),
    "logit_bias": lambda v, p: not v,
    "allowed_token_ids": lambda v, p: v is None,
    "bad_words": lambda v, p: not v,
    "ignore_eos": lambda v, p: not v,
    "response_format": lambda v, p: v is None or v.get("type") == "text",
    "structured_outputs": lambda v, p: v is None,
    "guided_json": lambda v, p: v is None,
    "guided_regex": lambda v, p: v is None,
    "guided_choice": lambda v, p: v is None,
    "guided_grammar": lambda v, p: v is None,
    "tool_choice": lambda v, p: v in (None, "auto", "none"),
    "use_beam_search": lambda v, p: not v,
    "best_of": lambda v, p: v in (None, 1),
    "length_penalty": lambda v, p: v in (None, 1.0),
    "logits_processors": lambda v, p: not v,
    "vllm_xargs": lambda v, p: not v,
    "extra_args": lambda v, p: not v,
    "truncate_prompt_tokens": lambda v, p: v is None,
}


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) else f"{value:g}"
    return text if len(text) <= 60 else text[:57] + "..."


def distribution_problem(fields: SamplingFields, policy: SamplingPolicy, prefix: str = "") -> Problem | None:
    """The first field of `fields` that would sample from another distribution than the learner scores, refused
    in one line naming it (module docstring), or None."""
    for name, neutral in NEUTRAL.items():
        value = getattr(fields, name)
        if neutral(value, policy):
            continue
        param = f"{prefix}{name}"
        if name in ("temperature", "top_p", "min_tokens"):
            run = getattr(policy, name)
            allowed = f"{run:g}" if name != "top_p" or run == 1.0 else f"1 or {run:g}"
            message = (
                f"{param}={_shown(value)}: this run samples and trains at rollout.{name}={run:g} (the learner scores "
                f"each sampled token as that distribution gives it, so a turn sampled otherwise would train on "
                f"log-probs it was not sampled from): leave {name} out or send {allowed}"
            )
        else:
            message = (
                f"{param}={_shown(value)} changes the distribution the reply is sampled from, which the learner "
                f"does not apply (it trains log softmax(logits / rollout.temperature) over the whole vocabulary): "
                f"leave {name} out"
            )
        return Problem(400, message, "unsupported_parameter", param)
    return None


def _invalid(error: ValidationError) -> Problem:
    """A pydantic error as OpenAI's: the field's path (without pydantic's union-branch names) and what it got."""
    errors = error.errors()
    # A union field fails once per branch: the deepest failure says most (stop=[""]: its item is empty).
    first = max(errors, key=lambda e: (len(e["loc"]), -errors.index(e)))
    path = [str(p) for p in first["loc"] if isinstance(p, int) or not _is_type_tag(str(p))]
    param = ".".join(path) or None
    got = first.get("input")
    shown = "" if first["type"] == "missing" else f" (got {_shown(got) if _jsonable(got) else type(got).__name__})"
    return Problem(400, f"{param or 'body'}: {first['msg']}{shown}", "invalid_value", param)


def _is_type_tag(part: str) -> bool:
    """pydantic names a union's branch in an error's location (`str`, `list[int]`, `constrained-str`, ...)."""
    return part in ("str", "int", "float", "bool", "dict", "list", "none") or any(c in part for c in "[]-")


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _ids_problem(ids: Sequence[Any], vocab_size: int | None, param: str) -> Problem | None:
    if vocab_size is None:
        return None
    outside = next((i for i in ids if isinstance(i, int) and not 0 <= i < vocab_size), None)
    if outside is None:
        return None
    message = f"{param}: token id {outside} is not in the model's vocabulary (0 to {vocab_size - 1})"
    return Problem(400, message, "invalid_value", param)


def check_request(
    route: str, raw: Any, policy: SamplingPolicy | None, *, unknown_fields: bool = False
) -> tuple[BaseModel | None, Problem | None]:
    """The route's body validated (types, bounds, the run's sampling, a token prompt's vocabulary), or the
    Problem to answer. `unknown_fields`: fields the schema does not know pass (vLLM's front: vLLM checks them)."""
    if not isinstance(raw, dict):
        return None, Problem(400, f"the request body must be a JSON object, not {type(raw).__name__}", "invalid_value")
    model = _MODELS[route]
    try:
        parsed = model.model_validate(raw)
    except ValidationError as e:
        return None, _invalid(e)
    except RecursionError:  # JSON nested past what the validator walks: no client means that
        return None, Problem(400, "the request body is nested too deeply", "invalid_value")
    if route == "end":
        return parsed, None
    fields = parsed.sampling_params if isinstance(parsed, GenerateRequest) else parsed
    assert isinstance(fields, SamplingFields)
    prefix = "sampling_params." if route == "generate" else ""
    if not unknown_fields:
        unknown = [k for k in raw if k not in model.model_fields]
        if isinstance(parsed, GenerateRequest):
            unknown += [
                f"{prefix}{k}" for k in (raw.get("sampling_params") or {}) if k not in SamplingFields.model_fields
            ]
        if unknown:
            message = (
                f"unrecognized request argument supplied: {unknown[0]} (the fields this endpoint takes: "
                "docs/multi-turn.md#agents-your-own-code-drives-the-episode)"
            )
            return None, Problem(400, message, "unknown_parameter", unknown[0])
    if policy is not None:
        problem = distribution_problem(fields, policy, prefix)
        if problem is None and isinstance(parsed, GenerateRequest):
            problem = _ids_problem(parsed.token_ids, policy.vocab_size, "token_ids")
        if problem is None and isinstance(parsed, CompletionRequest) and isinstance(parsed.prompt, list):
            flat = [i for p in parsed.prompt for i in (p if isinstance(p, list) else [p])]
            problem = _ids_problem(flat, policy.vocab_size, "prompt")
        if problem is not None:
            return None, problem
    return parsed, None


def check_body(route: str, raw: Any, policy: SamplingPolicy | None = None) -> tuple[dict[str, Any], Problem | None]:
    """grpo-cli's endpoint: (the body as the rollout thread reads it, None) or ({}, the Problem to answer): the
    schema (check_request), then what this endpoint does not serve."""
    parsed, problem = check_request(route, raw, policy)
    if problem is not None or parsed is None:
        return {}, problem
    body = parsed.model_dump()
    if isinstance(parsed, GenerateRequest):
        if parsed.stream:
            message = "stream=true is not served on /inference/v1/generate (vLLM's tokens mode answers whole)"
            return {}, Problem(400, message, "unsupported_parameter", "stream")
        params = parsed.sampling_params
        if params.n != 1:
            message = "sampling_params.n: one sample per call on /inference/v1/generate"
            return {}, Problem(400, message, "unsupported_parameter", "sampling_params.n")
        if isinstance(params.logprobs, int) and not isinstance(params.logprobs, bool) and params.logprobs > 1:
            message = (
                f"sampling_params.logprobs={params.logprobs}: top log-probs are not served: the engine gives the "
                "sampled tokens' log-probs only (logprobs=1)"
            )
            return {}, Problem(400, message, "unsupported_parameter", "sampling_params.logprobs")
        return {
            "prompt": list(parsed.token_ids),
            **params.model_dump(),
            "logprobs": True,
        }, None
    top = body.get("top_logprobs") or (body.get("logprobs") if route == "completions" else 0)
    if isinstance(top, int) and not isinstance(top, bool) and top > (0 if route == "chat" else 1):
        param = "top_logprobs" if body.get("top_logprobs") else "logprobs"
        message = "top_logprobs is not served: the engine gives the sampled tokens' log-probs only (logprobs=true)"
        return {}, Problem(400, message, "unsupported_parameter", param)
    if route == "completions":
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                message = "prompt: one prompt per call (an episode is one conversation); send the others on their own"
                return {}, Problem(400, message, "unsupported_parameter", "prompt")
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


def sampling_of(body: Mapping[str, Any], temperature: float, top_p: float) -> Sampling:
    """The checked call's sampling fields (check_body) with the run's temperature and top_p as defaults."""
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    return Sampling(
        int(body.get("n") or 1),
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
