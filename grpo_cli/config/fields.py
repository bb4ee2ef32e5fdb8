"""Field constraints: what each config key accepts, declared once with its field (`steps: int = positive(30)`).

Each declaration also holds the key's help text (`positive(30, help="...")`), so that the program can print what a
key is for. A leaf module (no grpo_cli imports, no torch), so that every schema can declare its fields with it: the
group schemas in grpo_cli/config/schemas.py and each task's schema next to its task in grpo_cli/tasks/. The generic
check (grpo_cli.config.declared.check_fields, called by validate_config) enforces the declarations for every key,
`grpo-run --help <group>` and docs/config-reference.md (grpo_cli/config/reference.py) list them with their help,
and tests/unit/config/test_bad_input.py feeds every field the values its declaration rules out.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING

Choices = tuple[str, ...] | Callable[[], tuple[str, ...]]
# A key's help: its text, or a function returning it where the text is declared beside the code it describes.
Help = str | Callable[[], str]

# A bool field (`flag(...)`, for its help) and a nested schema need no constraint (the type says it all); every
# other field declares one, or says `any_value(...)`. Every field but a nested schema says what it is for (help=).

CONSTRAINT = "constraint"
# What the key is for, in a sentence or a few: `grpo-run --help <group>` prints it and docs/config-reference.md
# (python -m grpo_cli.tasks.config_reference) tabulates it. Every key has one (tests/unit/config/test_reference.py).
HELP = "help"
# path(kind=...): file: an existing file | dir: an existing directory | output: a directory that is or can be
# made (not a file) | model: a local model directory or .gguf file when the value is a path (a hub id or a
# built-in name is checked by models.check_model_source) | run: a run directory to resume (or true).
PATH_KINDS = ("file", "dir", "output", "model", "run")


@dataclass(frozen=True)
class Constraint:
    """The values a config field accepts. For a list field it applies to each item; None (where the type allows
    it) always passes."""

    # range: a finite number in [low, high] (an end is open where *_open; None: unbounded) | choice: one of
    # `choices` | path: a path of `path_kind` | any: any value of the field's type (checked where it is used,
    # by a cross-field rule, or not at all).
    kind: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: Choices | None = None
    path_kind: str | None = None
    # Said after the rule in the error message: what the edge value means, or what to write instead.
    hint: str = ""

    def describe(self, integer: bool = False) -> str:
        """'positive', '>= 1' (a positive integer), '>= 0', 'in (0, 1]', 'one of a, b', 'an existing file'."""
        if self.kind == "choice":
            return f"one of {', '.join(resolve_choices(self.choices or ()))}"
        if self.kind == "path":
            return {
                "file": "an existing file",
                "dir": "an existing directory",
                "output": "a directory (existing or new)",
                "model": "a model directory, a .gguf file, a hub id or a built-in model",
                "run": "a run directory with checkpoints (or true)",
            }[self.path_kind or "file"]
        if self.kind == "any":
            return "any value"
        low, high = self.low, self.high
        if integer and low is not None and self.low_open and float(low).is_integer():
            low, low_open = low + 1, False  # an integer > 0 is an integer >= 1
        else:
            low_open = self.low_open
        if high is None:
            if low is None:
                return "a finite number"
            return "positive" if low == 0 and low_open else f"{'>' if low_open else '>='} {_number(low)}"
        if low is None:
            return f"{'<' if self.high_open else '<='} {_number(high)}"
        return f"in {'(' if low_open else '['}{_number(low)}, {_number(high)}{')' if self.high_open else ']'}"

    def problem(self, value: Any) -> str | None:
        """Why `value` (one value, not a list) is not allowed ('must be positive', 'no such file or directory',
        ...), None when it is."""
        if self.kind == "choice":
            values = resolve_choices(self.choices or ())
            return None if value in values else f"is not one of {', '.join(values)}"
        if self.kind == "path":
            if isinstance(value, bool):  # resume=true: the newest run; resume=false: a new run
                return None if self.path_kind == "run" else "must be a path"
            return path_problem(str(value), self.path_kind or "file")
        if self.kind == "range":
            number = isinstance(value, int | float) and not isinstance(value, bool)
            rule = self.describe(integer=isinstance(value, int))
            if not number or not math.isfinite(value):
                return f"must be {rule}" if rule == "a finite number" else f"must be finite and {rule}"
            if not self._in_range(value):
                return f"must be {rule}"
        return None

    def _in_range(self, value: float) -> bool:
        low_ok = self.low is None or (value > self.low if self.low_open else value >= self.low)
        high_ok = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return low_ok and high_ok


def _number(value: float) -> str:
    return f"{value:g}"


def _declare(default: Any, constraint: Constraint | None, factory: Callable[[], Any] | None, help: Help) -> Any:
    metadata: dict[str, Any] = {HELP: help}
    if constraint is not None:
        metadata[CONSTRAINT] = constraint
        if constraint.kind == "choice":
            metadata["choices"] = constraint.choices
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def choice(default: Any, allowed: Choices, *, help: Help = "", factory: Callable[[], Any] | None = None) -> Any:
    """A plain `str` field (or a list of them, given `factory`) whose value must be one of `allowed`: what users
    type and `--cfg job` prints.

    `allowed` is a tuple, or a function returning one where the list lives elsewhere (the torch core, a registry
    defined below), so that the list is written once and importing this module stays free of torch; `help` may be
    such a function too (loss.type's, made of each loss's own summary).
    """
    return _declare(default, Constraint("choice", choices=allowed), factory, help)


def in_range(
    default: Any = MISSING,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    hint: str = "",
    help: str = "",
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A number (or a list of numbers) in [low, high], an end open where asked; None means no bound."""
    return _declare(default, Constraint("range", low, high, low_open, high_open, hint=hint), factory, help)


