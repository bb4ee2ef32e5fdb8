"""Environments for multi-turn episodes: `task.environment=file.py:Class` (or `package.module:Class`, or a Hydra node
`{_target_: ..., <constructor arguments>}`), one instance per episode.

The interface (the shape of SkyRL-gym's `step`):

    class MyEnvironment:
        def __init__(self): ...                       # no arguments (a `_target_` node may give some)
        def reset(self, row) -> list[dict]:           # optional: the opening messages; default: the row's prompt
        def step(self, messages) -> (observation, reward, done)
            # messages: the conversation so far, ending with the model's turn
            # observation: messages to append ({role, content} dicts) or None; reward: float or None; done: bool
        def close(self): ...                          # optional: called when the episode ends

Where it runs (`EnvironmentRunner`). An instance keeps state from one step to the next, so each episode's instance
lives in ONE worker process of usercode/reward_workers.py for the whole episode: the runner keeps one single-worker
pool per worker (task.reward_workers of them), places episode i on pool i % n, and each call (reset, step, close)
goes to that episode's worker, where a server object holds the instances by episode id. Every call is killed at
the time limit (task.reward_timeout_s) with its worker process, so a step blocked in C, `sys.exit` or a crash is
that episode's error, never the run's; the episodes of different workers step in parallel.
A worker killed (a time-out, a crash) takes the instances of its other episodes with it: their next call rebuilds
the instance in the new worker by replaying the episode (construct, `reset(row)`, `step` on each earlier
conversation, results discarded), which gives the same state for an environment that is deterministic given its
row and the messages (seed any randomness from the row). With task.reward_workers=0 the instances live in this
process and each call runs under the in-process time limit (usercode/timelimit.py: a call blocked in C outlives it).

A failed call (raised, timed out, a malformed return) is the episode's `error` string: the episode ends and the
caller applies task.on_reward_error to it (`check_error`: stop raises EnvironmentFailed, skip leaves the episode
without any reward, out of the loss: `Episode.skipped`).

Shipped: `SkyRLGymEnvironment`, an adapter that runs a skyrl_gym `BaseTextEnv` unchanged, and the built-in
guess_number environment (tasks/guess_number.py). No torch.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from grpo_cli.errors import EnvironmentFailed
from grpo_cli.usercode.awaiting import resolved
from grpo_cli.usercode.reward_workers import PendingCall, RewardWorkers, describe_error
from grpo_cli.usercode.timelimit import RewardTimeout, call_with_time_limit
from grpo_cli.usercode.user_code import (
    TARGET_KEY,
    UserCodeError,
    is_file_reference,
    load_callable,
    load_reward_spec,
    spec_text,
)

Message = dict[str, Any]
# task.environment: a reference string ("file.py:Class", "pkg.mod:Class") or a Hydra node with _target_.
EnvironmentSpec = str | dict[str, Any]
# How long a runner waits on one worker before looking at the next (the calls themselves run meanwhile).
_POLL_S = 0.01


class Environment(Protocol):
    """What task.environment names (reset and close are optional)."""

    def step(self, messages: list[Message]) -> tuple[list[Message] | None, float | None, bool]: ...


class BadEnvironmentReturn(Exception):
    """The environment returned something that is not (observation, reward, done)."""


@dataclass(frozen=True)
class EnvStep:
    """One call's result: the messages to append (None: none), the step's reward, whether the episode is over, and
    how the call failed (None: it did not)."""

    messages: list[Message] | None
    reward: float | None
    done: bool
    error: str | None = None


@dataclass
class EnvSession:
    """One episode's environment, as the caller holds it: its row, its opening messages (or the error that kept
    reset from giving them) and the conversations it has stepped on (for a replay in a new worker)."""

    id: str
    row: dict[str, Any]
    opening: list[Message] = field(default_factory=list)
    error: str | None = None
    earlier: list[list[Message]] = field(default_factory=list)
    pool: int = 0


# ------------------------------------------------------------------------------------------------- loading


def load_environment_factory(key: str, spec: EnvironmentSpec, base_dir: Path) -> Callable[[], Any]:
    """What makes one environment instance: the class a reference names (called with no arguments), or a node's
    `_target_` with the node's arguments bound (`{_target_: envs.py:Maze, size: 5}`). `key` is the config key
    (task.environment), for the one-line errors."""
    if isinstance(spec, dict):
        if not isinstance(spec.get(TARGET_KEY), str):
            raise UserCodeError(
                f"{key}={spec_text(spec)}: an environment given as a node names its class in _target_: "
                "{_target_: path/to/file.py:Class, <constructor arguments>}"
            )
        made = load_reward_spec(key, {**spec, "_partial_": True}, base_dir)
        target = getattr(made, "func", made)  # the class itself, its arguments bound by functools.partial
        if isinstance(target, type) and not callable(getattr(target, "step", None)):
            raise UserCodeError(f"{key}={spec_text(spec)}: {target.__name__} has no step(messages) method: add one")
        return made
    reference = str(spec)
    target, sep, name = reference.rpartition(":")
    if not sep and not is_file_reference(reference) and "." in reference:  # pkg.mod.Class reads as pkg.mod:Class
        module, _, name = reference.rpartition(".")
        reference = f"{module}:{name}"
    factory = load_callable(key, reference, base_dir, what="class")
    if not isinstance(factory, type):
        raise UserCodeError(
            f"{key}={spec}: {getattr(factory, '__name__', name)} is not a class: name a class with step(messages) "
            "(and optionally reset(row)), or give constructor arguments with {_target_: ..., <arguments>}"
        )
    if not callable(getattr(factory, "step", None)):
        raise UserCodeError(f"{key}={spec}: {factory.__name__} has no step(messages) method: add one")
    return factory


def default_opening(row: Mapping[str, Any]) -> list[Message]:
    """The row's prompt as messages: a conversational `prompt` as it is, a text one as one user message."""
    prompt = row.get("prompt")
    if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        return [dict(m) for m in prompt]
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    raise BadEnvironmentReturn(
        "has no reset(row) and the row has no prompt (a string or a list of {role, content} messages) to open with"
    )


