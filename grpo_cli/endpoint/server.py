"""The OpenAI-compatible endpoint over the policy, for agent code (task.agent): FastAPI routes served by uvicorn in a
thread of the rollout process, on the loopback interface, at a port the OS picks, behind a bearer token made for
the run.

Each episode has its own base URL, `http://127.0.0.1:<port>/<episode id>/v1`, so a call says whose it is by where
it goes and any OpenAI client works unchanged (base_url=..., api_key=<the run's token>). The routes:

    POST /<episode>/v1/chat/completions   messages, tools, n, temperature, top_p, max_tokens /
                                          max_completion_tokens, stop, logprobs (the sampled tokens' own), stream
    POST /<episode>/v1/completions        a prompt as text or token ids, the same sampling fields
    POST /<episode>/inference/v1/generate vLLM's token-in route that verifiers' trainer client calls
    GET  /<episode>/v1/models             the one model served, with its max_model_len
    POST /<episode>/end                   the agent runner's report of the episode's end (reward or error)

The handlers only check and queue a call (`ModelCall`); the rollout's own thread takes the queue, samples on the
engine in batches (rollout/agent_run.py) and answers each call's future with the JSON to send. Responses are built
with the openai package's own types and also carry vLLM's token fields (`prompt_token_ids`, and `token_ids` per
choice), which some agent frameworks read. A streamed call gets its reply as server-sent events once it is
sampled whole (verifiers' harness programs always stream); top_logprobs is refused with one line (HTTP 400): the
engine gives the sampled tokens' log-probs only.

Every request is checked before it is queued (endpoint/requests.py: one schema, the run's own sampling): a
malformed one, or one asking for a distribution the learner does not train on, is that call's HTTP 400 in OpenAI's
error shape; a body past MAX_BODY_BYTES is HTTP 413. So an agent's request never reaches the engine unless the engine
can sample it, and never ends a step. Closing the server answers every call still pending, queued or taken by the
rollout thread (HTTP 503), and stops uvicorn's thread within CLOSE_S.
"""

# No `from __future__ import annotations` here: FastAPI reads the routes' annotations (Request, imported inside
# build_app, since FastAPI is an optional extra) as objects, which deferred annotations would hide from it.
import asyncio
import hmac
import json
import queue
import secrets
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Literal

from grpo_cli.endpoint.requests import Problem, SamplingPolicy, error_body
from grpo_cli.errors import UserFacingError

__all__ = ["error_body"]  # the endpoint's error shape, re-exported for the rollout thread and vLLM's front

Route = Literal["chat", "completions", "generate", "end"]
# The largest request body read: a 128k-token context is about 1 MiB as JSON token ids and half that as text, so
# 8 MiB holds any conversation a served model can take, with its tool schemas; a larger body is refused (HTTP 413)
# before it is read whole.
MAX_BODY_BYTES = 8 * 1024 * 1024
# How long closing waits for uvicorn's thread once every pending call is answered.
CLOSE_S = 5.0
# Each POST route after the episode's part of the URL, and what it serves (the module docstring).
ROUTES: dict[str, Route] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/inference/v1/generate": "generate",
    "/end": "end",
}


@dataclass(eq=False)  # compared and hashed by identity: the server keeps its pending calls in a set
class ModelCall:
    """One request, queued for the rollout thread: its episode, its route, its checked body; `answer` gets
    (HTTP status, JSON body)."""

    episode: str
    route: Route
    body: dict[str, Any]
    answer: Future[tuple[int, dict[str, Any]]] = field(default_factory=Future)
    arrived: float = field(default_factory=time.monotonic)

    def reply(self, status: int, body: dict[str, Any]) -> None:
        """Answer the call, unless it has been answered (closing the server answers every pending call)."""
        try:
            self.answer.set_result((status, body))
        except InvalidStateError:
            pass


async def read_json(request: Any) -> tuple[Any, Problem | None]:
    """The request's JSON body, read up to MAX_BODY_BYTES, or the Problem to answer (HTTP 413 past the limit,
    400 for a body that is not JSON)."""
    declared = request.headers.get("content-length", "")
    too_big = Problem(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", "request_too_large")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        return None, too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None, too_big
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks)), None
    except (ValueError, RecursionError):
        return None, Problem(400, "the request body is not JSON", "invalid_json")


def access_refusal(
    authorization: str, token: str, episode: str | None, known: Any
) -> tuple[int, dict[str, Any]] | None:
    """(HTTP status, error body) for a call without the run's bearer token or to an episode not open (`known`: the
    open episodes' ids; `episode` None: the token only), else None: the check both the endpoint and vLLM's front
    (endpoint/vllm_front.py) make first."""
    if not hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode()):
        message = "wrong or missing API key: use the api_key the agent was given"
        return 401, error_body(message, "invalid_api_key", "authentication_error")
    if episode is not None and episode not in known:
        message = f"no open episode {episode!r} at this URL (it ended, or the URL is wrong)"
        return 404, error_body(message, "unknown_episode", "not_found_error")
    return None


def _missing_extra(error: ImportError) -> UserFacingError:
    return UserFacingError(
        f"task.agent serves the policy over HTTP with FastAPI and uvicorn, which are not installed ({error}): "
        "pip install 'grpo-cli[agents]'"
    )


