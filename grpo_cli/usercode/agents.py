"""task.agent: the user's agent code, run as it is, talking to the policy through an OpenAI client.

    # my_agent.py                     grpo-run task=custom task.agent=my_agent.py:solve ...
    from openai import OpenAI

    def solve(row, base_url, api_key):
        client = OpenAI(base_url=base_url, api_key=api_key)
        messages = list(row["prompt"])
        for _ in range(3):
            reply = client.chat.completions.create(model="policy", messages=messages)
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
            if "ANSWER" in (reply.choices[0].message.content or ""):
                break
            messages.append({"role": "user", "content": "Go on."})
        return None                   # or a number: the episode's reward from the agent (the `env` component)

The function is called once per episode with the keyword arguments it names (all of them when it takes
**kwargs): `row` (the example's columns and its prompt), `prompt` (the prompt as chat messages), `base_url` (the
episode's own URL on the endpoint), `api_key` (the run's token), `model` (the policy's name; any name is served),
`tokenizer_path` (a directory holding the policy's tokenizer, for agents that render token ids themselves, as
verifiers' trainer client does), `client` (an `openai.OpenAI` already pointed there) and `async_client` (an
`openai.AsyncOpenAI`). It may be
`async def`. What it returns is the agent's reward (a number, or None for none); task.rewards judge the episode as
well, as they judge any episode (docs/multi-turn.md).

Where it runs: in the task.reward_workers worker processes (0: threads of the rollout process), every episode of a
worker's share in its own thread, all at once, so their model calls reach the endpoint together and are sampled
in batches. Each episode is limited to task.agent_timeout_s from its own start, all of a worker's at once; an agent
that raises, times out or returns something else is that episode's error (task.on_reward_error: stop the run in one
line, or skip the episode). An agent is trusted code: a worker's agents are threads of one process, which share its
memory and cannot be stopped one by one (a worker with one still running is replaced; with task.reward_workers=0
they are threads of the rollout process, left running). No torch here.
"""

from __future__ import annotations

import inspect
import json
import math
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_cli.usercode.awaiting import resolved
from grpo_cli.usercode.reward_workers import describe_error
from grpo_cli.usercode.user_code import RewardSpec, UserCodeError, accepted_keywords, load_reward_spec, spec_text

AGENT_KEY = "task.agent"
# The keyword arguments an agent function may name (module docstring).
AGENT_ARGUMENTS = ("row", "prompt", "base_url", "api_key", "model", "tokenizer_path", "client", "async_client")


@dataclass(frozen=True)
class AgentJob:
    """One episode for an agent: its row and opening messages, its URL and the run's token, where to report."""

    row: dict[str, Any]
    prompt: list[dict[str, Any]]
    base_url: str
    api_key: str
    model: str
    end_url: str
    tokenizer_path: str = ""


def load_agent(spec: RewardSpec, base_dir: Path) -> Callable[..., Any]:
    """The agent function task.agent gives (a `file.py:fn` / `package.module:fn` reference, or a node whose
    `_target_` factory returns it, as task.rewards' nodes: user_code.load_reward_spec), its signature checked (one
    line when it names no argument it gets)."""
    fn = load_reward_spec(AGENT_KEY, spec, base_dir)
    reference = spec_text(spec)
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return fn
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    names = {p.name for p in parameters}
    required = [
        p.name
        for p in parameters
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
        and p.name not in AGENT_ARGUMENTS
    ]
    if required:
        raise UserCodeError(
            f"{AGENT_KEY}={reference}: its argument {required[0]!r} is not one an agent is given "
            f"({', '.join(AGENT_ARGUMENTS)}): rename it or give it a default"
        )
    if not takes_any and not names & {"base_url", "client", "async_client"}:
        raise UserCodeError(
            f"{AGENT_KEY}={reference}: it takes none of base_url, client, async_client, so it cannot reach the "
            "model: add base_url and api_key (or client) to its arguments"
        )
    return fn


def agent_kwargs(fn: Callable[..., Any], job: AgentJob) -> dict[str, Any]:
    """The keyword arguments `fn` takes of the ones an agent is given (clients made only when named)."""
    wanted = set(accepted_keywords(fn, dict.fromkeys(AGENT_ARGUMENTS)))
    given: dict[str, Any] = {
        "row": dict(job.row),
        "prompt": [dict(m) for m in job.prompt],
        "base_url": job.base_url,
        "api_key": job.api_key,
        "model": job.model,
        "tokenizer_path": job.tokenizer_path,
    }
    if "client" in wanted or "async_client" in wanted:
        import openai

        if "client" in wanted:
            given["client"] = openai.OpenAI(base_url=job.base_url, api_key=job.api_key, max_retries=0)
        if "async_client" in wanted:
            given["async_client"] = openai.AsyncOpenAI(base_url=job.base_url, api_key=job.api_key, max_retries=0)
    return {k: v for k, v in given.items() if k in wanted}


def agent_reward(value: Any) -> float | None:
    """What an agent returned as its reward: None, or a finite number (a bool counts as 0/1); ValueError else."""
    if value is None:
        return None
    if isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
        return float(value)
    number = getattr(value, "item", None)  # a numpy or torch scalar
    if callable(number):
        try:
            return agent_reward(number())
        except (TypeError, ValueError):
            pass
    raise ValueError(
        f"returned {type(value).__name__} {str(value)[:80]!r}: return a finite number (its reward) or None"
    )


def _report(job: AgentJob, reward: float | None, error: str | None) -> None:
    body = json.dumps({"reward": reward, "error": error}).encode()
    request = urllib.request.Request(
        job.end_url,
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {job.api_key}"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - our loopback endpoint
        response.read()


def _run_one(fn: Callable[..., Any], job: AgentJob) -> None:
    try:
        reward, error = agent_reward(resolved(fn(**agent_kwargs(fn, job)))), None
    except Exception as e:  # noqa: BLE001 - the user's agent: its error is the episode's
        reward, error = None, describe_error(e)
    try:
        _report(job, reward, error)
    except OSError:  # the endpoint dropped the episode (its time limit): the runner has recorded its end
        pass


def run_agents(fn: Callable[..., Any], jobs: Sequence[AgentJob], timeout_s: float | None) -> dict[str, int]:
    """Every job's agent in its own thread, all at once, each reporting its end to the endpoint; an agent still
    running `timeout_s` after its own start is reported as timed out and left behind, so the share takes
    `timeout_s` at most, however many agents are stuck. Returns {"left_running": n}: the caller replaces a worker
    that has some."""
    threads = []
    for job in jobs:
        thread = threading.Thread(target=_run_one, args=(fn, job), name="grpo-cli-agent", daemon=True)
        thread.start()
        threads.append((job, thread, time.monotonic()))
    left = 0
    for job, thread, started in threads:
        # Each agent's limit runs from its own start, all at once: joining with timeout_s each would add them up.
        thread.join(None if timeout_s is None else max(0.0, started + timeout_s - time.monotonic()))
        if thread.is_alive():
            left += 1
            try:
                _report(job, None, f"took longer than {timeout_s:g}s (task.agent_timeout_s)")
            except OSError:
                pass
    return {"left_running": left}


class AgentShare:
    """A worker's loader result (picklable through functools.partial): runs a share of episodes' agents."""

    def __init__(self, spec: RewardSpec, base_dir: str, timeout_s: float | None) -> None:
        self.fn = load_agent(spec, Path(base_dir))
        self.timeout_s = timeout_s

    def __call__(self, jobs: Sequence[Mapping[str, Any]]) -> dict[str, int]:
        return run_agents(self.fn, [AgentJob(**job) for job in jobs], self.timeout_s)
