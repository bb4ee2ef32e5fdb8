"""The recording front of vLLM's own OpenAI server (rollout=vllm, rollout.openai_server=vllm): what task.agent's
agents reach instead of grpo-cli's endpoint (endpoint/server.py), with the same URLs, token and episodes.

It is a small FastAPI app served by uvicorn on the server's loop (engines/vllm_server.py), on 127.0.0.1 at a port
the OS picks, behind a bearer token made for the run; each episode has its own base URL
`http://127.0.0.1:<port>/<episode id>/v1`. It passes on, in process, only the routes an agent needs to vLLM's app
(chat completions, completions, /inference/v1/generate, GET /v1/models); vLLM's other routes (LoRA loading,
metrics, elastic scaling, ...) are not reachable from an agent. A generating call:

1. its prompt ids are what vLLM will sample from: vLLM's own render route gives them (the chat template vLLM
   applies, with the call's tools), or the call sends ids;
2. the episode (`recording.AgentEpisode.plan_tokens`) places them: a call whose ids begin with the episode's
   tokens so far and a reply it got continues the episode (the ids between are the environment's, mask 0);
   otherwise the episode goes on as a new segment (counted in train/rewritten_turns, the tokens so far dropped),
   and limits refuse a call with HTTP 400 as on grpo-cli's endpoint;
3. vLLM samples it with the call's own fields, checked first by grpo-cli's schema (endpoint/requests.py, the
   same as on grpo-cli's endpoint): a malformed field, or one that would sample from another distribution than the
   learner scores (a temperature other than rollout.temperature, top_k, min_p, penalties, logit_bias,
   allowed_token_ids, structured outputs, ...), is HTTP 400 naming it and never reaches vLLM; fields the schema does
   not know are vLLM's own, which vLLM checks. Then: max_tokens at most the episode's room, the run's temperature
   and top_p where the call is silent, the episode's random stream as `seed` (turn_seed(step seed, call number),
   then the episode's index, as grpo-cli's endpoint seeds it), and `return_token_ids` / `logprobs` so that the
   reply carries the sampled ids and their log-probs;
4. those ids and log-probs are the episode's model turn (`AgentEpisode.take`), exactly as sampled; the reply goes
   back as vLLM wrote it (its tool_calls from vLLM's parser), log-probs removed when the call did not ask for them.

Unlike grpo-cli's endpoint, which continues a chat at the message level and never re-renders, each chat call here
is vLLM's rendering of the whole conversation: where the template renders an earlier reply as other ids than the
ones sampled (a non-canonical tokenization, a template that rewrites assistant turns), the call does not extend the
episode's ids and counts as a rewritten turn. An episode's calls are taken one at a time.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations (endpoint/server.py says why).
import json
import logging
import queue
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpo_cli.endpoint.recording import AgentEpisode, Refused
from grpo_cli.endpoint.requests import SamplingPolicy
from grpo_cli.endpoint.server import (
    ROUTES,
    Route,
    access_refusal,
    error_body,
    openai_errors,
    read_json,
    require_endpoint,
)
from grpo_cli.engines.sampling import completion_seed, turn_seed
from grpo_cli.episodes.turns import SampledTurn

# The render route of vLLM's app that gives a call's prompt ids, per route that takes messages or text.
RENDER_ROUTES = {"chat": "/v1/chat/completions/render", "completions": "/v1/completions/render"}


@dataclass
class OpenEpisode:
    """An episode the front answers: its AgentEpisode, the step's seed and default sampling. `guard` orders the
    front's use of the episode with the rollout thread's (`close`)."""

    episode: AgentEpisode
    step_seed: int
    temperature: float
    top_p: float
    min_tokens: int = 0  # rollout.min_tokens, as grpo-cli's endpoint applies it (at most a call's budget)
    guard: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    busy: Any = None  # an asyncio.Lock on the server's loop: the episode's calls one at a time

    def close(self) -> None:
        with self.guard:
            self.closed = True


def sampled_turns(route: Route, answer: dict[str, Any], with_log_probs: bool) -> list[SampledTurn]:
    """Each choice's sampled ids and their log-probs (None when the call's top_p renormalized them over the
    nucleus), in choice order, from vLLM's reply."""
    turns = []
    for choice in sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0)):
        ids = [int(t) for t in choice.get("token_ids") or []]
        log_probs: list[float] | None = None
        entries = choice.get("logprobs") or {}
        if with_log_probs:
            if route == "completions":
                log_probs = [float(x) for x in entries.get("token_logprobs") or []]
            else:
                log_probs = [float(e["logprob"]) for e in entries.get("content") or []]
            if len(log_probs) != len(ids):
                raise ValueError(f"vLLM gave {len(log_probs)} log-probs for {len(ids)} sampled tokens")
        turns.append(SampledTurn(ids, log_probs, choice.get("finish_reason") != "length"))
    return turns


