"""A pids and a memory cgroup per sandboxed run (grpo_cli/sandbox/__init__.py), where this process may make one.

Why: RLIMIT_NPROC does not bind a program whose real user is root outside its user namespace (the kernel exempts
uid 0), and RLIMIT_AS bounds each process alone (three children of 200 MB each are 600 MB). A cgroup bounds the
process count and the memory of the whole tree, its files in tmpfs included.

Where: cgroup v1 (a `pids` and a `memory` hierarchy, each used where this process may make a child of its own
cgroup) or cgroup v2 (a child of this process's cgroup whose `cgroup.controllers` offers pids and memory: only
where the parent delegates them, e.g. under `systemd-run --user --scope -p Delegate=yes`). Elsewhere `make`
returns what it could make and says which bound is missing, for one log line.

    group = make_cgroup(max_processes=64, memory_bytes=1 << 30)   # a Cgroup (maybe empty) and what it lacks
    argv = join_command(group, argv)      # the command that enters the cgroups before it execs `argv`
    group.remove()                        # kill whatever is left in them, then remove them
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

_PREFIX = "grpo-sandbox-"
_COUNTER = itertools.count()
# Enter each cgroup ($1 ... up to --), then exec the rest. Before the exec nothing of the command runs, so every
# process it starts is born inside. Exit code 125: a cgroup could not be entered.
_JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
JOIN_FAILED = 125


@dataclass
class Cgroup:
    """The cgroup folders made for one run (none, one per v1 controller, or one v2 folder) and the bounds missing."""

    folders: list[Path] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # "pids (why)", "memory (why)"

    def remove(self) -> None:
        """SIGKILL every process left in the folders, wait until they are empty, and remove them."""
        for folder in self.folders:
            _empty_and_remove(folder)
        self.folders.clear()


def join_command(group: Cgroup, argv: list[str]) -> list[str]:
    """`argv` started through /bin/sh so that it runs inside `group`'s cgroups (`argv` itself where there are none).
    A run that is root enters them in sandbox_privileges.DROP_STEP instead, before it drops to task.sandbox.uid."""
    if not group.folders:
        return argv
    return ["/bin/sh", "-c", _JOIN, "sh", *(str(f / "cgroup.procs") for f in group.folders), "--", *argv]


def make_cgroup(max_processes: int, memory_bytes: int) -> Cgroup:
    """New cgroups bounding a run to `max_processes` processes (threads count too) and `memory_bytes` of memory."""
    group = Cgroup()
    places = _places()
    for controller, limit in (("pids", max_processes), ("memory", memory_bytes)):
        place = places.get(controller)
        if isinstance(place, str):
            group.missing.append(f"{controller} ({place})")
            continue
        assert place is not None
        version, parent = place
        if version == 2 and group.folders and group.folders[-1].parent == parent:
            folder = group.folders[-1]  # v2: one folder holds both controllers
        else:
            folder = parent / f"{_PREFIX}{os.getpid()}-{next(_COUNTER)}"
            try:
                folder.mkdir()
            except OSError as e:
                group.missing.append(f"{controller} (cannot make {folder}: {e.strerror})")
                continue
            group.folders.append(folder)
        try:
            _set_limit(folder, version, controller, limit)
        except OSError as e:
            group.missing.append(f"{controller} (cannot set its limit in {folder}: {e.strerror})")
    return group


def _set_limit(folder: Path, version: int, controller: str, limit: int) -> None:
    if controller == "pids":
        (folder / "pids.max").write_text(str(limit))
    elif version == 1:
        (folder / "memory.limit_in_bytes").write_text(str(limit))
        swap = folder / "memory.memsw.limit_in_bytes"  # memory and swap together: no escape into swap
        if swap.exists():
            swap.write_text(str(limit))
    else:
        (folder / "memory.max").write_text(str(limit))
        with contextlib.suppress(OSError):
            (folder / "memory.swap.max").write_text("0")


@functools.cache
def _places() -> dict[str, tuple[int, Path] | str]:
    """controller -> (cgroup version, the folder new cgroups go in), or why there is none. Also removes the
    empty cgroups a run that was killed left behind (their maker's pid is gone)."""
    places: dict[str, tuple[int, Path] | str] = {}
    try:
        own = _own_cgroups()
        mounts = _cgroup_mounts()
    except OSError as e:
        return {c: f"cannot read this process's cgroups: {e.strerror}" for c in ("pids", "memory")}
    for controller in ("pids", "memory"):
        place: tuple[int, Path] | str = "no cgroup hierarchy offers it"
        for version, controllers, root, mountpoint in mounts:
            if version == 1 and controller in controllers and controller in own:
                place = (1, _inside(mountpoint, root, own[controller]))
                break
        else:
            v2 = [(root, mountpoint) for version, _, root, mountpoint in mounts if version == 2]
            if v2 and "" in own:
                parent = _inside(v2[0][1], v2[0][0], own[""])
                try:
                    offered = (parent / "cgroup.subtree_control").read_text().split()
                except OSError as e:
                    place = f"cannot read {parent}/cgroup.subtree_control: {e.strerror}"
                else:
                    delegated = controller in offered
                    place = (2, parent) if delegated else f"cgroup v2 at {parent} does not delegate it to this process"
        if not isinstance(place, str) and not os.access(place[1], os.W_OK):
            place = f"{place[1]} is not writable by this user"
        places[controller] = place
    _sweep(places)
    return places


def remove_stale() -> None:
    """Remove the cgroups of runs whose maker was killed (its pid is gone), and kill what is left in them (done
    once per process on first use; a worker killed at its time limit leaves its program's behind)."""
    _sweep(_places())


def _sweep(places: dict[str, tuple[int, Path] | str]) -> None:
    for place in places.values():
        if not isinstance(place, str):
            _remove_stale(place[1])


def _own_cgroups() -> dict[str, str]:
    """controller -> this process's cgroup path (v1), "" -> its v2 path."""
    own: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            own[controller] = path
    return own


def _cgroup_mounts() -> list[tuple[int, set[str], str, Path]]:
    """(version, controllers, the mount's root in its hierarchy, where it is mounted) of each cgroup mount."""
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] == "cgroup":
            mounts.append((1, set(tail[2].split(",")), fields[3], Path(fields[4])))
        elif tail[0] == "cgroup2":
            mounts.append((2, set(), fields[3], Path(fields[4])))
    return mounts


def _inside(mountpoint: Path, root: str, path: str) -> Path:
    """The folder of cgroup `path` under a mount of the hierarchy's `root`."""
    relative = os.path.relpath(path, root) if path.startswith(root) else "."
    return (mountpoint / relative).resolve() if relative != "." else mountpoint


def _remove_stale(parent: Path) -> None:
    with contextlib.suppress(OSError):
        for folder in parent.glob(f"{_PREFIX}*"):
            pid = folder.name[len(_PREFIX) :].split("-")[0]
            if pid.isdigit() and not _alive(int(pid)):
                _empty_and_remove(folder, patience_s=0.5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _empty_and_remove(folder: Path, patience_s: float = 5.0) -> None:
    deadline = time.monotonic() + patience_s
    kill_file = folder / "cgroup.kill"  # v2, Linux 5.14+: the kernel kills the whole group
    while True:
        try:
            pids = [int(p) for p in (folder / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return
        if not pids:
            break
        if kill_file.exists():
            with contextlib.suppress(OSError):
                kill_file.write_text("1")
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            return  # left for the next run's sweep (_remove_stale)
        time.sleep(0.01)
    with contextlib.suppress(OSError):
        folder.rmdir()
