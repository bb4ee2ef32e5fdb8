"""The key reference, read from the schemas: every key's type, default, constraint and help, grouped as the
command line groups them. `grpo-run --help [<group>]` prints it (with the values of the selected choices) and
`python -m grpo_cli.tasks.config_reference > docs/config-reference.md` writes the page the docs link to (a test fails
when the committed page is not a fresh render).

A section is a group (`loss`), a nested schema (`model.lora`), or, for a group with one schema per choice (task,
rollout: GROUP_SCHEMAS), the keys every choice has and then each choice's own keys (`task=custom`).

A docs page shows some keys in a table between `<!-- generated keys: <section titles or keys> -->` and
`<!-- end of generated keys -->`; `python -m grpo_cli.tasks.config_reference --fill <page>...` rewrites those tables
(the test of the reference page checks them too).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import textwrap
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_cli.config.fields import constraint_of, help_of
from grpo_cli.config.schemas import GROUP_SCHEMAS, GRPOConfig
from grpo_cli.config.task_registry import require_tasks

TOP_LEVEL = "top level"


@dataclass(frozen=True)
class KeyDoc:
    """One key as the reference shows it."""

    key: str  # dotted, as typed on the command line: loss.cliprange
    type: str  # as annotated: float | None
    default: Any  # the schema's default (dataclasses.MISSING: none, the choice's YAML sets it)
    accepts: str  # the declared constraint in words: "in (0, 1)", "one of a, b", "true or false"
    help: str


@dataclass(frozen=True)
class Section:
    """The keys of one group, nested schema or group choice."""

    title: str  # "loss", "model.lora", "task=custom", "top level"
    group: str  # the top-level group it belongs to ("" for the top-level keys)
    help: str  # what the section is: its schema's docstring
    keys: tuple[KeyDoc, ...]


def _nested_schema(hint: Any) -> type | None:
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _accepts(cls: type, name: str, annotation: str) -> str:
    nullable = "None" in annotation
    if annotation.startswith("bool"):
        return "true, false or null" if nullable else "true or false"
    constraint = constraint_of(cls, name)
    if constraint is None or constraint.kind == "any":
        return {"list": "a list", "dict": "a mapping"}.get(annotation.partition("[")[0], "any value")
    words = constraint.describe(integer=annotation.startswith(("int", "list[int]")))
    if annotation.startswith("list["):
        words = f"a list, each item {words}"
    return f"{words}, or null" if nullable else words


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def schema_doc(cls: type) -> str:
    """The schema's own docstring (not the one dataclass writes for a class without)."""
    doc = inspect.getdoc(cls) or ""
    return "" if doc.startswith(f"{cls.__name__}(") else " ".join(doc.split())


def _what(section: Section) -> str:
    """The section's help less the name it starts with ("loss.*: the policy-gradient loss" under "loss")."""
    for name in (f"{section.title}.*: ", f"{section.title}: "):
        if section.help.startswith(name):
            return section.help.removeprefix(name)
    return section.help


def _own_fields(cls: type, base: type | None) -> list[dataclasses.Field[Any]]:
    """The fields of `cls`, less those it inherits unchanged from `base` (a redeclared field is its own)."""
    inherited = getattr(base, "__dataclass_fields__", {}) if base is not None else {}
    return [f for f in dataclasses.fields(cls) if inherited.get(f.name) is not f]


def _sections_of(cls: type, prefix: str, title: str, group: str, base: type | None = None) -> Iterator[Section]:
    """The section of schema `cls` at `prefix` (its keys beyond `base`'s), then one per nested schema."""
    hints = typing.get_type_hints(cls)
    keys, nested = [], []
    for f in _own_fields(cls, base):
        key = f"{prefix}{f.name}"
        schema = _nested_schema(hints[f.name])
        if key in GROUP_SCHEMAS or (schema is not None and not prefix):
            continue  # a group of its own
        if schema is not None:
            nested.append((key, schema))
            continue
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        keys.append(KeyDoc(key, annotation, _default(f), _accepts(cls, f.name, annotation), help_of(cls, f.name)))
    yield Section(title, group, schema_doc(cls), tuple(keys))
    for key, schema in nested:
        yield from _sections_of(schema, f"{key}.", key, group)


