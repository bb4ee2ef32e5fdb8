"""Every `grpo-run` command in README.md and docs/ works as the page writes it, so a page that drifts from the CLI
fails here. The commands that run in seconds (`--help`, `--cfg job`, `job=check_reward`, the `debug=smoke`
run) are run, in this process; a command the page shows failing must fail with the line the page prints; every
other command is composed and validated as `grpo-run` does before a run starts (the first job of a sweep),
from the folder the page runs it in."""

from __future__ import annotations

import contextlib
import copy
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from rich.console import Console

from grpo_cli import cli
from grpo_cli.config import register_configs, validate_config
from grpo_cli.errors import UserFacingError
from tests.conftest import REPO_ROOT

# The pages, and each example folder's README (its commands run from that folder).
PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
PAGES += sorted((REPO_ROOT / "examples").glob("*/README.md"))

# Where a page runs a command without writing the `cd` (it says "from that folder" in its prose).
FOLDERS = {("multi-turn.md", "task=guess8"): "examples/multiturn_guess"}

# What a command names that only exists on the author's machine or in the reader's own folder: composed no
# further than its group choices (check_group_choices), never silently skipped.
PLACEHOLDERS = ("outputs/", "myexp", "mytask", "task=adding", "/data/", "...", "<", "node0.cluster", "$(")
# Where the reader's clone is: an example run from any folder names it (`EX=/path/to/grpo-cli/examples/<x>`).
PLACEHOLDERS += ("/path/to/", "$EX")

# Hydra's options followed by their value (`--cfg job`, `--config-dir conf`).
VALUE_OPTIONS = cli._HYDRA_VALUE_OPTIONS

# A value naming a file of the reader's own (a `.py:function`, a data file) relative to where the command runs.
OWN_FILE = re.compile(r"^(?:[\w./-]+\.py:\w+|[\w./-]+\.(?:jsonl|csv|parquet))$")

# Hydra's sweep syntax: a value that is a sweep, not one value.
SWEEP_VALUE = re.compile(r"^(tag|interval|range|choice|glob)\(")


@dataclass(frozen=True)
class DocCommand:
    page: str
    line: int
    args: list[str]
    cwd: Path
    error: str | None  # the "grpo-run: error: ..." line the page prints right after it

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: grpo-run {shlex.join(self.args)}"


def _code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line inside a fenced or a 4-space indented code block, continuation lines
    (a trailing backslash) joined."""
    lines, fenced, out = text.splitlines(), False, []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    "):
            number, joined = i + 1, line
            while joined.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                joined = joined.rstrip()[:-1] + " " + lines[i].strip()
            out.append((number, joined.strip()))
        i += 1
    return out


def doc_commands() -> list[DocCommand]:
    commands, seen = [], set()
    for page in PAGES:
        code = _code_lines(page.read_text(encoding="utf-8"))
        for k, (number, line) in enumerate(code):
            found = re.match(r"^(?:\$ )?(?:cd (\S+) && )?grpo-run(?=\s|$)(.*)$", line)
            if not found:
                continue
            words = shlex.split(found.group(2), comments=True)
            if "&&" in words:  # `grpo-run logger=tensorboard && tensorboard --logdir outputs/`
                words = words[: words.index("&&")]
            following = code[k + 1][1] if k + 1 < len(code) else ""
            error = following.removeprefix("grpo-run: error: ") if following.startswith("grpo-run: error: ") else None
            home = page.parent if page.parent.parent.name == "examples" else REPO_ROOT
            folder = found.group(1) or next(
                (where for (name, word), where in FOLDERS.items() if name == page.name and word in words), "."
            )
            cwd = (home / folder).resolve()
            if (cwd, tuple(words)) in seen:  # the same command on another page: once is enough
                continue
            seen.add((cwd, tuple(words)))
            commands.append(DocCommand(page.relative_to(REPO_ROOT).as_posix(), number, words, cwd, error))
    return commands


COMMANDS = doc_commands()


def _first_job(args: list[str]) -> list[str]:
    """The overrides of a command's first job: -m and hydra's own keys dropped, each swept key's first value."""
    first = []
    for i, arg in enumerate(args):
        if arg.startswith("-") or arg.lstrip("+~").startswith("hydra") or (i and args[i - 1] in VALUE_OPTIONS):
            continue
        key, _, value = arg.partition("=")
        if SWEEP_VALUE.match(value):
            continue
        depth, cut = 0, len(value)
        for i, char in enumerate(value):  # the first comma outside brackets separates swept values
            depth += char in "[({"
            depth -= char in "])}"
            if char == "," and depth == 0:
                cut = i
                break
        first.append(f"{key}={value[:cut]}" if "=" in arg else arg)
    return first