def _messages(what: str, value: Any) -> list[Message] | None:
    if value is None:
        return None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list | tuple) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        raise BadEnvironmentReturn(
            f"{what} must be a list of {{'role': str, 'content': str}} messages or None, not {value!r:.120}"
        )
    return [dict(m) for m in value]


def _python_scalar(value: Any) -> Any:
    """A numpy or torch scalar (np.float32, np.bool_, a 0-d tensor) as the Python number or bool it holds; anything
    else as it is (an array of several values keeps its type, and the check names it)."""
    if isinstance(value, str | bytes | bool | int | float) or not callable(getattr(value, "item", None)):
        return value
    try:
        return value.item()
    except (TypeError, ValueError):
        return value


def check_step(value: Any) -> tuple[list[Message] | None, float | None, bool]:
    """A step's return checked: (messages or None, a finite float or None, a bool), or BadEnvironmentReturn. numpy
    scalars count as the Python numbers and bools they hold (an np.float32 reward, an np.bool_ done)."""
    if not isinstance(value, tuple | list) or len(value) != 3:
        raise BadEnvironmentReturn(f"step must return (observation, reward, done), not {value!r:.120}")
    observation, reward, done = value
    reward, done = _python_scalar(reward), _python_scalar(done)
    messages = _messages("step's observation", observation)
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            raise BadEnvironmentReturn(f"step's reward must be a finite number or None, not {reward!r:.60}")
        reward = float(reward)
    if not isinstance(done, bool):
        raise BadEnvironmentReturn(f"step's done must be True or False, not {done!r:.60}")
    return messages, reward, done


# ------------------------------------------------------------------------------------ where the instances live