def group_base(group: str) -> type:
    """The schema every choice of a per-choice group extends (task: TaskConfig, rollout: SamplingConfig)."""
    schemas = list(GROUP_SCHEMAS[group].values())
    return next(c for c in schemas[0].__mro__ if all(issubclass(s, c) for s in schemas))


def group_sections(group: str, choice: str | None = None) -> list[Section]:
    """The sections of one top-level group ("" for the top-level keys). For a group with a schema per choice:
    the keys every choice has, then those of `choice` (every choice's, in turn, when None)."""
    if not group:
        return list(_sections_of(GRPOConfig, "", TOP_LEVEL, ""))[:1]
    if group in GROUP_SCHEMAS:
        base = group_base(group)
        sections = list(_sections_of(base, f"{group}.", group, group))
        if choice is not None:  # less a nested schema of the base that the choice redeclares (task=custom's dicts)
            redeclared = {f"{group}.{f.name}" for f in _own_fields(GROUP_SCHEMAS[group][choice], base)}
            sections = [s for s in sections if s.title not in redeclared]
        choices = GROUP_SCHEMAS[group] if choice is None else {choice: GROUP_SCHEMAS[group][choice]}
        for name, schema in choices.items():
            own = list(_sections_of(schema, f"{group}.", f"{group}={name}", group, base))
            sections += [s for s in own if s.keys or s is not own[0] or schema_doc(schema)]
        return sections
    section_schema = _nested_schema(typing.get_type_hints(GRPOConfig)[group])
    if section_schema is None:
        raise KeyError(f"{group} is not a group: one of {', '.join(groups())}")
    return list(_sections_of(section_schema, f"{group}.", group, group))


def groups() -> list[str]:
    """The top-level groups, in the schema's order."""
    hints = typing.get_type_hints(GRPOConfig)
    return [f.name for f in dataclasses.fields(GRPOConfig) if f.name in GROUP_SCHEMAS or _nested_schema(hints[f.name])]


def all_sections() -> list[Section]:
    return [*group_sections(""), *(s for group in groups() for s in group_sections(group))]


def all_keys() -> set[str]:
    """Every key of every schema (each choice's of the per-choice groups), dotted."""
    return {doc.key for section in all_sections() for doc in section.keys}


def show_value(value: Any) -> str:
    """A value as it is typed on the command line or written in YAML: null, true, [a, b], {}."""
    if value is dataclasses.MISSING or value == "???":
        return "???"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return f"[{', '.join(show_value(v) for v in value)}]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {show_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str) and value == "":
        return '""'
    return str(value)


# ---------------------------------------------------------------------------------------------------------
# The terminal: grpo-run --help [<group> ...]


def _lookup(values: Mapping[str, Any], key: str) -> Any:
    node: Any = values
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return dataclasses.MISSING
        node = node[part]
    return node


def terminal_text(sections: list[Section], values: Mapping[str, Any] | None = None, width: int = 100) -> str:
    """Each section as a heading and per key `key = value  (accepts)` with its help below, indented. `values`:
    the composed config (the value of each key under the selected choices), else the schema's defaults."""
    lines: list[str] = []
    for section in sections:
        what = _what(section)
        lines.append(f"== {section.title}{': ' + what if what else ''} ==")
        for doc in section.keys:
            value = _lookup(values, doc.key) if values is not None else dataclasses.MISSING
            value = doc.default if value is dataclasses.MISSING else value
            lines.append(f"{doc.key} = {show_value(value)}  ({doc.accepts})")
            lines += textwrap.wrap(doc.help, width, initial_indent="    ", subsequent_indent="    ")
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def groups_text(width: int = 100) -> str:
    """One line per group: its name and what it is (the overview of `grpo-run --help`)."""
    lines = []
    for group in groups():
        what = _what(group_sections(group)[0])
        lines += textwrap.wrap(what, width, initial_indent=f"{group:<14}", subsequent_indent=" " * 14)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# The page: docs/config-reference.md