def require_endpoint() -> None:
    """One line before any model loads when the endpoint's libraries are missing (preflight)."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise _missing_extra(e) from None


def openai_errors(app: Any) -> None:
    """Starlette's own refusals (a path that is no route: 404, a wrong method: 405) in OpenAI's error shape too."""
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def refused(request: Any, error: HTTPException) -> Any:
        body = error_body(str(error.detail), f"http_{error.status_code}")
        return JSONResponse(body, status_code=error.status_code, headers=getattr(error, "headers", None))


def build_app(
    token: str,
    calls: queue.Queue[ModelCall],
    known: set[str],
    model_card: dict[str, Any],
    policy: Any = lambda: None,
    pending: set[ModelCall] | None = None,
) -> Any:
    """The FastAPI app of the routes (module docstring); `known` holds the episode ids open now, `model_card` the
    model served (its id and max_model_len, kept up to date by the rollout), `policy()` the step's SamplingPolicy
    (None: types and bounds only), `pending` the calls queued and not yet answered (for closing)."""
    try:
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, StreamingResponse
    except ImportError as e:
        raise _missing_extra(e) from None
    from grpo_cli.endpoint.requests import check_body, stream_events

    waiting = pending if pending is not None else set()

    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    openai_errors(app)

    def unauthorized(request: Request, episode: str | None) -> Any:
        refusal = access_refusal(request.headers.get("authorization", ""), token, episode, known)
        return None if refusal is None else JSONResponse(refusal[1], status_code=refusal[0])

    async def queued(request: Request, episode: str, route: Route) -> Any:
        if (answer := unauthorized(request, episode)) is not None:
            return answer
        raw, problem = await read_json(request)
        if problem is None:
            body, problem = check_body(route, raw, policy())
        if problem is not None:
            return JSONResponse(problem.body(), status_code=problem.status)
        call = ModelCall(episode, route, body)
        waiting.add(call)
        try:
            calls.put(call)
            status, answer = await asyncio.wrap_future(call.answer)
        finally:
            waiting.discard(call)
        if status == 200 and body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            events = stream_events(route, answer, usage)
            return StreamingResponse(iter(events), media_type="text/event-stream")
        return JSONResponse(answer, status_code=status)

    def handler(route: Route) -> Any:
        async def handle(episode: str, request: Request) -> Any:
            return await queued(request, episode, route)

        return handle

    for path, route in ROUTES.items():
        app.post(f"/{{episode}}{path}")(handler(route))

    @app.get("/{episode}/v1/models")
    async def models(episode: str, request: Request) -> Any:
        if (answer := unauthorized(request, None)) is not None:
            return answer
        return {"object": "list", "data": [{"object": "model", "created": 0, "owned_by": "grpo-cli", **model_card}]}

    return app


class AgentServer:
    """The endpoint, started once per run and kept across steps: `calls` is the queue of model calls, `known` the
    episode ids it answers now (the rollout thread adds and drops them)."""

    def __init__(self, model_name: str) -> None:
        try:
            import uvicorn
        except ImportError as e:
            raise _missing_extra(e) from None
        self.token = secrets.token_urlsafe(24)
        self.calls: queue.Queue[ModelCall] = queue.Queue()
        self.known: set[str] = set()
        # The model card GET /v1/models shows (max_model_len: the engine's context, set by the rollout).
        self.model_card: dict[str, Any] = {"id": model_name, "max_model_len": None}
        # The step's sampling, which each call is checked against (set by the rollout before its agents start).
        self.policy: SamplingPolicy | None = None
        self._pending: set[ModelCall] = set()  # calls checked and not yet answered, queued or taken
        app = build_app(self.token, self.calls, self.known, self.model_card, lambda: self.policy, self._pending)
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=int(CLOSE_S),
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="grpo-cli-agent-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise UserFacingError("the agent endpoint (uvicorn on 127.0.0.1) did not start within 30s")
            time.sleep(0.01)
        self.port = int(self._server.servers[0].sockets[0].getsockname()[1])

    def base_url(self, episode: str) -> str:
        """The OpenAI base URL of one episode."""
        return f"http://127.0.0.1:{self.port}/{episode}/v1"

    def close(self) -> None:
        """Stop serving: every call still pending, queued or taken by the rollout thread, gets HTTP 503, and
        uvicorn's thread ends within CLOSE_S (forced after that)."""
        stopping = error_body("the run is stopping", "stopping", "server_error")
        while True:
            try:
                self.calls.get_nowait().reply(503, stopping)
            except queue.Empty:
                break
        for call in list(self._pending):  # a copy: the server's loop discards answered calls meanwhile
            call.reply(503, stopping)
        self._server.should_exit = True
        self._thread.join(timeout=CLOSE_S)
        if self._thread.is_alive():  # a connection that will not close (a client still sending): cut it
            self._server.force_exit = True
            self._thread.join(timeout=CLOSE_S)


def new_episode_id() -> str:
    """An episode's part of its URL: unguessable, so one agent cannot write into another's episode."""
    return secrets.token_hex(8)
