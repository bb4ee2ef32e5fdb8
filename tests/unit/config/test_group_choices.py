"""A group choice that does not exist stops before anything loads, with one line naming the group's choices.

Hydra skips a missing file of an `optional` defaults-list entry, so before the fix `experiment=cs336_mathh`,
`algorithm=dapoo`, `debug=smokee` trained the defaults and exited 0. The choices are what Hydra's config search
path holds: grpo-run's conf/ plus a --config-dir or hydra.searchpath of the user's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from grpo_cli import cli
from tests.conftest import compose_config

CONF = Path(cli.__file__).parent / "conf"
# Every group of grpo_cli/conf, read from the folders (not from Hydra, the thing under test).
GROUPS = sorted(folder.name for folder in CONF.iterdir() if folder.is_dir() and any(folder.glob("*.yaml")))


def choices_on_disk(group: str, *extra: Path) -> list[str]:
    return sorted(p.stem for folder in (CONF, *extra) for p in (folder / group).glob("*.yaml"))


def typo(group: str) -> str:
    first = choices_on_disk(group)[0]
    return first + first[-1]


def stop_line(capsys, args: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        cli.check_group_choices(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def listed_choices(line: str) -> list[str]:
    match = re.search(r"use one of (.+?) \(", line)
    assert match, line
    return match.group(1).split(", ")


def test_every_group_of_the_conf_folder_is_checked():
    assert {"algorithm", "debug", "experiment", "sweep", "model", "task"} <= set(GROUPS)


@pytest.mark.parametrize("group", GROUPS)
def test_composing_a_choice_that_does_not_exist_fails(group):
    # Before the fix the optional groups (algorithm, debug, experiment, sweep) composed the defaults silently.
    with pytest.raises(ConfigCompositionException):
        compose_config([f"{group}={typo(group)}"])


@pytest.mark.parametrize("group", GROUPS)
def test_a_choice_that_does_not_exist_is_one_line_naming_the_groups_choices(capsys, group):
    wrong = typo(group)
    line = stop_line(capsys, [f"{group}={wrong}"])
    assert line.startswith(f"grpo-run: error: {group}={wrong}: no such {group} choice, use one of ")
    assert listed_choices(line) == choices_on_disk(group)  # the *_schema entries of the ConfigStore are not choices


@pytest.mark.parametrize("group", GROUPS)
def test_a_sweep_over_a_choice_that_does_not_exist_stops_before_any_job(capsys, group):
    good, wrong = choices_on_disk(group)[0], typo(group)
    line = stop_line(capsys, ["-m", f"{group}={good},{wrong}", "seed=0,1"])
    assert f"{group}={wrong}: no such {group} choice" in line
    assert listed_choices(line) == choices_on_disk(group)
    line = stop_line(capsys, ["--multirun", f"{group}=choice({wrong},{good})"])
    assert f"{group}={wrong}: no such {group} choice" in line


def test_existing_choices_and_sweeps_over_them_pass(capsys):
    cli.check_group_choices(["experiment=cs336_math", "algorithm=dapo", "debug=smoke", "model=tiny_random"])
    cli.check_group_choices(["-m", "algorithm=grpo,dapo", "experiment=glob(*)", "optim.lr=1e-5,3e-5"])
    cli.check_group_choices(["-m", "sweep=algorithms", "experiment=keyword_ablation"])
    cli.check_group_choices(["algorithm=null", "~debug", "model.name_or_path=x", "hydra/launcher=basic"])
    assert capsys.readouterr().err == ""


def write_preset(root: Path, group: str, name: str, text: str = "# @package _global_\nseed: 3\n") -> None:
    (root / group).mkdir(parents=True, exist_ok=True)
    (root / group / f"{name}.yaml").write_text(text)


@pytest.mark.parametrize("where", ["--config-dir", "hydra.searchpath"])
def test_a_users_own_presets_are_choices_and_listed(capsys, tmp_path, where):
    write_preset(tmp_path, "experiment", "my_exp")
    write_preset(tmp_path, "model", "my_model", "name_or_path: random:tiny-llama\n")
    search = ["--config-dir", str(tmp_path)] if where == "--config-dir" else [f"hydra.searchpath=[file://{tmp_path}]"]
    cli.check_group_choices([*search, "experiment=my_exp", "model=my_model"])
    assert capsys.readouterr().err == ""
    line = stop_line(capsys, [*search, "experiment=my_expp"])
    assert "experiment=my_expp: no such experiment choice" in line
    assert listed_choices(line) == choices_on_disk("experiment", tmp_path)
    assert "my_exp" in listed_choices(line) and "cs336_math" in listed_choices(line)
    line = stop_line(capsys, ["-m", *search, "model=tiny_random,my_modell"])
    assert listed_choices(line) == choices_on_disk("model", tmp_path)


def test_a_choice_a_preset_names_in_its_defaults_is_checked_too(capsys, tmp_path):
    write_preset(tmp_path, "experiment", "mine", "# @package _global_\ndefaults:\n  - override /algorithm: dapoo\n")
    line = stop_line(capsys, ["--config-dir", str(tmp_path), "experiment=mine"])
    assert "algorithm=dapoo, named in the defaults list of a config this run composes: no such algorithm choice" in line
    assert listed_choices(line) == choices_on_disk("algorithm")
    # and a sweep preset of the user's that sweeps over a choice that does not exist
    write_preset(
        tmp_path, "sweep", "mine", "# @package _global_\nhydra:\n  sweeper:\n    params:\n      debug: smoke,smok\n"
    )
    line = stop_line(capsys, ["-m", "--config-dir", str(tmp_path), "sweep=mine"])
    assert "debug=smok: no such debug choice" in line
