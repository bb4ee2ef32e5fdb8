"""The config: structured schemas for every group, registered in Hydra's ConfigStore, and their validation.

Where each part lives:

    grpo_cli/fields.py     what each key accepts, declared once with its field: `choice(default, allowed)`,
                           `positive`, `non_negative`, `unit_interval`, `in_range`, `finite`, `path(default, kind)`,
                           `any_value` (a leaf module, so that task schemas can use it too)
    tasks/schema.py        TaskConfig, the keys every task has; each task's own schema next to the task
    config/schemas.py      the group schemas and GRPOConfig
    config/batch_shape.py  BatchShape: the batch arithmetic and the off-policy decision
    config/declared.py     the declarations read back: choice keys for --help, the generic field check, key hints
    config/validation.py   validate_config: every field against its declaration, then the cross-field rules
    config/saved.py        a run's config.yaml read back under its schemas (resume, reports)
    config/registry.py     registration in Hydra's ConfigStore, the help text, our sweep plugins
    config/group_choices.py  every group choice a command names exists (its one line naming the choices)

Everything public is importable from here (`from grpo_cli.config import validate_config`).
"""

from __future__ import annotations

from grpo_cli.config.batch_shape import BatchShape, needs_old_log_probs
from grpo_cli.config.declared import (
    allowed_values,
    check_fields,
    choice_fields,
    field_names,
    keys_hint,
    unknown_key_hint,
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
from grpo_cli.fields import (
    CONSTRAINT,
    PATH_KINDS,
    Choices,
    Constraint,
    any_value,
    choice,
    constraint_of,
    finite,
    in_range,
    non_negative,
    path,
    path_problem,
    positive,
    resolve_choices,
    unit_interval,
)
from grpo_cli.tasks import PROMPT_STYLES, TASK_SCHEMAS, RewardWeightsConfig, TaskConfig

__all__ = [
    "CONSTRAINT",
    "DISAGGREGATED",
    "DISTRIBUTED_STRATEGIES",
    "GROUP_SCHEMAS",
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