def positive(
    default: Any = MISSING, *, hint: str = "", help: str = "", factory: Callable[[], Any] | None = None
) -> Any:
    """> 0 (for an integer field: >= 1)."""
    return in_range(default, 0, low_open=True, hint=hint, help=help, factory=factory)


def non_negative(default: Any = MISSING, *, hint: str = "", help: str = "") -> Any:
    """>= 0."""
    return in_range(default, 0, hint=hint, help=help)


def unit_interval(default: Any = MISSING, *, hint: str = "", help: str = "") -> Any:
    """In (0, 1]: a fraction that may not be 0."""
    return in_range(default, 0, 1, low_open=True, hint=hint, help=help)


def finite(default: Any = MISSING, *, help: str = "") -> Any:
    """Any finite number (no nan, no inf)."""
    return in_range(default, help=help)


def path(default: Any, kind: str, *, help: str = "", factory: Callable[[], Any] | None = None) -> Any:
    """A path of `kind` (PATH_KINDS), or a list of them given `factory`; checked before anything loads."""
    assert kind in PATH_KINDS, kind
    return _declare(default, Constraint("path", path_kind=kind), factory, help)


def any_value(default: Any = MISSING, *, help: str = "", factory: Callable[[], Any] | None = None) -> Any:
    """Explicitly no constraint beyond the field's type (a name, a free text, a dict passed through)."""
    return _declare(default, Constraint("any"), factory, help)


def flag(default: bool | None, *, help: str = "") -> Any:
    """A bool key (None where the type allows it: decided from other keys); the type is its constraint."""
    return _declare(default, None, None, help)


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def path_problem(value: str, kind: str) -> str | None:
    """What is wrong with path `value` for a field of `kind`, None when nothing is (see PATH_KINDS)."""
    target = Path(value).expanduser()
    if kind == "model":
        looks_local = value.startswith(("/", ".", "~")) or value.endswith(".gguf") or value.count("/") > 1
        if value.startswith(("embedded:", "random:")) or not (target.exists() or looks_local):
            return None  # a built-in model or a hub id: models.check_model_source checks them before loading
        if not target.exists():
            return "no such file or directory: give a model directory, a .gguf file, a hub id, or model=smollm2_135m"
        if target.is_dir() and not any(p.name.endswith(_WEIGHT_SUFFIXES) for p in target.iterdir()):
            return "a directory without model weights (*.safetensors, *.bin or *.gguf): give the one holding them"
        if target.is_file() and target.suffix != ".gguf":
            return "a file but not a .gguf file: give a model directory or a .gguf file"
        return None
    if kind == "output":
        existing = next((p for p in (target, *target.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            return f"{existing} is a file, so no directory can be made there: give a directory path"
        return None
    if kind == "run":
        if not (target / "config.yaml").is_file() or not any((target / "checkpoints").glob("step_*")):
            return (
                "no run with checkpoints there (expected config.yaml and checkpoints/step_*): give a run "
                "directory of an earlier grpo-run, or resume=true for the newest one"
            )
        return None
    if not target.exists():
        return f"no such file or directory: give an existing {'file' if kind == 'file' else 'directory'}"
    if kind == "file" and not target.is_file():
        return "a directory, not a file: give a file"
    if kind == "dir" and not target.is_dir():
        return "a file, not a directory: give a directory"
    return None


def core_value(module: str, name: str) -> Callable[[], Any]:
    """`grpo_cli.core.<module>.<name>`, imported on first use (the core imports torch): what the core declares
    (the losses' registry, the lists of choices) read where it is declared."""
    return lambda: getattr(importlib.import_module(f"grpo_cli.core.{module}"), name)


def from_core(module: str, name: str) -> Callable[[], tuple[str, ...]]:
    """The tuple `grpo_cli.core.<module>.<name>` (a registry dict: its names), imported on first use."""
    value = core_value(module, name)
    return lambda: tuple(value())


def help_from_core(module: str, name: str) -> Callable[[], str]:
    """The help text function `grpo_cli.core.<module>.<name>()` returns, imported on first use."""
    value = core_value(module, name)
    return lambda: str(value()())


def resolve_choices(allowed: Choices) -> tuple[str, ...]:
    """The allowed values of a `choice` declaration (calling it where the list lives elsewhere)."""
    return tuple(allowed()) if callable(allowed) else tuple(allowed)


def help_of(cls: type, name: str) -> str:
    """The help text of field `name` of schema `cls`, "" if it has none: that of the most derived declaration
    made with a constructor of this module (a subclass that only changes the default keeps its base's)."""
    for klass in cls.__mro__:
        declared = getattr(klass, "__dataclass_fields__", {}).get(name)
        if declared is not None and HELP in declared.metadata:
            text = declared.metadata[HELP]
            return str(text() if callable(text) else text)
    return ""


def constraint_of(cls: type, name: str) -> Constraint | None:
    """The declared constraint of field `name` of schema `cls`, also when a subclass only changes its default."""
    for klass in cls.__mro__:
        declared = getattr(klass, "__dataclass_fields__", {}).get(name)
        if declared is not None and CONSTRAINT in declared.metadata:
            return declared.metadata[CONSTRAINT]
    return None
