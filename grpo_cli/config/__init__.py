"""The config: structured schemas for every group, registered in Hydra's ConfigStore, and their validation.

Where each part lives:

    config/fields.py       what each key accepts and what it is for, declared once with its field:
                           `choice(default, allowed, help=...)`, `positive`, `non_negative`, `unit_interval`,
                           `in_range`, `finite`, `path(default, kind)`, `any_value`, `flag` (a bool); `help_of`
                           (a leaf module, so that task schemas can use it too)
    tasks/schema.py        TaskConfig, the keys every task has; each task's own schema next to the task
    config/schemas.py      the group schemas and GRPOConfig
    config/batch_shape.py  BatchShape: the batch arithmetic and the off-policy decision
    config/declared.py     the declarations read back: choice keys for --help, the generic field check, key hints
    config/validation.py   validate_config: every field against its declaration, then the cross-field rules
    config/saved.py        a run's config.yaml read back under its schemas (resume, reports)
    config/resume.py       which run resume= names, and its saved config with the overrides a resume may change
    config/registry.py     registration in Hydra's ConfigStore, the help text, our sweep plugins
    config/reference.py    every key's type, default, constraint and help: `grpo-run --help <group>` and
                           docs/config-reference.md (python -m grpo_cli.config.reference)
    config/group_choices.py  every group choice a command names exists (its one line naming the choices)

Everything public is importable from here (`from grpo_cli.config import validate_config`). The names load on
first use (PEP 562): a task's schema imports `grpo_cli.config.fields`, which runs this file first, and the
schemas import every task, so importing them here eagerly would make `import grpo_cli.tasks` a cycle.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grpo_cli.config.batch_shape import BatchShape, needs_old_log_probs
    from grpo_cli.config.declared import (
        allowed_values,
        check_fields,
        choice_fields,
        field_names,
        keys_hint,
        unknown_key_hint,
    )
    from grpo_cli.config.fields import (
        CONSTRAINT,
        HELP,
        PATH_KINDS,
        Choices,
        Constraint,
        any_value,
        choice,
        constraint_of,
        finite,
        flag,
        help_of,
        in_range,
        non_negative,
        path,
        path_problem,
        positive,
        resolve_choices,
        unit_interval,
    )
    from grpo_cli.config.group_choices import unknown_group_choice
    from grpo_cli.config.registry import register_configs, register_sweep_plugins
    from grpo_cli.config.saved import SavedConfigError, load_saved_config
    from grpo_cli.config.schemas import (
        DISAGGREGATED,
        DISTRIBUTED_STRATEGIES,
        GROUP_SCHEMAS,
        ROLLOUT_SCHEMAS,
        SYNC_STRATEGIES,
        DistributedConfig,
        EvalConfig,
        GRPOConfig,
        HFRolloutConfig,
        JobConfig,
        KLConfig,
        LoggerConfig,
        LoraSettings,
        LossConfig,
        ModelConfig,
        NormalizationConfig,
        OptimConfig,
        ReportConfig,
        SamplingConfig,
        SyncConfig,
        TrainConfig,
        VLLMRolloutConfig,
        rollout_config_for,
    )
    from grpo_cli.config.validation import validate_config, validate_distributed, validate_sync
    from grpo_cli.tasks import PROMPT_STYLES, TASK_SCHEMAS, RewardWeightsConfig, TaskConfig

# Where each public name lives (the same imports as above, made when a name is first used).
_HOME = {
    "BatchShape": "grpo_cli.config.batch_shape",
    "needs_old_log_probs": "grpo_cli.config.batch_shape",
    "allowed_values": "grpo_cli.config.declared",
    "check_fields": "grpo_cli.config.declared",
    "choice_fields": "grpo_cli.config.declared",
    "field_names": "grpo_cli.config.declared",
    "keys_hint": "grpo_cli.config.declared",
    "unknown_key_hint": "grpo_cli.config.declared",
    "unknown_group_choice": "grpo_cli.config.group_choices",
    "register_configs": "grpo_cli.config.registry",
    "register_sweep_plugins": "grpo_cli.config.registry",
    "SavedConfigError": "grpo_cli.config.saved",
    "load_saved_config": "grpo_cli.config.saved",
    "DISAGGREGATED": "grpo_cli.config.schemas",
    "DISTRIBUTED_STRATEGIES": "grpo_cli.config.schemas",
    "GROUP_SCHEMAS": "grpo_cli.config.schemas",
    "ROLLOUT_SCHEMAS": "grpo_cli.config.schemas",
    "SYNC_STRATEGIES": "grpo_cli.config.schemas",
    "DistributedConfig": "grpo_cli.config.schemas",
    "EvalConfig": "grpo_cli.config.schemas",
    "GRPOConfig": "grpo_cli.config.schemas",
    "HFRolloutConfig": "grpo_cli.config.schemas",
    "JobConfig": "grpo_cli.config.schemas",
    "KLConfig": "grpo_cli.config.schemas",
    "LoggerConfig": "grpo_cli.config.schemas",
    "LoraSettings": "grpo_cli.config.schemas",
    "LossConfig": "grpo_cli.config.schemas",
    "ModelConfig": "grpo_cli.config.schemas",
    "NormalizationConfig": "grpo_cli.config.schemas",
    "OptimConfig": "grpo_cli.config.schemas",
    "ReportConfig": "grpo_cli.config.schemas",
    "SamplingConfig": "grpo_cli.config.schemas",
    "SyncConfig": "grpo_cli.config.schemas",
    "TrainConfig": "grpo_cli.config.schemas",
    "VLLMRolloutConfig": "grpo_cli.config.schemas",
    "rollout_config_for": "grpo_cli.config.schemas",
    "validate_config": "grpo_cli.config.validation",
    "validate_distributed": "grpo_cli.config.validation",
    "validate_sync": "grpo_cli.config.validation",
    "CONSTRAINT": "grpo_cli.config.fields",
    "HELP": "grpo_cli.config.fields",
    "PATH_KINDS": "grpo_cli.config.fields",
    "Choices": "grpo_cli.config.fields",
    "Constraint": "grpo_cli.config.fields",
    "any_value": "grpo_cli.config.fields",
    "choice": "grpo_cli.config.fields",
    "constraint_of": "grpo_cli.config.fields",
    "finite": "grpo_cli.config.fields",
    "flag": "grpo_cli.config.fields",
    "help_of": "grpo_cli.config.fields",
    "in_range": "grpo_cli.config.fields",
    "non_negative": "grpo_cli.config.fields",
    "path": "grpo_cli.config.fields",
    "path_problem": "grpo_cli.config.fields",
    "positive": "grpo_cli.config.fields",
    "resolve_choices": "grpo_cli.config.fields",
    "unit_interval": "grpo_cli.config.fields",
    "PROMPT_STYLES": "grpo_cli.tasks",
    "TASK_SCHEMAS": "grpo_cli.tasks",
    "RewardWeightsConfig": "grpo_cli.tasks",
    "TaskConfig": "grpo_cli.tasks",
}

__all__ = [
    "CONSTRAINT",
    "DISAGGREGATED",
    "DISTRIBUTED_STRATEGIES",
    "GROUP_SCHEMAS",
    "HELP",
    "PATH_KINDS",
    "PROMPT_STYLES",
    "ROLLOUT_SCHEMAS",
    "SYNC_STRATEGIES",
    "TASK_SCHEMAS",
    "BatchShape",
    "Choices",
    "Constraint",
    "DistributedConfig",
    "EvalConfig",
    "GRPOConfig",
    "HFRolloutConfig",
    "JobConfig",
    "KLConfig",
    "LoggerConfig",
    "LoraSettings",
    "LossConfig",
    "ModelConfig",
    "NormalizationConfig",
    "OptimConfig",
    "ReportConfig",
    "RewardWeightsConfig",
    "SamplingConfig",
    "SavedConfigError",
    "SyncConfig",
    "TaskConfig",
    "TrainConfig",
    "VLLMRolloutConfig",
    "allowed_values",
    "any_value",
    "check_fields",
    "choice",
    "choice_fields",
    "constraint_of",
    "field_names",
    "finite",
    "flag",
    "help_of",
    "in_range",
    "keys_hint",
    "load_saved_config",
    "needs_old_log_probs",
    "non_negative",
    "path",
    "path_problem",
    "positive",
    "register_configs",
    "register_sweep_plugins",
    "resolve_choices",
    "rollout_config_for",
    "unit_interval",
    "unknown_group_choice",
    "unknown_key_hint",
    "validate_config",
    "validate_distributed",
    "validate_sync",
]


def __getattr__(name: str) -> Any:  # Any: whichever public name is asked for (typed above for mypy)
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value
