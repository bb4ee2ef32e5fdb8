"""TRL 1.16's environment convention, `task.environment_factory=file.py:Class` (GRPOTrainer's `environment_factory`),
run on the worker machinery of `task.environment` (episodes/environments.py) through one adapter, `TRLEnvironment`.

What TRL's class is (GRPOTrainer, TRL 1.16):

    class Game2048Env:
        def reset(self, **row) -> str | None      # required: the row's columns as keywords; a string is appended to
                                                  # the prompt's last message, None leaves the prompt as it is
        def get_reward(self) -> float             # optional, sync or async: the environment's own reward (weight 1)
        def move(self, direction: str) -> str     # every other public function of the class is a tool the model
            '''...Args: direction: ...'''         # calls, its schema from its docstring (get_json_schema)

and what TRL does with it, reproduced here:
- one instance per rollout, drawn from a pool of instances (per environment, per process) that are reset and reused
  across batches; a new one is constructed only when a batch needs more at once than the pool holds;
- `reset(**row)` gets every column of the row (the `environment` column left out when a dict of factories is
  given); its string is appended to the prompt's last message as TRL appends it (`content + observation`, no
  separator); a row without a prompt opens with an empty user message, as in TRL;
- the public methods (`inspect.getmembers(type(env), inspect.isfunction)`, not `reset`, `get_reward` or a
  `_name`) are the tools, called by the name of the method; each result is the `tool` message
  `{"role": "tool", "name": name, "content": str(result)}`; a method that raises gives TRL's `{'error': '...'}`;
  async methods are awaited (usercode/awaiting.py);
- a turn without a call ends the episode; the calls of the turn that reaches task.max_turns are not run (TRL's
  `max_tool_calling_iterations` stops before them), and that turn ends the episode too;
- `get_reward()` is called once, when the episode's instance is released, and is the episode's `env` component
  (weight task.reward_weights.env, 1 by default, as TRL's weight 1);
- reward functions that take `environments=` (task.rewards) are called in the worker process holding the instance,
  before it goes back to the pool, on a batch of one: `fn(prompts=[...], completions=[...], environments=[env],
  <columns>)`; their values come back with the episode (`EnvironmentResult`);
- a dict of factories (`task.environment_factory={coding: envs.py:CodingEnv, game: envs.py:GameEnv}`) picks each
  row's by its `environment` column.

Differences, said once: the prompt shows the union of the environments' tools (TRL shows each example only its own
environment's); a call of a tool that is not the episode's environment's reads as an unknown tool; rewards taking
`environments=` see a batch of one (the others' instances live in other processes) and no completion_ids. No torch.
"""

from __future__ import annotations

import functools
import inspect
import json
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_cli.episodes.environments import BadEnvironmentReturn, default_opening
from grpo_cli.episodes.tool_calls import DEFAULT_FORMAT, TOOL_CALL_FORMATS, ToolCall, parse_tool_calls
from grpo_cli.episodes.tools import Tool, tool_schema
from grpo_cli.tasks.multiturn import ENVIRONMENT_FACTORY_KEY, SINGLE, FactorySpecs, factory_specs
from grpo_cli.usercode.awaiting import resolved
from grpo_cli.usercode.reward_workers import describe_error
from grpo_cli.usercode.user_code import (
    TARGET_KEY,
    RewardSpec,
    UserCodeError,
    accepted_keywords,
    is_file_reference,
    load_callable,
    load_reward_spec,
    spec_text,
)

# The column a dict of factories routes by (TRL's), not passed to reset.
ENVIRONMENT_COLUMN = "environment"
# TRL's reserved methods: never tools.
RESERVED = ("reset", "get_reward")
# The argument a reward function reads the episodes' instances from (TRL's reward_kwargs["environments"]).
ENVIRONMENTS_ARGUMENT = "environments"


# ------------------------------------------------------------------------------------------------- loading


def key_of(name: str) -> str:
    return ENVIRONMENT_FACTORY_KEY if name == SINGLE else f"{ENVIRONMENT_FACTORY_KEY}.{name}"


def load_factory(name: str, spec: RewardSpec, base_dir: Path) -> Callable[[], Any]:
    """What makes one instance: the class a reference names, or a node's `_target_` with its arguments bound."""
    key = key_of(name)
    if isinstance(spec, dict):
        if not isinstance(spec.get(TARGET_KEY), str):
            raise UserCodeError(f"{key}={spec_text(spec)}: a node names its class in _target_")
        return load_reward_spec(key, {**spec, "_partial_": True}, base_dir)
    reference = str(spec)
    if ":" not in reference and not is_file_reference(reference) and "." in reference:
        module, _, attribute = reference.rpartition(".")
        reference = f"{module}:{attribute}"
    return load_callable(key, reference, base_dir, what="class")


