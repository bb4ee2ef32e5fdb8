"""The config: structured schemas for every group, registered in Hydra's ConfigStore, and their validation.

Where each part lives:

    config/fields.py       what each key accepts and what it is for, declared once with its field:
                           `choice(default, allowed, help=...)`, `positive`, `non_negative`, `unit_interval`,
                           `in_range`, `finite`, `path(default, kind)`, `any_value`, `flag` (a bool); `help_of`
                           (a leaf module, so that task schemas can use it too)
    tasks/schema.py        TaskConfig, the keys every task has; each task's own schema next to the task
    config/schemas.py      the group schemas and GRPOConfig
    config/rollout_schemas.py  the rollout group's schemas: the sampling keys every engine has, each engine's own
    config/batch_shape.py  BatchShape: the batch arithmetic and the off-policy decision
    config/declared.py     the declarations read back: choice keys for --help, the generic field check, key hints
    config/validation.py   validate_config: every field against its declaration, then the cross-field rules
    config/saved.py        a run's config.yaml read back under its schemas (resume, reports)
    config/resume.py       which run resume= names, and its saved config with the overrides a resume may change
    config/registry.py     registration in Hydra's ConfigStore, the help text, our sweep plugins
    config/reference.py    every key's type, default, constraint and help: `grpo-run --help <group>` and
                           docs/config-reference.md (python -m grpo_cli.tasks.config_reference)
    config/group_choices.py  every group choice a command names exists (its one line naming the choices)
    config/task_registry.py  the task schemas and the task check, which the tasks package registers (the config
                           never imports a task: the arrow runs tasks -> config)

Everything public is importable from here (`from grpo_cli.config import validate_config`): the imports below
are the list (pyproject.toml lets this file import names it does not use). Two modules are imported from
themselves, by grpo-run's cli alone: group_choices.py and resume.py, which load Hydra's config loader and rich, so
that importing the config (every task does) stays light.
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
from grpo_cli.config.registry import register_configs, register_sweep_plugins
from grpo_cli.config.rollout_schemas import (
    ROLLOUT_SCHEMAS,
    HFRolloutConfig,
    SamplingConfig,
    VLLMRolloutConfig,
    rollout_config_for,
)
from grpo_cli.config.saved import SavedConfigError, load_saved_config
from grpo_cli.config.schemas import (
    DISAGGREGATED,
    DISTRIBUTED_STRATEGIES,
    GROUP_SCHEMAS,
    SYNC_STRATEGIES,
    DistributedConfig,
    EvalConfig,
    GRPOConfig,
    JobConfig,
    KLConfig,
    LoggerConfig,
    LoraSettings,
    LossConfig,
    ModelConfig,
    NormalizationConfig,
    OptimConfig,
    ReportConfig,
    SyncConfig,
    TrainConfig,
)
from grpo_cli.config.task_registry import TASK_SCHEMAS
from grpo_cli.config.validation import validate_config, validate_distributed, validate_sync
