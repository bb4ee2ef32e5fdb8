"""Every group choice a command names must exist, checked against Hydra's own config search path.

conf/config.yaml's defaults list selects no algorithm, experiment, debug or sweep preset by default (`null`),
without Hydra's `optional`, which would skip a file that does not exist and silently run the defaults. This
module turns a missing choice into one line naming the group's choices, before Hydra creates a run directory or
a sweep starts a job: every value of a `-m` sweep (a,b / choice(a,b), and a sweep preset's hydra.sweeper.params)
and every choice a config names in its own defaults list (a preset's `override /algorithm: dapo`).

The choices are what Hydra's ConfigLoader lists for the group (`get_group_options`): grpo-run's conf/, the user's
--config-dir, hydra.searchpath and search-path plugins alike, plus the ConfigStore's entries, of which the
per-choice `*_schema` nodes (config/registry.py) are left out of the listing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from hydra.core.config_loader import ConfigLoader
from hydra.core.object_type import ObjectType
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException, MissingConfigException
from hydra.types import RunMode
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


class _SearchPath:
    """The groups and choices of one command's config search path (its overrides may add hydra.searchpath)."""

    def __init__(self, loader: ConfigLoader, config_name: str, overrides: list[str]) -> None:
        self.loader, self.config_name, self.overrides = loader, config_name, overrides
        self._options: dict[tuple[str, ObjectType], list[str]] = {}

    def options(self, group: str, kind: ObjectType = ObjectType.CONFIG) -> list[str]:
        if (group, kind) not in self._options:
            self._options[group, kind] = self.loader.get_group_options(
                group, results_filter=kind, config_name=self.config_name, overrides=self.overrides
            )
        return self._options[group, kind]

    def is_group(self, name: str) -> bool:
        parent, _, leaf = name.rpartition("/")
        return leaf in self.options(parent, ObjectType.GROUP)

    def missing_choice_line(self, group: str, value: str, named_in: str | None = None) -> str:
        choices = ", ".join(sorted(o for o in self.options(group) if not o.endswith("_schema")))
        where = f", named in {named_in}" if named_in else ""
        source = (
            "Hydra's own and its installed plugins'"
            if group.startswith("hydra/")
            else f"{group}/<name>.yaml on the config search path: grpo-run's conf/, a --config-dir, hydra.searchpath"
        )
        return f"{group}={value}{where}: no such {group} choice, use one of {choices} ({source})"


def unknown_group_choice(loader: ConfigLoader, config_name: str, overrides: list[str], multirun: bool) -> str | None:
    """The one line for the first group choice of this command that does not exist, or None when all exist.

    Errors of another kind (a malformed override, a key that is not in the schema) give None: Hydra and
    grpo-run's other checks report them with their own line.
    """
    search = _SearchPath(loader, config_name, overrides)
    try:
        parser = OverridesParser.create(config_loader=loader)  # expands glob(...) over a group's choices
        parsed = parser.parse_overrides(overrides)
        line = _first_missing(search, parsed, multirun)
        if line is None and multirun:  # a sweep preset's values; the command line's own win (Hydra's BasicSweeper)
            parsed = parser.parse_overrides(_sweeper_params(loader, config_name, overrides)) + parsed
            line = _first_missing(search, parsed, multirun)
        if line is not None:
            return line
        config_overrides = [_text(o) for o in parsed if o.is_delete() or not search.is_group(o.key_or_group)]
        for job in _job_variants(_group_choices(search, parsed, multirun)):
            loader.compute_defaults_list(config_name, [*config_overrides, *job], RunMode.RUN)
    except MissingConfigException as missing:  # a choice named in a config's own defaults list
        group, _, value = (missing.missing_cfg_file or "").rpartition("/")
        if not group or not search.is_group(group):
            return None
        # Hydra names the config holding the node the choice overrides, not the preset that set it: say neither.
        return search.missing_choice_line(group, value, "the defaults list of a config this run composes")
    except (HydraException, OmegaConfBaseException, ValueError):
        return None
    return None


def _text(override: Override) -> str:
    """The override as written: what parse_overrides records for every override it returns (Override's field is
    optional only for overrides built by hand)."""
    if override.input_line is None:
        raise ValueError(f"override {override.key_or_group} has no text")
    return override.input_line


def _first_missing(search: _SearchPath, parsed: list[Override], multirun: bool) -> str | None:
    for group, values in _group_choices(search, parsed, multirun).items():
        for choice in values:
            for name in choice.names:
                if name is not None and name not in search.options(group.group):
                    return search.missing_choice_line(group.group, name)
    return None


def _sweeper_params(loader: ConfigLoader, config_name: str, overrides: list[str]) -> list[str]:
    """hydra.sweeper.params of the composed sweep (a sweep preset's `algorithm: grpo,dapo`), as overrides."""
    cfg = loader.load_configuration(config_name, overrides, RunMode.MULTIRUN)
    params = OmegaConf.select(cfg, "hydra.sweeper.params") or {}
    return [f"{key}={value}" for key, value in params.items()]


@dataclass(frozen=True)
class _Target:
    """What a group override selects into: the group, and the override's key (`+group@package`)."""

    group: str
    key: str


@dataclass(frozen=True)
class _Choice:
    """One job's selection for a target: the override that makes it, and the choice names it selects."""

    override: str
    names: tuple[str | None, ...]


def _group_choices(search: _SearchPath, parsed: list[Override], multirun: bool) -> dict[_Target, list[_Choice]]:
    """Each group override's choices, one per job: a sweep has one per value under -m (without -m, Hydra
    reports the sweep itself). Keyed by what it overrides, so a later override of the same key wins."""
    choices: dict[_Target, list[_Choice]] = {}
    for override in parsed:
        if override.is_delete() or not search.is_group(override.key_or_group):
            continue
        target = _Target(override.key_or_group, override.get_key_element())
        if override.is_sweep_override():
            if multirun and override.is_discrete_sweep():
                values = list(override.sweep_string_iterator())
                choices[target] = [_Choice(f"{target.key}={v}", (None if v == "null" else v,)) for v in values]
            continue
        value = override.value()
        names = tuple(value) if isinstance(value, list) else (value,)  # group=[a,b] selects several
        if all(name is None or isinstance(name, str) for name in names):
            choices[target] = [_Choice(_text(override), names)]
    return choices


def _job_variants(choices: dict[_Target, list[_Choice]]) -> Iterator[list[str]]:
    """The group overrides of jobs that between them take every value of every sweep, each with the other
    sweeps' first values: each choice's own defaults list is composed once, not every combination."""
    options = [values for values in choices.values() if values]
    first = [values[0].override for values in options]
    yield first
    for i, values in enumerate(options):
        for choice in values[1:]:
            yield [*first[:i], choice.override, *first[i + 1 :]]
