"""The multi-turn keys every task has, as the task declares them (task.tools, task.tool_call_format,
task.environment, task.environment_factory, task.agent, task.max_turns, task.reward_weights.env, task.sandbox):
read as plain data here, nothing of them loaded or run. No torch, and nothing of the episode machinery: tasks/ may
import usercode/ at most (docs/architecture.md), so loading and checking the tools, the environment and the sandbox
is episodes/config.py's, which the task check calls through the config's registry (config/task_registry.py).

A task runs episodes (grpo_cli/rollout/multiturn.py builds them) when it names tools or an environment, or an agent
drives them (grpo_cli/rollout/agent_run.py); otherwise it is single-turn and none of these keys is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from grpo_cli.tasks.schema import RewardWeightsConfig, TaskConfig
from grpo_cli.usercode.user_code import TARGET_KEY, RewardSpec, UserCodeError, named_specs, with_absolute_reference

# The reward component the environment's summed step rewards are logged and weighted under.
ENV_COMPONENT = "env"
ENVIRONMENT_KEY = "task.environment"
ENVIRONMENT_FACTORY_KEY = "task.environment_factory"
# What task.environment_factory holds: one factory spec, or {environment name: factory spec}.
FactorySpecs = dict[str, RewardSpec]
# The key of the single factory in FactorySpecs (TRL's `None` environment name).
SINGLE = ""


def plain(value: Any) -> Any:
    """A config value as plain Python (an OmegaConf node converted; anything else as it is)."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    return value


def declared_tools(task_cfg: TaskConfig) -> dict[str, RewardSpec]:
    """task.tools as plain data: {name: reference string or node} (one line for another kind of value). Nothing
    is loaded or configured: episodes/config.py's tool_specs also applies task.sandbox where the tools run."""
    return named_specs(task_cfg.tools, "task.tools")


def environment_factory_value(task_cfg: TaskConfig) -> Any:
    """task.environment_factory as plain data (episodes/adapters/trl.py reads it), None when the task has none."""
    value = plain(task_cfg.environment_factory)
    return None if value is None or value == "" else value


def factory_specs(value: Any) -> FactorySpecs:
    """task.environment_factory as {name: spec}: a reference string or a `_target_` node is the one factory (name
    ""), any other mapping is a dict of factories by the `environment` column's values."""
    if isinstance(value, str):
        return {SINGLE: value}
    if isinstance(value, Mapping):
        if TARGET_KEY in value:
            return {SINGLE: dict(value)}
        specs = {str(name): spec for name, spec in value.items()}
        if not specs or not all(isinstance(s, str | Mapping) for s in specs.values()):
            raise UserCodeError(
                f"{ENVIRONMENT_FACTORY_KEY}={value!r:.120}: give file.py:Class, a node {{_target_: ..., <constructor "
                "arguments>}, or a mapping {<environment column value>: file.py:Class, ...}"
            )
        return {name: dict(s) if isinstance(s, Mapping) else str(s) for name, s in specs.items()}
    raise UserCodeError(
        f"{ENVIRONMENT_FACTORY_KEY}={value!r:.120}: give file.py:Class, package.module:Class, a node {{_target_: ..., "
        "<constructor arguments>} or a mapping {<environment column value>: file.py:Class}"
    )


def environment_value(task_cfg: TaskConfig) -> RewardSpec | None:
    """task.environment as plain data (a reference string or a node), None when the task has none; one line for
    another kind of value. task.environment_factory is not read here (episodes/config.py's environment_spec)."""
    value = plain(task_cfg.environment)
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


def declares_environment(task_cfg: TaskConfig) -> bool:
    """Whether the task's turns are answered by an environment (task.environment or task.environment_factory)."""
    return environment_factory_value(task_cfg) is not None or environment_value(task_cfg) is not None


def agent_value(task_cfg: TaskConfig) -> RewardSpec | None:
    """task.agent as plain data (a reference string or a `_target_` node), None when the task has none."""
    value = plain(task_cfg.agent)
    if value is None or value == "":
        return None
    return named_specs({"agent": value}, "task")["agent"]


def gives_env_reward(task_cfg: TaskConfig) -> bool:
    """Whether the task's episodes have an `env` reward component: an environment's step rewards, or an agent's."""
    return declares_environment(task_cfg) or agent_value(task_cfg) is not None


def is_multiturn(task_cfg: TaskConfig) -> bool:
    """Whether the task runs multi-turn episodes (it names tools or an environment, or an agent drives them)."""
    return bool(declared_tools(task_cfg)) or gives_env_reward(task_cfg)


def base_dir_of_task(task_cfg: TaskConfig) -> Path:
    """Where relative tool and environment references and package modules are found: task.base_dir (task=custom),
    else this process's working directory (file references are absolute by then: absolutize_multiturn_paths)."""
    return task_cfg.reference_dir()


def env_weight(task_cfg: TaskConfig) -> float:
    """task.reward_weights.env: the weight of the environment's summed step rewards (default 1)."""
    weights = task_cfg.reward_weights
    if isinstance(weights, RewardWeightsConfig):
        return float(weights.env)
    value = (plain(weights) or {}).get(ENV_COMPONENT, 1.0)  # task=custom: a mapping of names
    return float(value)


def absolutize_multiturn_paths(task_cfg: TaskConfig, base_dir: Path) -> None:
    """The file references of task.tools and task.environment made absolute against `base_dir` (where grpo-run was
    started), in place, so that every rank, worker and sweep job finds the same files."""
    specs = declared_tools(task_cfg)
    if specs:
        task_cfg.tools = {name: with_absolute_reference(spec, base_dir) for name, spec in specs.items()}
    agent = agent_value(task_cfg)
    if agent is not None:
        task_cfg.agent = with_absolute_reference(agent, base_dir)
    factory = environment_factory_value(task_cfg)
    if factory is not None:
        factories = factory_specs(factory)
        absolute = {name: with_absolute_reference(spec, base_dir) for name, spec in factories.items()}
        task_cfg.environment_factory = absolute[SINGLE] if SINGLE in absolute else absolute
        return
    environment = environment_value(task_cfg)
    if environment is not None:
        task_cfg.environment = with_absolute_reference(environment, base_dir)