def replied_messages(route: Route, answer: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A chat reply's messages, as vLLM parsed them (its tool parser's tool_calls included), in choice order."""
    if route != "chat":
        return None
    choices = sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0))
    messages = []
    for choice in choices:
        message = {k: v for k, v in (choice.get("message") or {}).items() if v is not None}
        message.setdefault("role", "assistant")
        message.setdefault("content", "")
        messages.append(message)
    return messages


def stream_answer(events: Sequence[str]) -> dict[str, Any]:
    """A streamed reply's events (`data: {...}` lines) gathered into the whole reply's choices: each choice's
    token_ids, log-prob entries and finish_reason, and the prompt's ids."""
    choices: dict[int, dict[str, Any]] = {}
    prompt_ids = None
    for event in events:
        data = event.removeprefix("data:").strip()
        if not data or data == "[DONE]":
            continue
        chunk = json.loads(data)
        prompt_ids = chunk.get("prompt_token_ids") or prompt_ids
        for part in chunk.get("choices") or []:
            whole = choices.setdefault(
                part.get("index", 0),
                {
                    "index": part.get("index", 0),
                    "token_ids": [],
                    "logprobs": {"content": [], "token_logprobs": []},
                    "message": {"role": "assistant", "content": ""},
                },
            )
            whole["token_ids"].extend(part.get("token_ids") or [])
            _add_delta(whole["message"], part.get("delta") or {})
            entries = part.get("logprobs") or {}
            whole["logprobs"]["content"].extend(entries.get("content") or [])
            whole["logprobs"]["token_logprobs"].extend(entries.get("token_logprobs") or [])
            if part.get("finish_reason") is not None:
                whole["finish_reason"] = part["finish_reason"]
    return {"choices": list(choices.values()), "prompt_token_ids": prompt_ids}


def _add_delta(message: dict[str, Any], delta: dict[str, Any]) -> None:
    """A streamed chat chunk's delta added to the reply's message: its text, and its tool calls' pieces (each
    call's id and name once, its arguments in fragments) by the call's index."""
    message["content"] += delta.get("content") or ""
    for piece in delta.get("tool_calls") or []:
        calls = message.setdefault("tool_calls", [])
        while len(calls) <= piece.get("index", 0):
            calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        call = calls[piece.get("index", 0)]
        call["id"] = piece.get("id") or call["id"]
        function = piece.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""


def forwarded_body(route: Route, raw: dict[str, Any], max_tokens: int, seed: int, open_: OpenEpisode) -> dict[str, Any]:
    """The call as vLLM samples it (module docstring, 3)."""
    body = dict(raw)
    if route == "generate":
        params = dict(body.get("sampling_params") or {})
        params.setdefault("temperature", open_.temperature)
        params.setdefault("top_p", open_.top_p)
        params.setdefault("min_tokens", min(open_.min_tokens, max_tokens))
        params.update(max_tokens=max_tokens, seed=seed, logprobs=max(int(params.get("logprobs") or 0), 0))
        body["sampling_params"] = params
        return body
    body.pop("max_completion_tokens" if route == "completions" else "max_tokens", None)
    body.update({"max_completion_tokens" if route == "chat" else "max_tokens": max_tokens})
    body.update(seed=seed, return_token_ids=True)
    if body.get("temperature") is None:
        body["temperature"] = open_.temperature
    if body.get("top_p") is None:
        body["top_p"] = open_.top_p
    body.setdefault("min_tokens", min(open_.min_tokens, max_tokens))
    if route == "chat":
        body["logprobs"] = True
    else:
        body["logprobs"] = max(int(body.get("logprobs") or 0), 0)
    return body