def environment_class(name: str, spec: RewardSpec, factory: Callable[[], Any]) -> type:
    """The class whose methods are the tools: the factory itself, a node's class, or (a factory function, as TRL
    allows) the type of one instance it makes, as TRL probes one."""
    target = getattr(factory, "func", factory)
    cls = target if isinstance(target, type) else type(factory())
    if not callable(getattr(cls, "reset", None)):
        raise UserCodeError(
            f"{key_of(name)}={spec_text(spec)}: {cls.__name__} has no reset method: TRL's environment class defines "
            "reset(self, **kwargs), returning the prompt's addition (a string) or None"
        )
    return cls


def tool_methods(cls: type) -> dict[str, Callable[..., Any]]:
    """The class's tools as TRL finds them: its functions (inherited ones too) but reset, get_reward and `_` names,
    by name, in getmembers' (alphabetical) order."""
    return {
        name: fn
        for name, fn in inspect.getmembers(cls, predicate=inspect.isfunction)
        if name not in RESERVED and not name.startswith("_")
    }


class _Unbound:
    """Stands for the instance when a method's schema is read (get_json_schema sees the method without `self`)."""


def method_schemas(name: str, spec: RewardSpec, cls: type) -> dict[str, dict[str, Any]]:
    """Each tool method's JSON schema (tools.tool_schema: one line naming the key when a docstring or a type hint is
    missing), by its name."""
    schemas = {}
    for method, fn in tool_methods(cls).items():
        static = isinstance(inspect.getattr_static(cls, method), staticmethod)
        shown = fn if static else types.MethodType(fn, _Unbound())
        schemas[method] = tool_schema(f"{key_of(name)} method {method}", spec, shown, method)
    return schemas


@dataclass(frozen=True)
class LoadedEnvironments:
    """task.environment_factory loaded in this process: each environment's class and tool schemas, by name."""

    specs: FactorySpecs
    classes: dict[str, type]
    schemas: dict[str, dict[str, dict[str, Any]]]

    @property
    def tools(self) -> dict[str, Tool]:
        """Every environment's methods as tools.Tool, for tools.tool_prompt (the union, one schema per name)."""
        out: dict[str, Tool] = {}
        for name, by_method in self.schemas.items():
            for method, schema in by_method.items():
                fn = getattr(self.classes[name], method)
                out.setdefault(
                    method, Tool(method, self.specs[name], schema, functools.partial(_no_loader, method), fn)
                )
        return out


def _no_loader(method: str) -> Callable[..., Any]:
    raise RuntimeError(f"{method} is an environment's method: it runs on the episode's instance, not as a tool")


def load_environments(value: Any, base_dir: Path) -> LoadedEnvironments:
    """task.environment_factory imported and checked (one line naming the key for each problem)."""
    specs = factory_specs(value)
    classes, schemas = {}, {}
    for name, spec in specs.items():
        factory = load_factory(name, spec, base_dir)
        classes[name] = environment_class(name, spec, factory)
        schemas[name] = method_schemas(name, spec, classes[name])
    return LoadedEnvironments(specs, classes, schemas)


def takes_environments(fn: Callable[..., Any]) -> bool:
    """Whether a reward function names `environments=` (TRL passes it to every function; only those that name it
    need the instances, so only those run where the instances live)."""
    try:
        return ENVIRONMENTS_ARGUMENT in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def adapter_node(
    value: Any, base_dir: Path, tool_call_format: str | None, max_turns: int, rewards: Mapping[str, RewardSpec]
) -> dict[str, Any]:
    """task.environment's form of task.environment_factory: the node that builds a TRLEnvironment per episode
    (the specs travel as JSON text, so that Hydra does not instantiate a nested `_target_`)."""
    return {
        TARGET_KEY: f"{__name__}.TRLEnvironment",
        "factories": json.dumps(factory_specs(value)),
        "tool_call_format": tool_call_format or DEFAULT_FORMAT,
        "max_turns": int(max_turns),
        "rewards": json.dumps(dict(rewards)),
        "base_dir": str(base_dir),
    }


# ------------------------------------------------------------------------------------------------ the adapter


@dataclass(frozen=True)
class EnvironmentResult:
    """What an episode's instance gave when it was released (TRLEnvironment.close): get_reward's value (None: the
    class has none), each `environments=` reward's value, and how each failed."""

    reward: float | None
    rewards: dict[str, Any]
    errors: dict[str, str]


# Per process: the instances not in use, by environment name (TRL's `_environment_pool`), and the loaded factories.
_POOLS: dict[tuple[str, str], list[Any]] = {}


@functools.cache
def _loaded(factories: str, base_dir: str) -> dict[str, tuple[Callable[[], Any], dict[str, dict[str, Any]]]]:
    out = {}
    for name, spec in json.loads(factories).items():
        factory = load_factory(name, spec, Path(base_dir))
        out[name] = (factory, method_schemas(name, spec, environment_class(name, spec, factory)))
    return out


