"""verifiers (prime-rl's environment library, 0.4.0) environments as task.agent: each episode is one rollout of the
row's verifiers task, run by verifiers itself against the policy's endpoint (docs/multi-turn.md#verifiers).

    grpo-run task=custom task.train_path=tasks.jsonl \\
        'task.agent={_target_: grpo_cli.endpoint.verifiers_agent.verifiers_agent, taskset: my_taskset, client: train}'

`tasks.jsonl` comes from `python -m grpo_cli.endpoint.verifiers_agent my_taskset --out tasks.jsonl`: one row per task
of the taskset, its `task_id` (TaskData.id) and its prompt as chat messages. The agent finds the row's task by
`task_id` and runs it through verifiers' `SingleAgentEnv` with the null harness (verifiers' own chat program, a uv
script) and the subprocess runtime (local), pointed at the episode's URL; the episode's reward is the trace's
(the rubric's weighted score), the `env` component. A failed rollout is the episode's error with verifiers' text.

The client: `train` is verifiers' trainer client (TrainClientConfig): it renders the chat with the policy's own
tokenizer (tokenizer_path) and calls vLLM's token-in route, so the episode trains on exactly the sampled tokens;
`eval` is its eval client, which relays the program's streamed chat completions. Neither sends sampling fields of
its own: the run's rollout.temperature, top_p and max_tokens apply.

Per worker process: one env and one event loop (a daemon thread), built once; each episode is a coroutine submitted
to that loop from its agent thread. verifiers keeps one model client per endpoint URL for as long as its serving
scope (`env.serving()`) is open, and every episode has its own URL, so the scope is opened when an episode starts
with none running and closed when the last running one ends (once per batch), which closes those clients.
Needs the `verifiers` extra (Python >= 3.11, uv on PATH); the taskset is an importable module (an installed
package, or one in the folder grpo-run starts from).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

from grpo_cli.errors import UserFacingError

# The environment variable verifiers' clients read the endpoint's token from (their api_key_var): not
# PRIME_API_KEY, which makes verifiers read the Prime platform's config. Its name holds API_KEY, so verifiers'
# subprocess runtime keeps it from the programs it launches.
API_KEY_VAR = "GRPO_CLI_VERIFIERS_API_KEY"
CLIENTS = ("train", "eval")
# The row column naming the verifiers task (TaskData.id; its index in the taskset when it has no id).
TASK_ID = "task_id"
_LOOPBACK = ("127.0.0.1", "localhost")


def _verifiers() -> Any:
    """verifiers.v1, or one line saying how to install it."""
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise UserFacingError(
            f"verifiers_agent needs verifiers 0.4.0 ({e}): pip install 'grpo-cli[verifiers]' (Python >= 3.11)"
        ) from None
    return vf


def build_env(taskset: str) -> Any:
    """verifiers' SingleAgentEnv over `taskset` (its id: an importable module exporting one Taskset class) with the
    null harness and the subprocess runtime (its default runtime is a remote Prime sandbox)."""
    vf = _verifiers()
    try:
        config = vf.SingleAgentEnvConfig(
            taskset=vf.TasksetConfig(id=taskset),
            agent=vf.AgentConfig(harness={"id": "null"}, runtime=vf.SubprocessConfig()),
        )
        return vf.SingleAgentEnv(config)
    except Exception as e:  # noqa: BLE001 - verifiers' loader failing (no such taskset) is one line
        detail = " ".join(str(e).split())[:240]
        raise UserFacingError(f"verifiers taskset {taskset!r} does not load: {type(e).__name__}: {detail}") from None


def task_key(data: Any) -> str:
    """A verifiers task's `task_id`: its TaskData.id, else its index in the taskset."""
    return str(data.id) if data.id is not None else str(data.idx)


def opening_messages(data: Any) -> list[dict[str, Any]]:
    """The chat the null harness opens with: the task's system prompt, then its prompt (text or messages)."""
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    prompt = data.prompt
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    elif prompt:
        messages += [m.model_dump(mode="json", exclude_none=True) if hasattr(m, "model_dump") else m for m in prompt]
    return messages


def task_rows(env: Any) -> Iterator[dict[str, Any]]:
    """One task=custom row per task of the env's taskset: task_id, prompt (chat messages) and the fields the
    taskset's TaskData adds to verifiers' own (e.g. an answer a task.rewards function may read)."""
    base = set(_verifiers().TaskData.model_fields)
    for task in env.taskset:
        data = task.data
        extra = {k: v for k, v in data.model_dump(mode="json").items() if k not in base}
        yield {TASK_ID: task_key(data), "prompt": opening_messages(data), **extra}