# Group choices present in the repository's conf/ (a command's own --config-dir adds its folders).
GROUPS = {path.name for path in (REPO_ROOT / "grpo_cli" / "conf").iterdir() if path.is_dir()}

# The composed config of each set of group choices, shared by the commands that differ only in values: Hydra
# composes the choices (about a second each here), values are applied as Hydra applies them (OmegaConf.update,
# merged, typed by the schema), so ~150 commands cost ~50 compositions.
_BASES: dict[tuple[str, ...], DictConfig] = {}


def _base(command: DocCommand, choices: list[str], tmp_path: Path) -> DictConfig:
    key = (str(command.cwd), *[a for a in command.args if a.startswith("--config-dir") or a == "conf"], *choices)
    if key not in _BASES:
        register_configs()
        loader = cli.hydra_loader_for(command.args)
        assert loader is not None, f"{command}: Hydra rejects the command line"
        config_loader, name, _, _ = loader
        cfg = config_loader.load_configuration(name, [*choices, f"output_dir={tmp_path / 'run'}"], RunMode.RUN)
        with open_dict(cfg):
            del cfg["hydra"]
        _BASES[key] = cfg
    return copy.deepcopy(_BASES[key])


def _composed(command: DocCommand, tmp_path: Path):
    """The config `grpo-run` would run (its first job), checked as the CLI checks it before anything loads."""
    cli.check_plugin_extras(command.args)
    swept = [a for a in command.args if "," in a and a.lstrip("+~").partition("=")[0] in GROUPS]
    if "-m" in command.args and swept:
        cli.check_group_choices(command.args)  # every swept choice (each preset's: tests/unit/tracking)
    cli.check_sweep_preset(command.args)
    groups = GROUPS | {
        p.name for p in (command.cwd / "conf").glob("*") if p.is_dir() and "--config-dir" in command.args
    }
    job = _first_job(command.args)
    choices = [o for o in job if o.lstrip("+~").partition("=")[0] in groups]
    cfg = _base(command, choices, tmp_path)
    for override in OverridesParser.create().parse_overrides([o for o in job if o not in choices]):
        with open_dict(cfg) if override.is_add() else contextlib.nullcontext():
            OmegaConf.update(cfg, override.key_or_group, override.value(), merge=True)
    config = OmegaConf.to_object(cfg)
    validate_config(config)
    return config


def _cli_error(command: DocCommand, tmp_path: Path, capsys) -> str | None:
    """The one line `grpo-run <command>` stops with before anything loads, or None when it would start."""
    try:
        _composed(command, tmp_path)
        return None
    except UserFacingError as error:
        return f"grpo-run: error: {error}"
    except SystemExit:
        return capsys.readouterr().err.strip()
    except Exception:  # noqa: BLE001 - Hydra's or OmegaConf's: the CLI's own checks word it, as a user sees it
        pass
    try:
        cli.check_group_choices(command.args)
        cli.precheck_overrides(command.args)
    except SystemExit:
        return capsys.readouterr().err.strip()
    raise AssertionError(f"{command}: composing failed where the CLI's checks pass")


