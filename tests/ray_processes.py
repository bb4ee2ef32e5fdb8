"""Which processes belong to the Ray of the run under test: the no-Ray-left checks of the Ray tests.

A test of a Ray strategy checks that its run leaves no process behind, however it ends. It must see only its own
run's processes: another Ray on the machine (a developer's `ray start`, another worker's test, CI's own jobs) is
none of its business, and a process of its run that outlived it must still fail it.

The `ray_installed` fixture (tests/conftest.py) gives each test a Ray temp dir of its own (RAY_TMPDIR, which
`ray.init` and `ray start` read) and sets RUN_TAG to that same path in the environment every process the test
starts inherits. A process is the run's when its environment carries the tag, or its command line or one of its
open files lies under the temp dir: Ray's helpers retitle themselves (`ray::DashboardAgent`, setproctitle writes
over the environment's memory), but each keeps its session's log files open.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

# The environment variable that tags a test's processes; its value is the test's Ray temp dir.
RUN_TAG = "GRPO_CLI_TEST_RAY_RUN"


@dataclass(frozen=True)
class ProcessInfo:
    """What /proc says of one process (state "Z": a zombie, gone but not reaped)."""

    pid: int
    state: str
    cmdline: str
    environ: tuple[str, ...]  # KEY=value
    files: tuple[str, ...]  # the paths of its open file descriptors


def belongs_to(process: ProcessInfo, tag: str) -> bool:
    """Is `process` a live process of the run tagged `tag` (its Ray temp dir)?"""
    if process.state == "Z":
        return False
    root = tag.rstrip("/")
    return (
        f"{RUN_TAG}={tag}" in process.environ
        or root in process.cmdline  # a unique mkdtemp name: a substring means this dir
        or any(path == root or path.startswith(root + "/") for path in process.files)
    )


def _read(pid: int) -> ProcessInfo | None:
    proc = Path(f"/proc/{pid}")
    try:
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        environ = (proc / "environ").read_bytes().decode(errors="replace").split("\0")
        files = []
        for fd in (proc / "fd").iterdir():
            with contextlib.suppress(OSError):  # closed between the listing and the read
                files.append(os.readlink(fd))
    except OSError:  # it exited, or it is not ours to read
        return None
    return ProcessInfo(pid, state, cmdline, tuple(environ), tuple(files))


def read_processes() -> Iterator[ProcessInfo]:
    """Every process of this machine that can be read."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (info := _read(int(entry.name))) is not None:
            yield info


def run_processes(tag: str, processes: Iterable[ProcessInfo] | None = None) -> set[int]:
    """The live processes of the run tagged `tag`, this one excepted (the test that set the tag)."""
    listed = read_processes() if processes is None else processes
    return {p.pid for p in listed if p.pid != os.getpid() and belongs_to(p, tag)}


def current_tag() -> str:
    """The tag of the test running now (set by the `ray_installed` fixture)."""
    tag = os.environ.get(RUN_TAG)
    assert tag, "the no-Ray-left check needs the ray_installed fixture (it tags the test's processes)"
    return tag


def assert_no_ray_left(
    tag: str | None = None,
    timeout_s: float = 20.0,
    processes: Callable[[], Iterable[ProcessInfo]] = read_processes,
) -> None:
    """Every process of the run tagged `tag` (default: the current test's) is gone within `timeout_s` (Ray's
    helpers take a few seconds to go after `ray.shutdown()`)."""
    tag = tag or current_tag()
    deadline = time.monotonic() + timeout_s
    while (left := run_processes(tag, processes())) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"Ray processes outlived the run: {describe(left)}"


def describe(pids: Iterable[int]) -> str:
    """`pid (command line)` of each, for a failure message."""
    shown = []
    for pid in sorted(pids):
        info = _read(pid)
        shown.append(f"{pid} ({info.cmdline[:80] if info else 'gone'})")
    return ", ".join(shown)


def kill_run_processes(tag: str) -> None:
    """SIGKILL every process of the run tagged `tag`: a test's teardown, so that a failed test leaves nothing
    running either (never `ray stop`: it stops every Ray on the machine)."""
    for pid in run_processes(tag):
        with contextlib.suppress(OSError):  # it exited meanwhile
            os.kill(pid, signal.SIGKILL)


def free_port() -> int:
    """A port free on 127.0.0.1 now (for a test's own `ray start --head --port`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