def trace_reward(episode: Any) -> float:
    """The reward of a SingleAgentEnv episode (its one trace's weighted rubric score); RuntimeError with verifiers'
    error text when the rollout failed."""
    errors = [*episode.errors, *(e for trace in episode.traces for e in trace.errors)]
    if errors or not episode.ok or len(episode.traces) != 1:
        text = "; ".join(f"{e.type}: {' '.join(str(e.message).split())[-400:]}" for e in errors)
        raise RuntimeError(f"the verifiers rollout failed: {text or f'{len(episode.traces)} traces, ok=False'}")
    return float(episode.traces[0].reward)


def _bypass_proxy_for_loopback() -> None:
    """The endpoint and verifiers' interception server are on loopback: never through an HTTP(S)_PROXY."""
    for name in ("NO_PROXY", "no_proxy"):
        given = [h for h in os.environ.get(name, "").split(",") if h]
        os.environ[name] = ",".join([*given, *(h for h in _LOOPBACK if h not in given)])


class VerifiersAgent:
    """The agent function of one taskset and client kind (module docstring); one per worker process."""

    def __init__(self, taskset: str, client: str) -> None:
        self.taskset = taskset
        self.client = client
        self.env = build_env(taskset)
        self._tasks: dict[str, Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Lock()
        # Touched on the loop only: the open serving scope, the episodes running in it, its lock.
        self._serving: contextlib.AsyncExitStack | None = None
        self._running = 0
        self._scope: asyncio.Lock | None = None

    def __call__(self, row: dict[str, Any], base_url: str, api_key: str, model: str, tokenizer_path: str) -> float:
        task = self._task(row)
        _bypass_proxy_for_loopback()
        os.environ[API_KEY_VAR] = api_key
        return trace_reward(self._submit(self._episode(task, self._context(base_url, model, tokenizer_path))))

    def _task(self, row: dict[str, Any]) -> Any:
        if self._tasks is None:
            self._tasks = {task_key(task.data): task for task in self.env.taskset}
        key = str(row.get(TASK_ID))
        if key not in self._tasks:
            raise ValueError(
                f"the row's {TASK_ID}={row.get(TASK_ID)!r} is no task of verifiers taskset {self.taskset!r}: write the "
                f"rows with python -m grpo_cli.endpoint.verifiers_agent {self.taskset} --out tasks.jsonl"
            )
        return self._tasks[key]

    def _context(self, base_url: str, model: str, tokenizer_path: str) -> Any:
        vf = _verifiers()
        if self.client == "train":
            if not tokenizer_path:
                raise ValueError("client=train renders the chat with the policy's tokenizer, and none was given")
            # A local directory: the renderer loads it without the hub.
            config = vf.TrainClientConfig(
                base_url=base_url, api_key_var=API_KEY_VAR, renderer_model_name=tokenizer_path
            )
        else:
            config = vf.EvalClientConfig(base_url=base_url, api_key_var=API_KEY_VAR)
        return vf.ModelContext(model=model, client=config, sampling=vf.SamplingConfig())

    def _submit(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        with self._started:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="grpo-cli-verifiers", daemon=True).start()
                self._loop = loop
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _episode(self, task: Any, ctx: Any) -> Any:
        if self._scope is None:
            self._scope = asyncio.Lock()
        async with self._scope:
            if self._serving is None:
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(self.env.serving())
                self._serving = stack
            self._running += 1
        try:
            (slot,) = self.env.slots(task, 1)
            return await self.env.run_slot(slot, ctx)
        finally:
            async with self._scope:
                self._running -= 1
                if self._running == 0 and self._serving is not None:
                    stack, self._serving = self._serving, None
                    await stack.aclose()


def verifiers_agent(taskset: str, client: str = "train") -> Callable[..., float]:
    """task.agent's factory for a verifiers taskset (module docstring): `taskset` its id, `client` train (token-in,
    the policy's own tokens) or eval (chat completions)."""
    if client not in CLIENTS:
        raise UserFacingError(f"verifiers_agent: client={client!r}: give one of {', '.join(CLIENTS)}")
    return VerifiersAgent(taskset, client)


def main(argv: list[str] | None = None) -> None:
    """`python -m grpo_cli.endpoint.verifiers_agent <taskset> --out tasks.jsonl`: the taskset's rows for task=custom."""
    parser = argparse.ArgumentParser(
        prog="python -m grpo_cli.endpoint.verifiers_agent",
        description="Write one task=custom row per task of a verifiers taskset (task.train_path for verifiers_agent).",
    )
    parser.add_argument("taskset", help="the taskset's id (an importable module exporting one Taskset class)")
    parser.add_argument("--out", required=True, type=Path, help="the JSONL file to write")
    args = parser.parse_args(argv)
    if "" not in sys.path and str(Path.cwd()) not in sys.path:  # a taskset package in this folder, as grpo-run finds it
        sys.path.insert(0, str(Path.cwd()))
    try:
        rows = list(task_rows(build_env(args.taskset)))
    except UserFacingError as e:
        parser.exit(2, f"error: {e}\n")
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} rows of verifiers taskset {args.taskset} to {args.out}")


if __name__ == "__main__":
    main()
