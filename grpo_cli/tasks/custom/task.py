"""task=custom's TaskSpec, built from its config (`TaskSpec.from_config`): the user's rewards imported and checked,
the weights read, the data and check_reward cases wired in."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, cast

from grpo_cli.errors import UserFacingError
from grpo_cli.tasks.base import PROMPT_STYLES, Example, TaskSpec
from grpo_cli.tasks.custom.cases import read_cases
from grpo_cli.tasks.custom.data import build_examples, template_columns
from grpo_cli.tasks.custom.reward import CustomReward
from grpo_cli.tasks.custom.schema import CustomTaskConfig, reward_specs
from grpo_cli.tasks.custom.trl_convention import NamedReward, user_reward
from grpo_cli.tasks.multiturn import ENV_COMPONENT, env_weight, gives_env_reward
from grpo_cli.tasks.rewards import SHAPING_COMPONENTS, Shaping
from grpo_cli.tasks.schema import TaskConfig
from grpo_cli.usercode.user_code import resolve_file


def weights_of(task_cfg: CustomTaskConfig, names: list[str]) -> dict[str, float]:
    """{name: weight} for every reward (1 unless given) and each weighted shaping term; one line for a weight
    naming nothing."""
    given = {str(k): v for k, v in dict(task_cfg.reward_weights or {}).items()}
    allowed = [*names, *SHAPING_COMPONENTS]
    with_environment = gives_env_reward(task_cfg)
    if with_environment:  # the environment's (or agent's) rewards: multiturn.env_weight reads its weight
        allowed.append(ENV_COMPONENT)
    for name, weight in given.items():
        if name not in allowed:
            raise UserFacingError(
                f"task.reward_weights.{name}={weight}: there is no reward named {name}: use "
                f"{', '.join(allowed)} (task.rewards.<name>, task.reward_model.name, the shaping terms)"
            )
        if not isinstance(weight, int | float) or isinstance(weight, bool) or not math.isfinite(weight):
            raise UserFacingError(f"task.reward_weights.{name}={weight} must be a finite number")
    weights = {name: float(given.get(name, 1.0)) for name in names}
    weights.update({term: float(given[term]) for term in SHAPING_COMPONENTS if given.get(term)})
    if with_environment and float(given.get(ENV_COMPONENT, 1.0)):
        return weights  # the environment's reward may be the only one
    if not any(weights.values()):
        raise UserFacingError(f"every task.reward_weights is 0: give one of {', '.join(names)} a weight")
    return weights


def _reward_model(task_cfg: CustomTaskConfig) -> NamedReward | None:
    rm = task_cfg.reward_model
    if not rm.path:
        if rm.label:
            raise UserFacingError(f"task.reward_model.label={rm.label} without task.reward_model.path: give the model")
        return None
    from grpo_cli.tasks.reward_model import RewardModelScorer, check_reward_model  # torch, only when configured

    local = rm.path.startswith((".", "/", "~")) or (task_cfg.reference_dir() / rm.path).is_dir()
    model_path = str(resolve_file(rm.path, task_cfg.reference_dir())) if local else rm.path
    check_reward_model(model_path, rm.label)

    def load(device: str | None) -> Any:
        return RewardModelScorer(model_path, rm.label, rm.batch_size, rm.dtype, device or "cpu", rm.input)

    return NamedReward(rm.name, f"task.reward_model.path={rm.path}", load, "model")


def build_custom_task(config: TaskConfig) -> TaskSpec:
    """This run's TaskSpec: the user's rewards imported and checked, the data read on build (preflight), all before
    any model loads."""
    # TaskSpec.from_config takes any task config; this task's is CustomTaskConfig (its TaskSpec.schema), which
    # validate_task_config checks before anything builds.
    task_cfg = cast(CustomTaskConfig, config)
    base_dir = task_cfg.reference_dir()
    specs = reward_specs(task_cfg)
    names = list(specs)
    for name in names:
        if name in SHAPING_COMPONENTS:  # its values and the shaping term's would share train/reward/<name>
            raise UserFacingError(
                f"task.rewards.{name}: {name} is the name of a shaping term (task.reward_weights.{name}): give this "
                "reward another name"
            )
    rewards = [user_reward(name, spec, task_cfg.reward_convention, base_dir) for name, spec in specs.items()]
    model = _reward_model(task_cfg)
    if model is not None:
        if model.name in names:
            raise UserFacingError(f"task.reward_model.name={model.name} is also in task.rewards: give it another name")
        rewards.append(model)
    if not rewards and not gives_env_reward(task_cfg):
        raise UserFacingError(
            "task=custom has no reward: give task.rewards.<name>=path/to/file.py:function (or a node {_target_: "
            "package.module.factory, <its arguments>}) or task.reward_model.path=<classifier>"
        )
    all_names = [r.name for r in rewards]
    with_environment = gives_env_reward(task_cfg)
    for key, chosen in (("answer_from", task_cfg.answer_from), ("format_from", task_cfg.format_from)):
        allowed = [*all_names, ENV_COMPONENT] if with_environment and key == "answer_from" else all_names
        if chosen is not None and chosen not in allowed:
            if chosen == ENV_COMPONENT:
                raise UserFacingError(
                    f"task.{key}=env without task.environment: env is the environment's reward; use "
                    f"{', '.join(all_names)}"
                )
            raise UserFacingError(f"task.{key}={chosen}: there is no reward named {chosen}: use {', '.join(allowed)}")
    template_columns(task_cfg.template)
    reward = CustomReward(
        rewards,
        weights_of(task_cfg, all_names),
        task_cfg.reward_timeout_s or None,
        task_cfg.on_reward_error,
        completion_format=task_cfg.completion_format,
        answer_from=task_cfg.answer_from,
        format_from=task_cfg.format_from,
        shaping=Shaping(None, task_cfg.overlong_buffer, task_cfg.repetition_ngram),
        workers=task_cfg.reward_workers,
        env_weight=env_weight(task_cfg) if with_environment else None,
    )

    def build(split: str, n: int | None = None, seed: int = 0, prompt_style: str = "chat", **_: Any) -> list[Example]:
        del n, seed, prompt_style  # read from task_cfg itself, like every other source of this task
        return build_examples(task_cfg, rewards, split)

    extra_names = [term for term in SHAPING_COMPONENTS if reward.weights.get(term)]
    if with_environment:
        extra_names.append(ENV_COMPONENT)
    cases = read_cases(task_cfg, [*all_names, *extra_names])
    return dataclasses.replace(CUSTOM_TASK, reward_fn=reward, build=build, sanity_cases=cases)


def _not_configured(*_: Any, **__: Any) -> Any:
    raise RuntimeError("task=custom is built from its config: use grpo_cli.tasks.task_for(task_cfg)")


CUSTOM_TASK = TaskSpec(
    name="custom",
    reward_fn=_not_configured,
    build=_not_configured,
    prompt_styles=PROMPT_STYLES,
    schema=CustomTaskConfig,
    from_config=build_custom_task,
)