class EnvironmentServer:
    """Holds one process's environment instances by episode id and runs their calls (in a worker process, or in
    the caller's with task.reward_workers=0)."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self.factory = factory
        self.instances: dict[str, Any] = {}

    def __call__(
        self, op: str, session: str, row: dict[str, Any], earlier: list[list[Message]], messages: list[Message]
    ) -> Any:
        if op == "close":
            instance = self.instances.pop(session, None)
            if instance is not None and callable(getattr(instance, "close", None)):
                return resolved(instance.close())  # what it returns comes back (TRLEnvironment's rewards)
            return None
        if op == "reset":
            self.instances.pop(session, None)
            return self._reset(session, row)
        instance = self.instances.get(session)
        if instance is None:  # this worker replaced one that was killed: rebuild the instance by replaying
            self._reset(session, row)
            instance = self.instances[session]
            for conversation in earlier:
                resolved(instance.step([dict(m) for m in conversation]))
        # An async method's coroutine is awaited here, in the call's worker, within its time limit.
        return check_step(resolved(instance.step([dict(m) for m in messages])))

    def _reset(self, session: str, row: dict[str, Any]) -> list[Message]:
        instance = self.factory()
        self.instances[session] = instance
        reset = getattr(instance, "reset", None)
        opening = resolved(reset(dict(row))) if callable(reset) else default_opening(row)
        checked = _messages("reset's opening messages", opening)
        if not checked:
            raise BadEnvironmentReturn("reset must return the opening messages (a non-empty list of {role, content})")
        return checked


def _environment_server(key: str, spec: EnvironmentSpec, base_dir: str) -> EnvironmentServer:
    """A worker's loader (picklable through functools.partial): the server of this environment's instances."""
    return EnvironmentServer(load_environment_factory(key, spec, Path(base_dir)))


class EnvironmentRunner:
    """Runs one environment's instances, one per episode, in `n_workers` worker processes (0: in this process),
    each call killed at `time_limit_s` (None: no limit)."""

    def __init__(
        self, key: str, spec: EnvironmentSpec, base_dir: Path, n_workers: int, time_limit_s: float | None
    ) -> None:
        self.key = key
        self.time_limit_s = time_limit_s or None
        # Loaded here first: a bad spec is one line now, not an error inside every worker.
        factory = load_environment_factory(key, spec, base_dir)
        self._loader = functools.partial(_environment_server, key, spec, str(base_dir))
        self._pools = [RewardWorkers(1, self.time_limit_s) for _ in range(n_workers)]
        self._local = EnvironmentServer(factory) if n_workers == 0 else None
        self._ids = (f"{os.getpid()}-{id(self)}-{i}" for i in itertools.count())
        self._next_pool = 0

    def reset(self, rows: Sequence[Mapping[str, Any]]) -> list[EnvSession]:
        """A new instance per row, its reset run: the sessions, each with its opening messages or its error."""
        sessions = []
        for row in rows:
            sessions.append(EnvSession(next(self._ids), dict(row), pool=self._next_pool))
            self._next_pool = (self._next_pool + 1) % max(1, len(self._pools))
        results = self._run([(s, "reset", []) for s in sessions])
        for session, (value, error) in zip(sessions, results, strict=True):
            session.opening, session.error = (value or []), error
        return sessions

    def step(self, sessions: Sequence[EnvSession], conversations: Sequence[Sequence[Message]]) -> list[EnvStep]:
        """Each session's step on its conversation (ending with the model's turn), in parallel across workers."""
        calls = [(s, "step", [dict(m) for m in c]) for s, c in zip(sessions, conversations, strict=True)]
        steps = []
        for (session, _, conversation), (value, error) in zip(calls, self._run(calls), strict=True):
            if error is not None:
                steps.append(EnvStep(None, None, True, error))
                continue
            session.earlier.append(conversation)
            steps.append(EnvStep(*value))
        return steps

    def close(self, sessions: Sequence[EnvSession]) -> list[Any]:
        """The episodes are over: their instances' close() run and the instances dropped. Returns what each close()
        returned (None where it failed: its errors are ignored)."""
        return [value for value, _ in self._run([(s, "close", []) for s in sessions])]

    def shutdown(self) -> None:
        """Stop the worker processes (a later call starts new ones)."""
        for pool in self._pools:
            pool.close()

    # --- the machinery ------------------------------------------------------------------------------------
    def _run(self, calls: Sequence[tuple[EnvSession, str, list[Message]]]) -> list[tuple[Any, str | None]]:
        """Each call's (value, None) or (None, how it failed): one call in flight per worker, every worker busy."""
        results: list[tuple[Any, str | None]] = [(None, None)] * len(calls)
        if self._local is not None:
            for index, (session, op, messages) in enumerate(calls):
                try:
                    value = call_with_time_limit(
                        self.time_limit_s, self._local, op, session.id, session.row, session.earlier, messages
                    )
                    results[index] = (value, None)
                except RewardTimeout:
                    results[index] = (None, f"took longer than {self.time_limit_s:g}s")
                except Exception as e:  # noqa: BLE001 - the user's environment: its error is the episode's
                    results[index] = (None, describe_error(e))
            return results
        queues: list[list[int]] = [[] for _ in self._pools]
        for index, (session, _, _) in enumerate(calls):
            queues[session.pool].append(index)
        in_flight: dict[int, tuple[int, PendingCall]] = {}
        while any(queues) or in_flight:
            for pool_index, pool in enumerate(self._pools):
                if pool_index not in in_flight and queues[pool_index]:
                    index = queues[pool_index].pop(0)
                    session, op, messages = calls[index]
                    args = (op, session.id, session.row, session.earlier, messages)
                    pending = pool.submit(self._loader, args, {}, label=f"{self.key}'s {op}")
                    in_flight[pool_index] = (index, pending)
                if pool_index in in_flight:
                    pool.poll(_POLL_S)
                    index, pending = in_flight[pool_index]
                    if pending.done:
                        del in_flight[pool_index]
                        try:
                            results[index] = (pending.result(), None)
                        except RewardTimeout as e:  # "took longer than 1s: its worker process was killed"
                            results[index] = (None, str(e))
                        except Exception as e:  # noqa: BLE001 - RewardCallFailed and the like: the episode's
                            results[index] = (None, describe_error(e))
        return results


