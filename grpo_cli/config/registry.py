"""Registration in Hydra's ConfigStore (the schemas, the help text's resolvers) and our sweep plugins."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, OmegaConf

from grpo_cli.config.declared import choice_fields
from grpo_cli.config.reference import group_sections, groups, groups_text, terminal_text
from grpo_cli.config.schemas import GROUP_SCHEMAS, GRPOConfig
from grpo_cli.config.task_registry import require_tasks

# The groups `grpo-run --help <group> ...` asks for ("all": every group), set by cli.py, which takes them off the
# command line before Hydra reads it; empty: the overview.
HELP_TOPICS: list[str] = []


def _help_allowed_values() -> str:
    """`grpo-run --help`'s list of every choice key and its values (${grpo_allowed_values:} in conf/config.yaml)."""
    return "\n".join(f"{key}: {', '.join(values)}" for key, values in choice_fields().items())


def _help_config_groups() -> str:
    """Hydra's group list for --help (${grpo_config_groups:}), less the per-choice `*_schema` entries."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    loader = GlobalHydra.instance().config_loader()

    def groups(parent: str) -> Iterator[str]:
        for name in loader.list_groups(parent):
            group = f"{parent}/{name}" if parent else name
            if group != "hydra":
                yield group
                yield from groups(group)

    lines = []
    for group in sorted(groups("")):
        options = [o for o in loader.get_group_options(group, ObjectType.CONFIG) if not o.endswith("_schema")]
        if options:
            lines.append(f"{group}: {', '.join(sorted(options))}")
    return "\n".join(lines)


def _help_body(_root_: DictConfig) -> str:
    """`grpo-run --help`'s body (${grpo_help:} in conf/config.yaml), with the values of the composed config:
    the overview (groups and their choices, every choice key's values, the top-level keys, what each group is),
    or the keys of the groups in HELP_TOPICS."""
    values: Any = OmegaConf.to_container(_root_, resolve=False)
    if HELP_TOPICS:
        topics = ["", *groups()] if "all" in HELP_TOPICS else HELP_TOPICS  # "": the top-level keys
        choices = {"task": values["task"].get("name"), "rollout": values["rollout"].get("engine")}
        sections = [s for topic in topics for s in group_sections(topic, choices.get(topic))]
        body = terminal_text(sections, values)
    else:
        body = "\n".join(
            [
                "== Config groups (group=choice) ==",
                _help_config_groups(),
                "",
                "== Allowed values (key: values) ==",
                _help_allowed_values(),
                "",
                terminal_text(group_sections(""), values),
                "",
                "== Keys of a group: grpo-run --help <group> (grpo-run --help all: every group) ==",
                groups_text(),
            ]
        )
    return body.replace("$", "$$")  # Hydra passes the help text through string.Template


def register_configs() -> None:
    """Register the schemas (conf/config.yaml extends `grpo_config_schema`, conf/task/<name>.yaml extends
    `<name>_schema`, conf/rollout/<engine>.yaml `<engine>_schema`) and the resolvers of the help text."""
    from hydra.core.config_store import ConfigStore

    require_tasks()  # the task schemas the tasks package registers (conf/task/*.yaml extend them)
    cs = ConfigStore.instance()
    _store_once(cs, None, "grpo_config_schema", GRPOConfig)
    for group, schemas in GROUP_SCHEMAS.items():
        for choice_name, schema in schemas.items():
            _store_once(cs, group, f"{choice_name}_schema", schema)
    OmegaConf.register_new_resolver("grpo_allowed_values", _help_allowed_values, replace=True)
    OmegaConf.register_new_resolver("grpo_config_groups", _help_config_groups, replace=True)
    OmegaConf.register_new_resolver("grpo_help", _help_body, replace=True)
    register_sweep_plugins()


# What register_configs stored, by (group, name): the schema and the ConfigStore's entry made of it.
_STORED: dict[tuple[str | None, str], tuple[type, Any]] = {}


def _store_once(cs: Any, group: str | None, name: str, schema: type) -> None:
    """cs.store(group, name, schema_node(schema)), unless the store still holds the entry this process made of
    this same schema: storing builds the structured config anew (about half of a compose), and a process that
    composes many times (the tests; a sweep's jobs in one process) would rebuild every schema each time."""
    stored = _STORED.get((group, name))
    if stored is not None and stored[0] is schema and stored[1] is _held(cs, group, name):
        return
    cs.store(group=group, name=name, node=schema_node(schema))
    _STORED[(group, name)] = (schema, _held(cs, group, name))


def _held(cs: Any, group: str | None, name: str) -> Any:
    """The ConfigStore's entry (a ConfigNode) for `group/name`, or None."""
    entry: Any = cs.repo
    for part in [*(group.split("/") if group else []), f"{name}.yaml"]:
        entry = entry.get(part) if isinstance(entry, dict) else None
    return entry


def schema_node(schema: type) -> Any:
    """What the ConfigStore holds for a schema: the class, or for one with OPEN_KEYS (task=custom's rewards and
    reward_weights, dicts of the user's own names) its config with those dict nodes open, so that a name the YAML
    does not have is added by `task.rewards.<name>=...` as well as by `+task.rewards.<name>=...` (Hydra's struct
    flag, inherited from the root, is what asks for the +; a node's own flag overrides it)."""
    open_keys = getattr(schema, "OPEN_KEYS", ())
    if not open_keys:
        return schema
    node = OmegaConf.structured(schema)
    for key in open_keys:
        OmegaConf.set_struct(node[key], False)
    return node


def register_sweep_plugins() -> None:
    """hydra/launcher=processes (conf/config.yaml's launcher for -m) and an Optuna sweeper that maximizes.

    Hydra's plugin scan finds the launcher wherever grpo-cli is installed, editable installs included since
    pyproject.toml's `package-dir` makes them a plain path entry (tests/unit/project/test_packaging.py). It is
    still registered
    by hand for editable installs made before that change (setuptools' import hook, which the scan cannot walk).
    The scan re-executes every plugin module (the Optuna sweeper's config
    would store its own `direction: minimize` again), so it runs first; it runs once per process.
    """
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    plugins = Plugins.instance()
    from hydra_plugins.grpo_cli_launcher.process_launcher import ProcessLauncher

    plugins.register(ProcessLauncher)
    try:
        from hydra_plugins.hydra_optuna_sweeper.config import Direction, OptunaSweeperConf
    except ImportError:  # no [optuna] extra: hydra/sweeper=optuna stops with one line (cli.py)
        return
    # job.objective is a reward: higher is better (the plugin's default direction is minimize).
    node = OptunaSweeperConf(direction=Direction.maximize)
    ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=node, provider="optuna_sweeper")
