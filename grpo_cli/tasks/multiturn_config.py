"""The multi-turn keys every task has (task.tools, task.tool_call_format, task.tool_timeout_s, task.environment,
task.environment_factory, task.agent, task.agent_timeout_s, task.max_turns, task.max_episode_tokens,
task.reward_weights.env, task.sandbox), read and checked here. No torch.

A task runs episodes (grpo_cli/rollout/multiturn.py builds them) when it names tools or an environment, or an agent
drives them (grpo_cli/rollout/agent_run.py); otherwise
it is single-turn and none of these keys is read. `validate_multiturn` runs at preflight, before any model loads:
every tool and the environment are imported and checked there (a spec that does not load, a tool without a
docstring, an environment class without step()), each a one-line UserFacingError naming the key; a tool or
environment marked `sandbox.uses_sandbox` (the `python` tool) also has the sandbox of task.sandbox.isolation
started once there, so a machine where it cannot start stops the run in one line before any model loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from grpo_cli.episodes.adapters.trl import (
    ENVIRONMENT_FACTORY_KEY,
    SINGLE,
    adapter_node,
    factory_specs,
    load_environments,
    takes_environments,
)
from grpo_cli.episodes.environments import EnvironmentSpec, load_environment_factory
from grpo_cli.errors import UserFacingError
from grpo_cli.sandbox import configure, require, settings_from_config
from grpo_cli.tasks.schema import RewardWeightsConfig, TaskConfig
from grpo_cli.usercode.agents import AGENT_KEY, load_agent
from grpo_cli.usercode.user_code import (
    RewardSpec,
    UserCodeError,
    load_reward_spec,
    named_specs,
    with_absolute_reference,
)

# The reward component the environment's summed step rewards are logged and weighted under.
ENV_COMPONENT = "env"
ENVIRONMENT_KEY = "task.environment"


def _plain(value: Any) -> Any:
    """A config value as plain Python (an OmegaConf node converted; anything else as it is)."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    return value


def tool_specs(task_cfg: TaskConfig) -> dict[str, RewardSpec]:
    """task.tools as plain data: {name: reference string or node} (one line for another kind of value). Also
    applies task.sandbox to this process and the workers it starts (sandbox.configure): every process that loads
    the tools or the environment (preflight, episode_setup) reads task.tools first."""
    configure_sandbox(task_cfg)
    return named_specs(task_cfg.tools, "task.tools")


def configure_sandbox(task_cfg: TaskConfig) -> None:
    """task.sandbox as the settings of sandbox.run in this process and the worker processes it starts."""
    configure(settings_from_config(_plain(task_cfg.sandbox)))


def environment_factory_value(task_cfg: TaskConfig) -> Any:
    """task.environment_factory as plain data (episodes/adapters/trl.py reads it), None when the task has none."""
    value = _plain(task_cfg.environment_factory)
    return None if value is None or value == "" else value


def environment_rewards(task_cfg: TaskConfig) -> dict[str, RewardSpec]:
    """The task.rewards (task=custom) whose function takes environments=: they run beside the instances."""
    specs = named_specs(task_cfg.user_rewards() or {}, "task.rewards")
    base_dir = base_dir_of_task(task_cfg)
    return {
        name: with_absolute_reference(spec, base_dir)
        for name, spec in specs.items()
        if takes_environments(load_reward_spec(f"task.rewards.{name}", spec, base_dir))
    }


def environment_spec(task_cfg: TaskConfig) -> EnvironmentSpec | None:
    """task.environment as plain data (a reference string or a node), None when the task has none. A task with
    task.environment_factory has the node of its adapter (trl_environments.TRLEnvironment) here."""
    factory = environment_factory_value(task_cfg)
    if factory is not None:
        base_dir = base_dir_of_task(task_cfg)
        rewards = environment_rewards(task_cfg)
        return adapter_node(factory, base_dir, task_cfg.tool_call_format, task_cfg.max_turns, rewards)
    value = _plain(task_cfg.environment)
    if value is None or value == "":
        return None
    if isinstance(value, Mapping):
        return {str(k): v for k, v in value.items()}
    if isinstance(value, str):
        return value
    raise UserCodeError(
        f"{ENVIRONMENT_KEY}={value!r}: give path/to/file.py:Class, package.module:Class or a node "
        "{_target_: ..., <constructor arguments>}"
    )


def agent_value(task_cfg: TaskConfig) -> RewardSpec | None:
    """task.agent as plain data (a reference string or a `_target_` node), None when the task has none."""
    value = _plain(task_cfg.agent)
    if value is None or value == "":
        return None
    return named_specs({"agent": value}, "task")["agent"]


def gives_env_reward(task_cfg: TaskConfig) -> bool:
    """Whether the task's episodes have an `env` reward component: an environment's step rewards, or an agent's."""
    return environment_spec(task_cfg) is not None or agent_value(task_cfg) is not None


def is_multiturn(task_cfg: TaskConfig) -> bool:
    """Whether the task runs multi-turn episodes (it names tools or an environment, or an agent drives them)."""
    return bool(tool_specs(task_cfg)) or environment_spec(task_cfg) is not None or agent_value(task_cfg) is not None


def base_dir_of_task(task_cfg: TaskConfig) -> Path:
    """Where relative tool and environment references and package modules are found: task.base_dir (task=custom),
    else this process's working directory (file references are absolute by then: absolutize_multiturn_paths)."""
    return task_cfg.reference_dir()