PAGE_HEADER = """# Config reference

Every key `grpo-run` accepts, with its type, its default, the values it accepts and what it does. This page is
generated from the schemas (grpo_cli/config/schemas.py, grpo_cli/config/rollout_schemas.py,
grpo_cli/tasks/schema.py and each task's own schema): do not edit it, run
`python -m grpo_cli.tasks.config_reference > docs/config-reference.md`. The same text is printed by
`grpo-run --help <group>` (`grpo-run --help all`: every group), there with the values of the selected choices.

Override a key with `grpo-run <key>=<value>` and pick a group's preset with `grpo-run <group>=<choice>`
([README](../README.md#config-groups)). The default is the schema's: a choice (conf/<group>/<choice>.yaml, e.g.
`loss=grpo_clip`) may set other values, and `???` means the choice sets it; `grpo-run --cfg job` prints the
whole composed config. For `task` and `rollout`, which have a schema per choice, the keys every choice has come
first, then each choice's own keys (those of `task=custom` are described in [custom tasks](custom-tasks.md)).
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;")


def _row(doc: KeyDoc, with_type: bool = True) -> str:
    default = show_value(doc.default).replace("|", "\\|")
    cells = [f"`{doc.key}`", *([_cell(doc.type)] if with_type else []), f"`{default}`", _cell(doc.accepts)]
    return f"| {' | '.join(cells)} | {_cell(doc.help)} |"


def markdown() -> str:
    """docs/config-reference.md."""
    parts = [PAGE_HEADER]
    for section in all_sections():
        level = "##" if section.title in (TOP_LEVEL, section.group) else "###"
        parts.append(f"{level} {section.title}\n")
        if _what(section):
            parts.append(f"{_cell(_what(section))}\n")
        if section.keys:
            rows = ["| Key | Type | Default | Accepts | What it does |", "|---|---|---|---|---|"]
            parts.append("\n".join([*rows, *(_row(doc) for doc in section.keys)]) + "\n")
    return "\n".join(parts)


# A docs page's generated table: the names it shows (section titles or keys), the table, the end marker.
GENERATED_KEYS = re.compile(
    r"(<!-- generated keys: (?P<names>[^>]*?) -->\n)(?P<table>.*?)(<!-- end of generated keys -->)", re.DOTALL
)


def key_table(names: list[str]) -> str:
    """A table of the keys named, a section title (`task=custom`, `eval`) standing for its keys."""
    sections = {section.title: section for section in all_sections()}
    docs = {doc.key: doc for section in sections.values() for doc in section.keys}
    rows = ["| Key | Default | Accepts | What it does |", "|---|---|---|---|"]
    for name in names:
        if name not in sections and name not in docs:
            raise KeyError(f"generated keys: {name} is neither a section ({', '.join(sections)}) nor a key")
        rows += [_row(doc, with_type=False) for doc in (sections[name].keys if name in sections else (docs[name],))]
    return "\n".join(rows) + "\n"


def fill_generated_tables(text: str) -> str:
    """`text` (a docs page) with each generated table rendered afresh."""
    return GENERATED_KEYS.sub(lambda m: m.group(1) + key_table(m.group("names").split()) + m.group(4), text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m grpo_cli.tasks.config_reference",
        description="Print docs/config-reference.md, or rewrite the generated key tables of docs pages.",
    )
    parser.add_argument("--fill", nargs="+", type=Path, metavar="PAGE", help="rewrite these pages' generated tables")
    args = parser.parse_args(argv)
    require_tasks()  # the page lists every task's keys: run as python -m grpo_cli.tasks.config_reference
    if not args.fill:
        sys.stdout.write(markdown())
        return
    for page in args.fill:
        text = page.read_text(encoding="utf-8")
        filled = fill_generated_tables(text)
        if filled != text:
            page.write_text(filled, encoding="utf-8")
            print(f"{page}: tables rewritten")


if __name__ == "__main__":
    # The page lists every task's keys and the config never imports a task: the command moved to the tasks package.
    sys.exit("grpo_cli.config.reference is now run as: python -m grpo_cli.tasks.config_reference")