def _run_cli(args: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """`grpo-run <args>` in this process: its exit code and what it printed."""
    monkeypatch.setattr(sys, "argv", ["grpo-run", *args])
    try:
        cli.main()
        code = 0
    except SystemExit as stop:
        code = int(stop.code or 0)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _names_a_missing_file(command: DocCommand) -> bool:
    values = (arg.partition("=")[2] for arg in command.args)
    return any(OWN_FILE.match(value) and not (command.cwd / value.partition(":")[0]).exists() for value in values)


def _kind(command: DocCommand) -> str:
    if command.error is not None and command.cwd.is_dir():
        return "fails"
    if any(word in str(command) for word in PLACEHOLDERS) or not command.cwd.is_dir() or _names_a_missing_file(command):
        return "placeholder"
    if {"--help", "-h", "--cfg", "-c"} & set(command.args):
        return "flag"
    if "-m" not in command.args and "job=check_reward" in command.args:
        return "check_reward"
    if command.args == ["debug=smoke"]:
        return "smoke"
    return "compose"


def test_the_pages_hold_commands_of_every_kind():
    kinds = {_kind(c) for c in COMMANDS}
    assert {"fails", "placeholder", "flag", "check_reward", "smoke", "compose"} <= kinds, kinds
    assert len(COMMANDS) > 100


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_a_documented_command_works_as_written(command, tmp_path, monkeypatch, capsys):
    kind = _kind(command)
    if command.cwd.is_dir():
        monkeypatch.chdir(command.cwd)
    if kind == "fails":
        # The page shows it failing: it must fail before anything loads, with the line the page prints (the
        # start of it: a page may cut a long line); one that composes fails at run time (a reward, a disk).
        line = _cli_error(command, tmp_path, capsys)
        expected = f"grpo-run: error: {command.error}"[:80]
        # An extra this environment lacks stops it first, in its own one line (`pip install ...`).
        if line is not None and not ("pip install" in line and "pip install" not in command.error):
            assert line.startswith(expected), f"{command}\n  page: {expected}\n  now:  {line}"
    elif kind == "placeholder":
        if "--config-dir" not in command.args and any(a.lstrip("+~").partition("=")[0] in GROUPS for a in command.args):
            cli.check_group_choices(command.args)
    elif kind == "flag" and {"--help", "-h"} & set(command.args):
        # The help text itself is printed by tests/e2e; here: the groups asked for exist, Hydra takes the line.
        topics, rest = cli.take_help_topics(command.args)
        assert topics or rest == ["--help"], command
        get_args_parser().parse_args(rest)
    elif kind == "flag":
        _composed(command, tmp_path)  # --cfg job: the config it prints
    elif kind == "check_reward":
        cfg = _composed(command, tmp_path)
        cli.run_job(cfg, Console(file=sys.stdout, width=200))
        assert "agree" in capsys.readouterr().out
    elif kind == "smoke":
        code, output = _run_cli([*command.args, f"hydra.run.dir={tmp_path / 'run'}"], monkeypatch, capsys)
        assert code == 0 and "done: eval reward" in output, output[-3000:]
    else:
        _composed(command, tmp_path)


def test_a_drifted_command_or_a_stale_error_line_is_caught(tmp_path, capsys):
    # a key that does not exist, and a page's error line that the CLI no longer prints
    typo = DocCommand("page.md", 1, ["optim.lrr=1e-5"], REPO_ROOT, None)
    with pytest.raises(Exception, match="lrr"):
        _composed(typo, tmp_path)
    stale = DocCommand("page.md", 2, ["train.gradient_accumulation_steps=3"], REPO_ROOT, "some older wording")
    line = _cli_error(stale, tmp_path, capsys)
    assert line is not None and line.startswith("grpo-run: error: train.train_batch_size=16 is not divisible")
    assert not line.startswith(f"grpo-run: error: {stale.error}")