def env_weight(task_cfg: TaskConfig) -> float:
    """task.reward_weights.env: the weight of the environment's summed step rewards (default 1)."""
    weights = task_cfg.reward_weights
    if isinstance(weights, RewardWeightsConfig):
        return float(weights.env)
    value = (_plain(weights) or {}).get(ENV_COMPONENT, 1.0)  # task=custom: a mapping of names
    return float(value)


def absolutize_multiturn_paths(task_cfg: TaskConfig, base_dir: Path) -> None:
    """The file references of task.tools and task.environment made absolute against `base_dir` (where grpo-run was
    started), in place, so that every rank, worker and sweep job finds the same files."""
    specs = tool_specs(task_cfg)
    if specs:
        task_cfg.tools = {name: with_absolute_reference(spec, base_dir) for name, spec in specs.items()}
    agent = agent_value(task_cfg)
    if agent is not None:
        task_cfg.agent = with_absolute_reference(agent, base_dir)
    factory = environment_factory_value(task_cfg)
    if factory is not None:
        specs = factory_specs(factory)
        absolute = {name: with_absolute_reference(spec, base_dir) for name, spec in specs.items()}
        task_cfg.environment_factory = absolute[SINGLE] if SINGLE in absolute else absolute
        return
    spec = environment_spec(task_cfg)
    if spec is not None:
        task_cfg.environment = with_absolute_reference(spec, base_dir)


def validate_multiturn(task_cfg: TaskConfig, prompt_styles: tuple[str, ...] = ("chat",)) -> None:
    """The multi-turn keys' checks, one line each: tools and an environment not both, a chat prompt, the tools
    and the environment loaded (imported here, before any model loads), task.tool_call_format only with tools."""
    from grpo_cli.episodes.tools import load_tools  # transformers' get_json_schema: only for a task with tools

    specs = tool_specs(task_cfg)
    factory = environment_factory_value(task_cfg)
    if agent_value(task_cfg) is not None:
        validate_agent(task_cfg, prompt_styles)
        return
    if factory is not None and (specs or _plain(task_cfg.environment) not in (None, "")):
        other = "task.tools" if specs else ENVIRONMENT_KEY
        raise UserFacingError(
            f"{ENVIRONMENT_FACTORY_KEY} and {other} together: an episode's turns are answered by one of them: "
            "drop one (the environment class's public methods are its tools; add the functions as methods)"
        )
    if factory is None:
        takers = [name for name in environment_rewards(task_cfg)]
        if takers:
            raise UserFacingError(
                f"task.rewards.{takers[0]} takes environments=, which only {ENVIRONMENT_FACTORY_KEY} gives (TRL's "
                "environment instances): set it, or drop the argument"
            )
    environment = environment_spec(task_cfg)
    if not specs and environment is None:
        if task_cfg.tool_call_format is not None:
            raise UserFacingError(
                f"task.tool_call_format={task_cfg.tool_call_format} without task.tools: it says how tool calls are "
                "read, so give task.tools.<name>=file.py:function, or drop it"
            )
        return
    if specs and environment is not None:
        raise UserFacingError(
            "task.tools and task.environment together: an episode's turns are answered by the tools or by the "
            "environment, not both: drop one (an environment can call the functions itself in its step)"
        )
    what = "task.tools" if specs else ENVIRONMENT_FACTORY_KEY if factory is not None else ENVIRONMENT_KEY
    if task_cfg.prompt != "chat":
        raise UserFacingError(
            f"{what} with task.prompt={task_cfg.prompt}: an episode is a conversation the chat template renders, "
            "so use task.prompt=chat"
        )
    if "chat" not in prompt_styles:
        raise UserFacingError(f"{what}: task={task_cfg.name} has no chat prompts, which episodes need")
    base_dir = base_dir_of_task(task_cfg)
    uses: list[object] = []
    if specs:
        uses += [tool.fn for tool in load_tools(specs, base_dir).values()]
    if factory is not None:
        uses += list(load_environments(factory, base_dir).classes.values())
    elif environment is not None:
        made = load_environment_factory(ENVIRONMENT_KEY, environment, base_dir)
        uses.append(getattr(made, "func", made))  # a node's class, its arguments bound
    if any(getattr(fn, "uses_sandbox", False) for fn in uses):
        require()


def validate_agent(task_cfg: TaskConfig, prompt_styles: tuple[str, ...]) -> None:
    """task.agent's checks, one line each: alone (an agent answers its own turns), a chat prompt, its function
    loaded and its signature one an agent can be called with."""
    agent = agent_value(task_cfg)
    assert agent is not None
    others = [
        key
        for key, given in (
            ("task.tools", bool(tool_specs(task_cfg))),
            (ENVIRONMENT_KEY, _plain(task_cfg.environment) not in (None, "")),
            (ENVIRONMENT_FACTORY_KEY, environment_factory_value(task_cfg) is not None),
        )
        if given
    ]
    if others:
        raise UserFacingError(
            f"{AGENT_KEY} and {others[0]} together: the agent runs its own tools and environment between its model "
            f"calls: drop {others[0]} (call it from the agent's code)"
        )
    if task_cfg.prompt != "chat" or "chat" not in prompt_styles:
        raise UserFacingError(
            f"{AGENT_KEY}: an agent's episode opens with the task's chat prompt: use task.prompt=chat"
        )
    load_agent(agent, base_dir_of_task(task_cfg))
