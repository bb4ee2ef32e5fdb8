"""Every `grpo-run` command in README.md and docs/ works as the page writes it, so a page that drifts from the CLI
fails here. The commands that run in seconds (`--help`, `--cfg job`, `job=check_reward`, the `debug=smoke`
run) are run, in this process; a command the page shows failing must fail with the line the page prints; every
other command is composed and validated as `grpo-run` does before a run starts (the first job of a sweep),
from the folder the page runs it in."""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra.types import RunMode
from omegaconf import OmegaConf
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
    commands = []
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
            folder = found.group(1) or next(
                (where for (name, word), where in FOLDERS.items() if name == page.name and word in words), "."
            )
            commands.append(
                DocCommand(page.relative_to(REPO_ROOT).as_posix(), number, words, REPO_ROOT / folder, error)
            )
    return commands


COMMANDS = doc_commands()


def _first_job(args: list[str]) -> list[str]:
    """The overrides of a command's first job: -m and hydra's own keys dropped, each swept key's first value."""
    first = []
    for arg in args:
        if arg.startswith("-") or arg.lstrip("+~").startswith("hydra"):
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


def _composed(command: DocCommand, tmp_path: Path):
    """The config `grpo-run` would run (its first job), checked as the CLI checks it before anything loads."""
    cli.check_plugin_extras(command.args)
    cli.check_group_choices(command.args)
    cli.check_sweep_preset(command.args)
    register_configs()
    loader = cli.hydra_loader_for(command.args)
    assert loader is not None, f"{command}: Hydra rejects the command line"
    config_loader, name, _, _ = loader
    overrides = [*_first_job(command.args), f"output_dir={tmp_path / 'run'}"]
    cfg = config_loader.load_configuration(name, overrides, run_mode=RunMode.RUN)
    del cfg["hydra"]
    config = OmegaConf.to_object(cfg)
    validate_config(config)
    return config


def _raises_user_error(action) -> str | None:
    """The message of the one-line error an action stops with (SystemExit from the CLI's checks included)."""
    try:
        action()
    except UserFacingError as error:
        return str(error)
    except SystemExit as stop:
        return str(stop.code) if stop.code not in (0, None) else None
    return None


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


def _kind(command: DocCommand) -> str:
    if command.error is not None:
        return "fails"
    if any(word in str(command) for word in PLACEHOLDERS):
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
    monkeypatch.chdir(command.cwd)
    kind = _kind(command)
    if kind == "fails":
        # The page shows it failing: it must fail before anything loads, with the line the page prints (the
        # start of it: a page may cut a long line).
        message = _raises_user_error(lambda: _composed(command, tmp_path))
        if message is None:  # a failure at run time (a reward, a rendezvous, a disk): the command composes
            return
        expected = command.error[:60]
        assert expected in message or expected in f"grpo-run: error: {message}", (
            f"{command}\n  page: {command.error}\n  now:  {message}"
        )
    elif kind == "placeholder":
        cli.check_group_choices(command.args)
    elif kind == "flag":
        code, output = _run_cli(command.args, monkeypatch, capsys)
        assert code == 0 and output.strip(), f"{command}: exit {code}\n{output[-2000:]}"
    elif kind == "check_reward":
        cfg = _composed(command, tmp_path)
        cli.run_job(cfg, Console(file=sys.stdout, width=200))
        assert "agree" in capsys.readouterr().out
    elif kind == "smoke":
        code, output = _run_cli([*command.args, f"hydra.run.dir={tmp_path / 'run'}"], monkeypatch, capsys)
        assert code == 0 and "done: eval reward" in output, output[-3000:]
    else:
        _composed(command, tmp_path)
