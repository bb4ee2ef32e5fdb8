"""Deprecation and future warnings that a call of ours causes, as failures; those no call of ours causes, listed.

A warning is ours when a frame of grpo_cli/ is anywhere on the stack that emits it, not only where the warning
says it is: transformers reports `past_key_values is deprecated` from a decorator with stacklevel=2, which lands
in torch's nn/modules/module.py, so a filter by module (`-W error::FutureWarning:grpo_cli`) never sees it. The
stack exists only while the warning is being shown, so the watch replaces `warnings.showwarning` (the documented
hook, which pytest's own recording and the default printer both go on to receive) and walks the frames there.
.ci/readme_install runs the newest releases under it (issue #49): a release that deprecates something we call
fails CI while the old spelling still works, instead of being dropped silently later.

One implementation, two ways in:

- pytest: ``-p tests.own_warnings`` watches every test's setup, call and teardown; a phase during which one of
  ours was shown fails, naming it and our innermost frame, and the summary lists the others;
- a command: ``python -m tests.own_warnings grpo-run ARGS...`` runs the real entrypoint in this process under the
  same watch; it exits 1 when one of ours was shown, else with the run's own status, and lists the others.

Not covered: warnings in other processes (reward workers, Ray actors, vLLM's engine core) and warnings at import
or collection time; code that chooses to ignore a warning (a `warnings.filterwarnings("ignore", ...)` of its own)
keeps it hidden, since its filter comes before the watch's.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import FrameType
from typing import TextIO

import pytest

import grpo_cli

PACKAGE = Path(grpo_cli.__file__).resolve().parent
CATEGORIES: tuple[type[Warning], ...] = (DeprecationWarning, FutureWarning)


@dataclass(frozen=True)
class Shown:
    """One warning as shown: its category and text, where it says it is, and our innermost frame on its stack."""

    category: str
    message: str
    location: str  # the warning's own file:line (after its stacklevel)
    ours: str | None  # grpo_cli/...:line (function), the frame of ours nearest the warning; None when none

    def describe(self) -> str:
        cause = f"from our call at {self.ours}" if self.ours else "no call of ours on its stack"
        return f"{self.category} ({cause}; reported at {self.location}): {self.message}"


@lru_cache(maxsize=4096)
def _is_ours(filename: str) -> bool:
    return os.path.realpath(filename).startswith(f"{PACKAGE}{os.sep}")


def our_frame(frame: FrameType | None) -> str | None:
    """The innermost frame of grpo_cli/ from `frame` outwards, as grpo_cli/<path>:<line> (<function>), or None."""
    while frame is not None:
        if _is_ours(frame.f_code.co_filename):
            relative = Path(os.path.realpath(frame.f_code.co_filename)).relative_to(PACKAGE.parent)
            return f"{relative}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return None


@dataclass
class Watch:
    """Every DeprecationWarning / FutureWarning shown while :meth:`active`, in order."""

    shown: list[Shown] = field(default_factory=list)

    @contextmanager
    def active(self) -> Iterator[Watch]:
        with warnings.catch_warnings():  # restores the filters and showwarning on the way out
            # Shown every time, not once per location, and DeprecationWarning not hidden outside __main__ (Python's
            # default); filters the code under test adds later still come first.
            for category in CATEGORIES:
                warnings.simplefilter("always", category)
            previous = warnings.showwarning

            def show(
                message: Warning | str,
                category: type[Warning],
                filename: str,
                lineno: int,
                file: TextIO | None = None,
                line: str | None = None,
            ) -> None:
                if issubclass(category, CATEGORIES):
                    # _getframe(1): warnings._showwarnmsg, then whoever called warnings.warn, and so on outwards
                    ours = our_frame(sys._getframe(1))
                    self.shown.append(Shown(category.__name__, str(message), f"{filename}:{lineno}", ours))
                previous(message, category, filename, lineno, file, line)

            warnings.showwarning = show
            yield self

    @property
    def ours(self) -> list[Shown]:
        return _unique(s for s in self.shown if s.ours)

    @property
    def others(self) -> list[Shown]:
        return _unique(s for s in self.shown if not s.ours)


def _unique(shown: Iterator[Shown] | list[Shown]) -> list[Shown]:
    return list(dict.fromkeys(shown))


def report(watch: Watch, write: Callable[[str], object]) -> None:
    """Write the watch's warnings: ours (each one a failure) and the others (listed, not failed)."""
    for shown in watch.ours:
        write(f"own-warnings: FAILED: {shown.describe()}")
    others = watch.others
    if others:
        write(f"own-warnings: {len(others)} warning(s) no call of ours causes (listed, not failed):")
        for shown in others:
            write(f"  {shown.describe()}")


# --- pytest: -p tests.own_warnings -------------------------------------------------------------------------------

_PHASES = pytest.StashKey[dict[str, Watch]]()
_SESSION = pytest.StashKey[Watch]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_SESSION] = Watch()


@contextmanager
def _watched(item: pytest.Item, when: str) -> Iterator[None]:
    watch = Watch()
    item.stash.setdefault(_PHASES, {})[when] = watch
    try:
        with watch.active():
            yield
    finally:
        item.config.stash[_SESSION].shown.extend(watch.shown)


# Each phase runs inside pytest's own catch_warnings (its pytest_runtest_protocol wrapper, which resets showwarning
# for every test), so the watch goes on inside it, phase by phase.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _watched(item, "setup"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _watched(item, "call"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    with _watched(item, "teardown"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    watch = item.stash.get(_PHASES, {}).get(call.when)
    ours = watch.ours if watch is not None else []
    if ours and not report.failed:
        # A failure even when the code went on: the old spelling still works today, and is what breaks next.
        report.outcome = "failed"
        report.longrepr = "\n".join(f"a warning from our own call: {shown.describe()}" for shown in ours)
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    watch = terminalreporter.config.stash.get(_SESSION, None)
    if watch is not None and watch.shown:
        terminalreporter.section("own warnings (tests/own_warnings.py)")
        report(watch, terminalreporter.write_line)


# --- a command: python -m tests.own_warnings grpo-run ARGS... ----------------------------------------------------


def run_watched(entry: Callable[[], object], write: Callable[[str], object]) -> int:
    """Run `entry` under a watch: 1 when a warning of ours was shown, else the status it exited with."""
    watch = Watch()
    status: int = 0
    with watch.active():
        try:
            entry()
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    report(watch, write)
    return 1 if watch.ours else status


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "grpo-run":
        print("usage: python -m tests.own_warnings grpo-run ARGS...", file=sys.stderr)
        return 2
    from grpo_cli.cli import main as grpo_run

    sys.argv = argv  # the entrypoint reads its arguments from sys.argv, as the console script does
    return run_watched(grpo_run, lambda text: print(text, file=sys.stderr))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