def clipped(text: str, limit: int) -> str:
    """`text`, or when longer than `limit` its start cut at the last space before the limit (mid-word only when the
    first word alone is longer than half of it), with "..." after it."""
    if len(text) <= limit:
        return text
    cut = text[:limit]
    space = cut.rfind(" ")
    return (cut[:space] if space >= limit // 2 else cut).rstrip(" ,") + "..."


def check_error(
    key: str, on_error: str, error: str | None, row: Mapping[str, Any], what: str = "the environment"
) -> None:
    """task.on_reward_error for an environment's (or `what`'s) failure on an episode: stop raises EnvironmentFailed
    (one line naming the key, the failure and the row), skip returns (the episode is skipped: no reward, out of the
    loss)."""
    if error is None or on_error == "skip":
        return
    shown = ", ".join(f"{k}={clipped(repr(v), 40)}" for k, v in list(row.items())[:4])
    raise EnvironmentFailed(
        f"{key}: {what} {error} on the row ({shown}): fix it, or set task.on_reward_error=skip to skip "
        "such episodes (no reward, out of the loss)"
    )


# ------------------------------------------------------------------------------------------- SkyRL-gym adapter
# What SkyRL's generator passes an environment, matched here: SkyRLGymGenerator.agent_loop in
# skyrl/train/generators/skyrl_gym_generator.py, lines 335-339, of github.com/NovaSky-AI/SkyRL at commit
# b8a5caaab81d75190b55d22c8774f5cc9d5f1f54 (the one that released skyrl-gym 0.4.0), with the row split by
# skyrl/train/dataset/dataset.py's __getitem__ (lines 86-94):
#     env_extras = {every column of the row but the prompt and env_class}
#     env_extras["max_turns"] = generator.max_turns
#     env_config = getattr(cfg.environment.skyrl_gym, env_class, dict())
#     env = skyrl_gym.make(env_class, env_config=env_config, extras=env_extras)
#     chat_history, _ = env.init(prompt); ... env.step(output_text) per turn ...; env.close()
# where env_class is the row's `env_class` column, else environment.env_class. env_config is read by attribute
# (text2sql: `env_config.db_path`): SkyRL's Hydra config gave a DictConfig node, its dataclass config now gives
# Text2SQLEnvConfig, skyrl-gym's own tests pass DictConfig(...); a DictConfig reads both ways, so it is passed here.

SKYRL_ADAPTER = "grpo_cli.episodes.environments.SkyRLGymEnvironment"
# The dataset columns SkyRL's dataset takes out of the row before the rest become env_extras (its prompt_key and
# env_class_key defaults).
SKYRL_PROMPT_KEY = "prompt"
SKYRL_ENV_CLASS_KEY = "env_class"


def skyrl_extras(row: Mapping[str, Any], max_turns: int | None) -> dict[str, Any]:
    """SkyRL's env_extras for a row: its columns but the prompt and env_class, and `max_turns` (SkyRL's
    generator.max_turns, here task.max_turns) overriding any column of that name, as SkyRL's generator does."""
    extras = {k: v for k, v in row.items() if k not in (SKYRL_PROMPT_KEY, SKYRL_ENV_CLASS_KEY)}
    if max_turns is not None:
        extras["max_turns"] = max_turns
    return extras


def with_run_limits(key: str, spec: EnvironmentSpec, base_dir: Path, max_turns: int) -> EnvironmentSpec:
    """task.environment with the run's limits given to an environment node whose class declares it takes them: a
    constructor parameter named `max_turns` (the SkyRL adapter's: SkyRL's generator writes generator.max_turns
    into every environment's extras) gets task.max_turns unless the node sets it. Any other spec as it is."""
    if not isinstance(spec, dict) or "max_turns" in spec:
        return spec
    made = load_environment_factory(key, spec, base_dir)
    target = getattr(made, "func", made)
    try:
        takes = "max_turns" in inspect.signature(target).parameters
    except (TypeError, ValueError):
        return spec
    return {**spec, "max_turns": max_turns} if takes else spec


class SkyRLGymEnvironment:
    """Runs a skyrl_gym `BaseTextEnv` unchanged: task.environment={_target_:
    grpo_cli.episodes.environments.SkyRLGymEnvironment, env: gsm8k_multi_turn, env_config: {...}}.

    `env` is a registered skyrl_gym id (`gsm8k_multi_turn`, SkyRL's environment.env_class) or the class itself
    (`package.module:Class`, `file.py:Class`); a row's `env_class` column, where it has one, names the id instead,
    as in SkyRL. Each episode constructs it as SkyRL's generator does (the comment above):
    `skyrl_gym.make(env_class, env_config=DictConfig(env_config), extras=...)`, the extras being the row's columns
    but `prompt` and `env_class`, with `max_turns` (task.max_turns, set by the run). It opens with
    `init(prompt)`'s messages and steps with the model's last turn as the action; `observations` (an empty list:
    none), `reward` and `done` are passed on, `metadata` dropped. `env_config` is SkyRL's
    environment.skyrl_gym.<env_class> node, given to the adapter's `env` (a row naming another class gets an
    empty one)."""

    def __init__(
        self,
        env: str,
        env_config: Mapping[str, Any] | None = None,
        base_dir: str | None = None,
        max_turns: int | None = None,
    ) -> None:
        self.env = env
        self.env_config = dict(env_config or {})
        self.base_dir = Path(base_dir) if base_dir else Path.cwd()
        self.max_turns = max_turns
        self._instance: Any = None

    def _make(self, row: dict[str, Any]) -> Any:
        from omegaconf import OmegaConf  # SkyRL hands environments a DictConfig: `env_config.db_path` reads it

        env_class = str(row.get(SKYRL_ENV_CLASS_KEY) or self.env)
        env_config = OmegaConf.create(self.env_config if env_class == self.env else {})
        extras = skyrl_extras(row, self.max_turns)
        if ":" in env_class:
            cls = load_callable("task.environment.env", env_class, self.base_dir, what="class")
            return cls(env_config=env_config, extras=extras)
        import skyrl_gym  # only this adapter needs it

        return skyrl_gym.make(env_class, env_config=env_config, extras=extras)

    def reset(self, row: dict[str, Any]) -> list[Message]:
        self._instance = self._make(row)
        opening, _metadata = self._instance.init(default_opening(row))
        return list(opening)

    def step(self, messages: list[Message]) -> tuple[list[Message] | None, float | None, bool]:
        out = self._instance.step(str(messages[-1]["content"]))
        observations = out.get("observations") or None
        reward = out.get("reward")
        return observations, (None if reward is None else float(reward)), bool(out.get("done"))

    def close(self) -> None:
        if self._instance is not None:
            self._instance.close()
