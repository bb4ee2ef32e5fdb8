"""The multi-turn keys a task declares (tasks/multiturn.py reads them as plain data), loaded and checked: the
tools, the environment and the agent imported, task.sandbox applied to this process and the workers it starts, and
the sandbox of task.sandbox.isolation started once. No torch.

`validate_multiturn` runs at preflight, before any model loads, as part of the task check: importing this module
registers it in the config's registry (config/task_registry.register_episode_check), which tasks.validate_task_config
calls, so that tasks/ never imports the episode machinery (grpo-run's cli and the tests' conftest import this
module; a task check without it fails loudly). Every tool and the environment are imported and checked there (a spec
that does not load, a tool without a docstring, an environment class without step()), each a one-line
UserFacingError naming the key; a tool or environment marked `sandbox.uses_sandbox` (the `python` tool) also has the
sandbox of task.sandbox.isolation started once there, so a machine where it cannot start stops the run in one line
before any model loads.

The declared keys' readers (tasks/multiturn.py) are re-exported here: `grpo_cli.tasks.multiturn_config`, this
module's path before the layout by trust, names them all.
"""

from __future__ import annotations

from grpo_cli.config.task_registry import register_episode_check
from grpo_cli.episodes.adapters.trl import adapter_node, load_environments, takes_environments
from grpo_cli.episodes.environments import EnvironmentSpec, load_environment_factory
from grpo_cli.errors import UserFacingError
from grpo_cli.sandbox import configure, require, settings_from_config
from grpo_cli.tasks.multiturn import (
    ENV_COMPONENT,
    ENVIRONMENT_FACTORY_KEY,
    ENVIRONMENT_KEY,
    SINGLE,
    absolutize_multiturn_paths,
    agent_value,
    base_dir_of_task,
    declared_tools,
    declares_environment,
    env_weight,
    environment_factory_value,
    environment_value,
    factory_specs,
    gives_env_reward,
    is_multiturn,
    plain,
)
from grpo_cli.tasks.schema import TaskConfig
from grpo_cli.usercode.agents import AGENT_KEY, load_agent
from grpo_cli.usercode.user_code import RewardSpec, load_reward_spec, named_specs, with_absolute_reference


def tool_specs(task_cfg: TaskConfig) -> dict[str, RewardSpec]:
    """task.tools as plain data: {name: reference string or node} (one line for another kind of value). Also
    applies task.sandbox to this process and the workers it starts (sandbox.configure): every process that loads
    the tools or the environment (preflight, episode_setup) reads task.tools first."""
    configure_sandbox(task_cfg)
    return declared_tools(task_cfg)


def configure_sandbox(task_cfg: TaskConfig) -> None:
    """task.sandbox as the settings of sandbox.run in this process and the worker processes it starts."""
    configure(settings_from_config(plain(task_cfg.sandbox)))


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
    task.environment_factory has the node of its adapter (episodes/adapters/trl.py's TRLEnvironment) here."""
    factory = environment_factory_value(task_cfg)
    if factory is not None:
        base_dir = base_dir_of_task(task_cfg)
        rewards = environment_rewards(task_cfg)
        return adapter_node(factory, base_dir, task_cfg.tool_call_format, task_cfg.max_turns, rewards)
    return environment_value(task_cfg)


def validate_multiturn(task_cfg: TaskConfig, prompt_styles: tuple[str, ...] = ("chat",)) -> None:
    """The multi-turn keys' checks, one line each: tools and an environment not both, a chat prompt, the tools
    and the environment loaded (imported here, before any model loads), task.tool_call_format only with tools."""
    from grpo_cli.episodes.tools import load_tools  # transformers' get_json_schema: only for a task with tools

    specs = tool_specs(task_cfg)
    factory = environment_factory_value(task_cfg)
    if agent_value(task_cfg) is not None:
        validate_agent(task_cfg, prompt_styles)
        return
    if factory is not None and (specs or plain(task_cfg.environment) not in (None, "")):
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
            (ENVIRONMENT_KEY, plain(task_cfg.environment) not in (None, "")),
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


# The task check (tasks.validate_task_config) calls this through the config's registry: tasks/ does not import it.
register_episode_check(validate_multiturn)

__all__ = [
    "ENV_COMPONENT",
    "ENVIRONMENT_FACTORY_KEY",
    "ENVIRONMENT_KEY",
    "SINGLE",
    "absolutize_multiturn_paths",
    "agent_value",
    "base_dir_of_task",
    "configure_sandbox",
    "declared_tools",
    "declares_environment",
    "env_weight",
    "environment_factory_value",
    "environment_rewards",
    "environment_spec",
    "environment_value",
    "factory_specs",
    "gives_env_reward",
    "is_multiturn",
    "plain",
    "tool_specs",
    "validate_agent",
    "validate_multiturn",
]