def shown_answer(route: Route, answer: dict[str, Any], asked_log_probs: bool) -> dict[str, Any]:
    """vLLM's reply as the agent gets it: log-probs it did not ask for removed; on the token route each log-prob
    entry also names its token as "token_id:<id>", which verifiers' renderers read (vLLM 0.32 does not send it)."""
    for choice in answer.get("choices") or []:
        if not asked_log_probs and route != "generate":
            choice["logprobs"] = None
        elif route == "generate":
            for entry in (choice.get("logprobs") or {}).get("content") or []:
                entry.setdefault("token", f"token_id:{entry.get('token_id')}")
    return answer


class VLLMFront:
    """The front (module docstring) over `served` (a rollout/vllm_server.ServedVLLM), started once per run."""

    def __init__(self, served: Any) -> None:
        require_endpoint()
        self.token = secrets.token_urlsafe(24)
        self.open: dict[str, OpenEpisode] = {}
        self.ends: queue.Queue[tuple[str, Any, str | None]] = queue.Queue()  # (episode, reward, error) reports
        self.served = served
        self.port = served.serve(build_front(self, served.app))

    def base_url(self, episode: str) -> str:
        return f"http://127.0.0.1:{self.port}/{episode}/v1"

    def close(self) -> None:
        """The front stops with the engine's server (VLLMRolloutEngine.close); episodes still open are closed."""
        for open_ in self.open.values():
            open_.close()
        self.open.clear()


# Where the front reaches vLLM's app, in process (httpx's ASGI transport: no socket).
IN_PROCESS_URL = "http://vllm"


class _QuietInProcessCalls(logging.Filter):
    """httpx logs every request at INFO, which a run's console shows: the front's own calls to vLLM's app (several
    per model call) are left out; an agent's own httpx calls (in this process with task.reward_workers=0) are not."""

    def filter(self, record: logging.LogRecord) -> bool:
        return f"{IN_PROCESS_URL}/" not in record.getMessage()


_QUIET = _QuietInProcessCalls()


