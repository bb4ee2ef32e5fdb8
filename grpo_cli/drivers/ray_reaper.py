"""A sentinel that stops the local Ray of a run if the run itself is killed (SIGKILL, the OOM killer).

`ray.shutdown()` in a `finally` covers every way a run ends except being killed outright. Then Ray's raylet and
workers go down with it, but helper processes (ray::DashboardAgent, ray::RuntimeEnvAgent) were seen here to
outlive it by a minute or more, re-parented to PID 1. The driver starts this sentinel with a pipe on its stdin.
While the pipe is open, the sentinel notes every Ray process descended from the driver (every 2 s); when it
closes (the driver exited, however it exited), it kills those still alive, then exits. It never touches a
process that is not a Ray process the driver started (another run's Ray included).

Standard library only, so it starts in well under a second and holds little memory. Linux only (/proc);
elsewhere it does nothing.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

RAY_MARKERS = ("ray::", "raylet", "gcs_server", "default_worker.py")
POLL_S = 2.0


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of a live process, or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), int(fields[19])


def ray_descendants(root: int) -> dict[int, int]:
    """Ray processes below `root` in the process tree: {pid: start time} (the start time guards against a
    recycled pid)."""
    children: dict[int, list[int]] = {}
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            stats[int(entry.name)] = stat
            children.setdefault(stat[1], []).append(int(entry.name))
    found, stack = {}, list(children.get(root, []))
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(marker in cmdline for marker in RAY_MARKERS):
            found[pid] = stats[pid][2]
    return found


def start_sentinel() -> subprocess.Popen[bytes] | None:
    """Start the sentinel for this process; keep the returned handle for the run's lifetime."""
    if not Path("/proc/self/stat").exists():
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "grpo_cli.drivers.ray_reaper", str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def stop_sentinel(sentinel: subprocess.Popen[bytes] | None) -> None:
    """After ray.shutdown(): close the pipe so the sentinel sweeps up stragglers and exits."""
    if sentinel is None:
        return
    if sentinel.stdin is not None:  # always: start_sentinel opens the pipe
        sentinel.stdin.close()
    try:
        sentinel.wait(timeout=10)
    except subprocess.TimeoutExpired:
        sentinel.kill()


def main(driver_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: outlive it, sweep after
    known: dict[int, int] = {}
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if readable and not os.read(sys.stdin.fileno(), 1024):
            break  # the driver closed the pipe, or died
        known.update(ray_descendants(driver_pid))
    for pid, started in known.items():
        stat = _stat(pid)
        if stat is not None and stat[0] != "Z" and stat[2] == started:
            with contextlib.suppress(OSError):  # it exited between the check and the kill
                os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main(int(sys.argv[1]))
