"""The declarations read back from the schemas: every choice key and its values (`grpo-run --help`), the
generic check of every field against its declared constraint, and the hints an unknown key gets."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator
from typing import Any

from grpo_cli.config.fields import Choices, constraint_of, resolve_choices
from grpo_cli.config.schemas import GROUP_SCHEMAS, GRPOConfig
from grpo_cli.errors import UserFacingError


def _choices_of(cls: type, name: str) -> Choices | None:
    """The `choice(...)` declaration of field `name`, also when a subclass only changes its default."""
    constraint = constraint_of(cls, name)
    return constraint.choices if constraint is not None and constraint.kind == "choice" else None


def _schema_fields(cls: type) -> Iterator[tuple[str, type | None]]:
    """(field name, the field's dataclass type or None) for every field of a schema dataclass."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        yield f.name, hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _walk_schema(cls: type, prefix: str = "") -> Iterator[tuple[str, Choices]]:
    """(dotted key, declaration) of every choice field under schema `cls`, including each per-choice schema
    of the groups in GROUP_SCHEMAS."""
    for name, nested in _schema_fields(cls):
        key = f"{prefix}{name}"
        allowed = _choices_of(cls, name)
        if allowed is not None:
            yield key, allowed
        # A group with a schema per choice (task: typed Any in GRPOConfig) is walked through each of them.
        for schema in ((nested,) if nested is not None else ()) + tuple(GROUP_SCHEMAS.get(key, {}).values()):
            yield from _walk_schema(schema, f"{key}.")


def choice_fields() -> dict[str, tuple[str, ...]]:
    """Every choice key of the config and its allowed values, in schema order."""
    return {key: resolve_choices(allowed) for key, allowed in dict(_walk_schema(GRPOConfig)).items()}


def allowed_values(key: str) -> tuple[str, ...]:
    """The allowed values of one choice key, e.g. allowed_values("rollout.engine") == ("hf", "vllm")."""
    declared = dict(_walk_schema(GRPOConfig))
    if key not in declared:
        raise KeyError(f"{key} is not a choice key: one of {', '.join(declared)}")
    return resolve_choices(declared[key])


def _show(value: Any) -> str:
    return str(list(value)) if isinstance(value, list | tuple) else str(value)


def check_fields(node: Any, prefix: str = "") -> None:
    """Every field holds a value its declared constraint allows (each item of a list field), and no key was
    added beside the schema's (`+task.foo=1`)."""
    extra = sorted(set(vars(node)) - field_names(type(node)))
    if extra:
        hint = keys_hint(prefix.rstrip("."), type(node), extra[0])
        raise UserFacingError(f"{prefix}{extra[0]} is not a key: {hint}")
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        constraint = constraint_of(type(node), f.name)
        if constraint is not None and value is not None:
            items = value if isinstance(value, list | tuple) else [value]
            for item in items:
                problem = constraint.problem(item)
                if problem is not None:
                    # "k=0 must be >= 1", "k=[0] holds 0, which must be >= 1", "k=/a: no such file ..."
                    where = f" holds {item}" if items is value else ""
                    sep = ": " if constraint.kind == "path" else (", which " if where else " ")
                    hint = f" ({constraint.hint})" if constraint.hint else ""
                    raise UserFacingError(f"{prefix}{f.name}={_show(value)}{where}{sep}{problem}{hint}")
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_fields(value, f"{prefix}{f.name}.")


def keys_hint(parent: str, object_type: type, key: str) -> str:
    """ "task=keyword has the keys name, ..., keywords_per_prompt (min_words is a key of task=lipogram)" """
    schemas = GROUP_SCHEMAS.get(parent, {})
    label = next((f"{parent}={name}" for name, schema in schemas.items() if schema is object_type), None)
    keys = ", ".join(f.name for f in dataclasses.fields(object_type))
    others = [f"{parent}={name}" for name, schema in schemas.items() if key in field_names(schema)]
    elsewhere = f" ({key} is a key of {' and '.join(others)})" if others else ""
    return f"{label or parent or 'the config'} has the keys {keys}{elsewhere}"


def field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def unknown_key_hint(error: BaseException) -> str | None:
    """For an OmegaConf "Key 'x' not in 'SomeConfig'" error (itself or its cause): which keys that node has,
    and which other choice of its group has the key (see keys_hint); for a new key of a dict node: add it with +.
    None for other errors."""
    for e in (error, error.__cause__):
        object_type = getattr(e, "object_type", None)
        full_key = getattr(e, "full_key", None)
        if object_type is dict and full_key and "not in struct" in str(e):  # a new key of a dict node
            return f"add it with +{full_key}=... ({full_key.rpartition('.')[0]} is a dict of names of your own)"
        if isinstance(object_type, type) and dataclasses.is_dataclass(object_type) and full_key:
            parent, _, key = str(full_key).rpartition(".")
            if key not in field_names(object_type):  # else a known key with a bad value
                return keys_hint(parent, object_type, key)
    return None
