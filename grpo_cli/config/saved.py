"""A run directory's config.yaml read back under the schemas it was made with (for resume and reports)."""

from __future__ import annotations

from pathlib import Path
from typing import cast

from omegaconf import DictConfig, OmegaConf

from grpo_cli.config.declared import field_names, unknown_key_hint
from grpo_cli.config.schemas import GROUP_SCHEMAS, GRPOConfig
from grpo_cli.errors import UserFacingError


def _schema_for(group: str, saved: object, selector: str) -> type | None:
    """The per-choice schema a saved group node was made with: the one its `selector` key (task.name,
    rollout.engine) names, else (a test task's name) the one whose keys are exactly the saved keys."""
    if not isinstance(saved, DictConfig):
        return None
    schemas = GROUP_SCHEMAS[group]
    keys = set(saved.keys())
    exact = (schema for schema in schemas.values() if field_names(schema) == keys)
    return schemas.get(str(saved.get(selector))) or next(exact, None)


class SavedConfigError(UserFacingError):
    """A run directory's config.yaml that cannot be read as a config at all (not YAML, binary, empty, not a
    mapping): `reason` says how; the message names the file and what to do."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(
            f"{path} is damaged ({reason}): restore it (Hydra keeps the run's original config in "
            f"{path.parent / '.hydra' / 'config.yaml'}), or start a new run without resume=..."
        )
        self.reason = reason


def _load_yaml_mapping(path: Path) -> DictConfig:
    """OmegaConf.load of a config file that must hold a mapping; SavedConfigError when it cannot."""
    import yaml

    try:
        loaded = OmegaConf.load(path)
    except UnicodeDecodeError:
        raise SavedConfigError(path, "not UTF-8 text") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise SavedConfigError(path, f"not valid YAML{where}") from None
    except OSError as e:
        raise SavedConfigError(path, f"unreadable: {e.strerror}") from None
    if not isinstance(loaded, DictConfig) or not loaded:
        raise SavedConfigError(path, "empty" if not loaded else "not a mapping of keys")
    return loaded


def load_saved_config(path: Path) -> DictConfig:
    """A run directory's config.yaml under the schemas (GRPOConfig, with the task and rollout schemas of that
    run), so that resuming checks it as a fresh run would. A file that is no config at all is a SavedConfigError
    (which resuming recovers from, config.resume.resumed_config); a bad key or value a UserFacingError (one line).

    Keys of another choice's schema are dropped from `task` and `rollout`: a config.yaml written before the
    per-task schemas holds every task's keys, which that run's task never read.
    """
    from omegaconf.errors import OmegaConfBaseException

    saved = _load_yaml_mapping(path)
    try:
        base = OmegaConf.structured(GRPOConfig)
        for group, selector in (("task", "name"), ("rollout", "engine")):
            node = saved.get(group)
            schema = _schema_for(group, node, selector)
            if schema is None:
                continue
            base[group] = OmegaConf.structured(schema)
            others = set().union(*map(field_names, GROUP_SCHEMAS[group].values())) - field_names(schema)
            for key in [k for k in node.keys() if k in others]:
                del node[key]
        # Two mappings merge into a mapping (merge's declared result also allows a ListConfig).
        return cast(DictConfig, OmegaConf.merge(base, saved))
    except OmegaConfBaseException as e:
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        hint = unknown_key_hint(e)
        raise UserFacingError(f"{path}: {text}{': ' + hint if hint else ''}") from None