def build_front(front: VLLMFront, vllm_app: Any) -> Any:
    """The front's FastAPI app (module docstring), reaching `vllm_app` in process."""
    import asyncio

    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    from grpo_cli.endpoint.requests import check_body, check_request

    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    openai_errors(app)
    logging.getLogger("httpx").addFilter(_QUIET)
    vllm = httpx.AsyncClient(transport=httpx.ASGITransport(app=vllm_app), base_url=IN_PROCESS_URL, timeout=None)

    def refused(status: int, message: str, code: str, kind: str = "invalid_request_error") -> Any:
        return JSONResponse(error_body(message, code, kind), status_code=status)

    def checked(request: Request, key: str) -> Any:
        refusal = access_refusal(request.headers.get("authorization", ""), front.token, key, front.open)
        return None if refusal is None else JSONResponse(refusal[1], status_code=refusal[0])

    async def ask(path: str, body: dict[str, Any]) -> tuple[int, Any, list[str] | None]:
        """POST to vLLM's app: (status, JSON reply or None, the SSE event lines of a stream or None). The one model
        served is named as vLLM knows it, whatever name the agent sent (grpo-cli's endpoint ignores it too)."""
        reply = await vllm.post(path, json={**body, "model": front.served.model_name})
        if "text/event-stream" in reply.headers.get("content-type", ""):
            return reply.status_code, None, [line for line in reply.text.splitlines() if line.startswith("data:")]
        try:
            return reply.status_code, reply.json(), None
        except ValueError:
            return reply.status_code, error_body(reply.text[:200], "vllm_error", "server_error"), None

    async def prompt_ids(route: Route, raw: dict[str, Any]) -> tuple[list[int] | None, Any]:
        """The ids vLLM samples the call from, or (None, the refusal)."""
        if route == "generate":
            return [int(t) for t in raw["token_ids"]], None
        if route == "completions" and isinstance(raw["prompt"], list) and raw["prompt"]:
            prompt = raw["prompt"]
            ids = prompt[0] if isinstance(prompt[0], list) else prompt
            if all(isinstance(t, int) for t in ids):
                return [int(t) for t in ids], None
        render = {k: v for k, v in raw.items() if k not in ("stream", "stream_options")}
        status, answer, _ = await ask(RENDER_ROUTES[route], render)
        if status != 200:
            return None, JSONResponse(answer, status_code=status)
        rendered = answer[0] if isinstance(answer, list) else answer
        return [int(t) for t in rendered["token_ids"]], None

    async def recorded(key: str, request: Request, route: Route, path: str) -> Any:
        if (answer := checked(request, key)) is not None:
            return answer
        raw, problem = await read_json(request)
        open_ = front.open.get(key)
        if open_ is None:  # it ended while the body was read
            return refused(409, "the episode has ended", "episode_ended")
        if problem is None:  # the schema with the episode's sampling; vLLM checks its own fields
            policy = SamplingPolicy(open_.temperature, open_.top_p, open_.min_tokens)
            _, problem = check_request(route, raw, policy, unknown_fields=True)
        if problem is not None:
            return JSONResponse(problem.body(), status_code=problem.status)
        if route == "completions" and isinstance(raw["prompt"], list) and len(raw["prompt"]) > 1:
            if isinstance(raw["prompt"][0], (str, list)):
                message = "prompt: one prompt per call (an episode is one conversation); send the others on their own"
                return JSONResponse(error_body(message, "unsupported_parameter", param="prompt"), status_code=400)
        if open_.busy is None:
            open_.busy = asyncio.Lock()
        async with open_.busy:
            ids, refusal = await prompt_ids(route, raw)
            if refusal is not None or ids is None:
                return refusal
            params = (raw.get("sampling_params") or {}) if route == "generate" else raw
            n = int(params.get("n") or 1)
            limit = params.get("max_completion_tokens") or params.get("max_tokens")
            with open_.guard:
                if open_.closed:
                    return refused(409, "the episode has ended", "episode_ended")
                try:
                    plan = open_.episode.plan_tokens(ids, n, limit, raw.get("messages") if route == "chat" else None)
                except Refused as e:
                    return refused(400, str(e), e.code)
            seed = completion_seed(turn_seed(open_.step_seed, plan.turn), open_.episode.index, 0)
            body = forwarded_body(route, raw, plan.max_tokens, seed, open_)
            status, answer, events = await ask(path, body)
            if status != 200:
                return JSONResponse(answer, status_code=status)
            whole = stream_answer(events) if events is not None else answer
            if whole.get("prompt_token_ids") not in (None, ids):
                return refused(500, "vLLM sampled from other ids than it rendered", "render_mismatch", "server_error")
            top_p = float((body.get("sampling_params") or body).get("top_p") or 1.0)
            try:
                turns = sampled_turns(route, whole, with_log_probs=top_p >= 1.0)
            except ValueError as e:  # vLLM's reply without the fields it was asked for
                return refused(500, f"vLLM's reply cannot be recorded: {e}", "unrecorded_reply", "server_error")
            with open_.guard:
                if open_.closed:
                    return refused(409, "the episode has ended", "episode_ended")
                open_.episode.take(turns, with_tools=False, messages=replied_messages(route, whole))
        asked = bool(raw.get("logprobs")) if route != "generate" else True
        if events is None:
            return JSONResponse(shown_answer(route, answer, asked))
        return Response(_shown_events(route, events, asked), media_type="text/event-stream")

    def handler(route: Route, path: str) -> Callable[..., Any]:
        async def handle(episode: str, request: Request) -> Any:
            return await recorded(episode, request, route, path)

        return handle

    for path, route in ROUTES.items():
        if route != "end":
            app.post(f"/{{episode}}{path}")(handler(route, path))

    @app.post("/{episode}/end")
    async def end(episode: str, request: Request) -> Any:
        if (answer := checked(request, episode)) is not None:
            return answer
        raw, problem = await read_json(request)
        if problem is None:
            body, problem = check_body("end", raw)
        if problem is not None:
            return JSONResponse(problem.body(), status_code=problem.status)
        front.ends.put((episode, body.get("reward"), body.get("error")))
        return {"ok": True}

    @app.get("/{episode}/v1/models")
    async def models(episode: str, request: Request) -> Any:
        if (answer := checked(request, episode)) is not None:
            return answer
        reply = await vllm.get("/v1/models")
        return JSONResponse(reply.json(), status_code=reply.status_code)

    return app


def _shown_events(route: Route, events: list[str], asked_log_probs: bool) -> str:
    """A streamed reply's events as the agent gets them (shown_answer for each chunk)."""
    shown = []
    for event in events:
        data = event.removeprefix("data:").strip()
        if data and data != "[DONE]":
            data = json.dumps(shown_answer(route, json.loads(data), asked_log_probs))
        shown.append(f"data: {data}\n\n")
    return "".join(shown)