class TRLEnvironment:
    """A TRL environment class as task.environment's protocol (episodes/environments.py): reset(row) -> the opening
    messages, step(messages) -> (the tool messages, None, done), close() -> EnvironmentResult. Built by
    episode_setup from task.environment_factory (`adapter_node`); module docstring for what it reproduces."""

    def __init__(
        self,
        factories: str,
        tool_call_format: str = DEFAULT_FORMAT,
        max_turns: int | None = None,
        rewards: str = "{}",
        base_dir: str | None = None,
    ) -> None:
        self.factories = factories
        self.base_dir = base_dir or str(Path.cwd())
        self.fmt = TOOL_CALL_FORMATS[tool_call_format]
        self.max_turns = max_turns
        self.reward_specs: dict[str, RewardSpec] = json.loads(rewards)
        self.multi = SINGLE not in json.loads(factories)
        self.instance: Any = None
        self.name = SINGLE
        self.row: dict[str, Any] = {}
        self.opening: list[dict[str, Any]] = []
        self.last: list[dict[str, Any]] = []

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        loaded = _loaded(self.factories, self.base_dir)
        self.name = str(row.get(ENVIRONMENT_COLUMN)) if self.multi else SINGLE
        if self.name not in loaded:
            raise BadEnvironmentReturn(
                f"got a row with environment={row.get(ENVIRONMENT_COLUMN)!r}, which is not among the environments "
                f"of {ENVIRONMENT_FACTORY_KEY}: {', '.join(loaded)}"
            )
        pool = _POOLS.setdefault((self.factories, self.name), [])
        self.instance = pool.pop() if pool else loaded[self.name][0]()
        self.row = dict(row)
        kwargs = {k: v for k, v in row.items() if k != ENVIRONMENT_COLUMN} if self.multi else dict(row)
        observation = resolved(self.instance.reset(**kwargs))
        prompt = row.get("prompt")
        opening = default_opening(row) if prompt is not None else [{"role": "user", "content": ""}]
        if observation is not None:
            if not isinstance(observation, str):
                raise BadEnvironmentReturn(f"reset must return a string or None, not {observation!r:.80}")
            opening[-1] = {**opening[-1], "content": str(opening[-1]["content"]) + observation}
        self.opening = [dict(m) for m in opening]
        self.last = list(self.opening)
        return opening

    def step(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]] | None, None, bool]:
        self.last = [dict(m) for m in messages]
        schemas = _loaded(self.factories, self.base_dir)[self.name][1]
        calls = parse_tool_calls(str(messages[-1].get("content", "")), self.fmt, schemas)
        turns = sum(m.get("role") == "assistant" for m in messages)
        if not calls or (self.max_turns is not None and turns >= self.max_turns):
            return None, None, True
        results = []
        for call in calls:
            if not isinstance(call, ToolCall):
                results.append({"role": "tool", "name": call.name or "unknown", "content": call.message})
                continue
            try:
                value = resolved(getattr(self.instance, call.name)(**call.arguments))
            except Exception as e:  # noqa: BLE001 - TRL gives the model the error as the result: {"error": str(e)}
                value = {"error": str(e)}
            results.append({"role": "tool", "name": call.name, "content": str(value)})
        return results, None, False

    def close(self) -> EnvironmentResult | None:
        """The episode is over: get_reward and the `environments=` rewards, then the instance back to its pool."""
        if self.instance is None:
            return None
        reward, values, errors = None, {}, {}
        try:
            get_reward = getattr(self.instance, "get_reward", None)
            if callable(get_reward):
                try:
                    reward = resolved(get_reward())
                except Exception as e:  # noqa: BLE001 - the user's code: the episode's error, not the worker's
                    errors["get_reward"] = describe_error(e)
            for name, spec in self.reward_specs.items():
                try:
                    values[name] = self._reward(name, spec)
                except Exception as e:  # noqa: BLE001 - reported as the reward's failure (task.on_reward_error)
                    errors[name] = describe_error(e)
        finally:
            _POOLS.setdefault((self.factories, self.name), []).append(self.instance)
            self.instance = None
        return EnvironmentResult(reward, values, errors)

    def _reward(self, name: str, spec: RewardSpec) -> Any:
        """One `environments=` reward on this episode, a batch of one, with TRL's arguments and the row's columns."""
        fn = load_reward_spec(f"task.rewards.{name}", spec, Path(self.base_dir))
        columns = {k: [v] for k, v in self.row.items() if k not in ("prompt", "completion", "completion_ids")}
        kwargs: dict[str, Any] = {
            **columns,
            "prompts": [self.opening],
            "completions": [self.last[len(self.opening) :]],
            "completion_ids": None,
            "trainer_state": None,
            "log_extra": lambda *_: None,
            "log_metric": lambda *_: None,
            ENVIRONMENTS_ARGUMENT: [self.instance],
        }
        out = resolved(fn(**accepted_keywords(fn, kwargs)))
        if hasattr(out, "tolist") and not isinstance(out, list):
            out = out.tolist()
        return out[0] if isinstance(out, list | tuple) and len(out) == 1 else out
