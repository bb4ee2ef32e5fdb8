"""Under root, a sandboxed program runs as an unprivileged host uid (task.sandbox.uid, 65534 by default), at both
isolation levels (grpo_cli/sandbox/__init__.py).

Why (issue #48): started by root, bwrap's user namespace maps the program's uid 1000 to host uid 0. Its
capabilities are gone, but the kernel judges writes to /proc/sys by the host uid, so model-written code could
write kernel.core_pattern (a known way to run a program as host root) and vm/drop_caches. A process-level program
started by root simply was root.

How: when this process is root, the command is started through DROP_STEP, a few lines this interpreter runs as
root (standard library only), which
1. enters the run's cgroups, while still root (cgroup v2 needs write access to the common ancestor's cgroup.procs);
2. where a folder on the way to what the command needs (the interpreter, its libraries, the packages, bwrap) is not
   searchable by that uid (pyenv, uv and conda installs under /root, which is drwx------), makes itself a private
   mount namespace in which a small tmpfs covers that folder and binds back only the entries on the way; nothing
   of it reaches the machine's own mounts (/ is made private first);
3. drops every supplementary group, then the gid and the uid (real, effective and saved), checks that no
   capability is left and that uid 0 cannot be taken back, and execs the command: bwrap, which then makes an
   unprivileged user namespace mapping 1000 to that uid (and nothing to host root), or the program itself
   (isolation=process).
Each step that fails writes one line naming it to stderr and exits with DROP_FAILED; the start-up probe
(sandbox.require) turns that into one error line. A run that is not root starts the command as before.

    spec = drop_spec(uid=65534, needed=paths, cgroup_procs=procs)   # None: not root, start `argv` itself
    argv = drop_command(spec, argv)
"""

from __future__ import annotations

import functools
import os
import stat
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from grpo_cli.sandbox.settings import DEFAULT_UID

# The largest uid the kernel accepts ((uid_t) -1 is "no change").
MAX_UID = 2**32 - 2
# The exit code of DROP_STEP when a step fails (the cgroup join's code before it, kept: callers check one code).
DROP_FAILED = 125

# Run as root by this interpreter (-I -S) before the command. argv (drop_command writes it; no json, whose import
# costs ~30 ms a call): uid, gid, the number of cgroup.procs files and each, the number of covers and each as
# folder, number of names, names; then "--" and the command.
DROP_STEP = r"""
import os, stat, sys
def fail(what, error=None):
    why = (": " + (error.strerror or str(error))) if error is not None else ""
    sys.stderr.write("grpo-cli sandbox: cannot %s%s\n" % (what, why))
    sys.stderr.flush()
    os._exit(125)
words = iter(sys.argv[1:])
def take(n):
    return [next(words) for _ in range(n)]
uid, gid = int(next(words)), int(next(words))
spec = {"cgroup_procs": take(int(next(words))), "covers": []}
for _ in range(int(next(words))):
    folder = next(words)
    spec["covers"].append((folder, take(int(next(words)))))
if next(words) != "--":
    fail("read its arguments")
command = list(words)
for procs in spec["cgroup_procs"]:
    try:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    except OSError as e:
        fail("enter the cgroup " + procs, e)
if spec["covers"]:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    def check(code, what):
        if code != 0:
            errno = ctypes.get_errno()
            fail(what, OSError(errno, os.strerror(errno)))
    check(libc.unshare(0x00020000), "make a private mount namespace (CLONE_NEWNS)")
    check(libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None), "make / private (MS_REC | MS_PRIVATE)")
    # What goes back under each cover, opened before any cover hides it, and in this namespace (a bind's source
    # must be one of its own mounts).
    try:
        kept = [[os.open(os.path.join(folder, name), os.O_PATH | os.O_CLOEXEC) for name in names]
                for folder, names in spec["covers"]]
    except OSError as e:
        fail("open " + str(e.filename), e)
    for (folder, names), fds in zip(spec["covers"], kept):
        # MS_NOSUID | MS_NODEV | MS_NOEXEC; 0711: searchable, not listable.
        options = b"mode=0711,size=64k"
        check(libc.mount(b"tmpfs", folder.encode(), b"tmpfs", 0x2 | 0x4 | 0x8, options), "cover " + folder)
        for name, fd in zip(names, fds):
            target = os.path.join(folder, name)
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                os.mkdir(target)
            else:
                open(target, "x").close()
            check(libc.mount(b"/proc/self/fd/%d" % fd, target.encode(), None, 0x1000 | 0x4000, None), "bind " + target)
            os.close(fd)
try:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
except OSError as e:
    fail("drop privileges to uid %d, gid %d" % (uid, gid), e)
if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
    fail("drop privileges: left with uids %s, gids %s, groups %s" % (os.getresuid(), os.getresgid(), os.getgroups()))
with open("/proc/self/status") as f:
    caps = [line.split()[1] for line in f if line.startswith(("CapPrm", "CapEff", "CapAmb"))]
if any(int(c, 16) for c in caps):
    fail("drop privileges: capabilities left (%s)" % " ".join(caps))
try:
    os.setuid(0)
except OSError:
    pass
else:
    fail("drop privileges: uid 0 could be taken back")
os.execv(command[0], command)
"""


def running_as_root() -> bool:
    """Whether this process is root, so that a sandboxed program must be started through DROP_STEP."""
    return os.geteuid() == 0


def uid_problem(uid: object) -> str | None:
    """What is wrong with `uid` as task.sandbox.uid (None: nothing): an integer in 1..MAX_UID."""
    if isinstance(uid, bool) or not isinstance(uid, int):
        return f"task.sandbox.uid={uid!r}: give an integer uid, e.g. {DEFAULT_UID} (nobody)"
    if uid == 0:
        return (
            f"task.sandbox.uid=0: sandboxed programs must not run as root; give an unprivileged uid, e.g. "
            f"{DEFAULT_UID} (nobody)"
        )
    if not 1 <= uid <= MAX_UID:
        return f"task.sandbox.uid={uid}: a uid is between 1 and {MAX_UID}; e.g. {DEFAULT_UID} (nobody)"
    return None


@dataclass(frozen=True)
class DropSpec:
    """What DROP_STEP does: the ids it drops to, the cgroups it enters first, the folders it covers (a folder the uid
    cannot search -> the entries under it bound back)."""

    uid: int
    gid: int
    cgroup_procs: tuple[str, ...] = ()
    covers: tuple[tuple[str, tuple[str, ...]], ...] = ()


def drop_spec(uid: int, needed: Iterable[str], cgroup_procs: Sequence[str] = ()) -> DropSpec | None:
    """The privilege drop for a command that reads `needed` (paths) as uid `uid` (gid of the same number), entering
    `cgroup_procs` first; None where this process is not root (the command starts as it is)."""
    if not running_as_root():
        return None
    return DropSpec(uid, uid, tuple(cgroup_procs), covers(tuple(sorted(set(needed))), uid, uid))


def drop_command(spec: DropSpec, argv: Sequence[str]) -> list[str]:
    """`argv` started through DROP_STEP with `spec` (by this interpreter, which root can read)."""
    words = [str(spec.uid), str(spec.gid), str(len(spec.cgroup_procs)), *spec.cgroup_procs, str(len(spec.covers))]
    for folder, names in spec.covers:
        words += [folder, str(len(names)), *names]
    return [os.path.realpath(sys.executable), "-I", "-S", "-c", DROP_STEP, *words, "--", *argv]


@functools.lru_cache(maxsize=16)
def covers(needed: tuple[str, ...], uid: int, gid: int) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The folders on the way to `needed` (their real paths) that `uid`/`gid` cannot search, outermost first, each
    with the names under it that lead on. DROP_STEP covers each with a tmpfs it can search and binds those back;
    a folder deeper down the same way is covered after (its bound copy). Access control lists are not read: a
    folder they open is covered all the same (harmless), one they close is found by the probe."""
    found: dict[str, set[str]] = {}
    for path in needed:
        parts = Path(os.path.realpath(path)).parts
        for depth in range(1, len(parts)):
            folder = os.path.join(*parts[:depth])
            try:
                info = os.stat(folder)
            except OSError:
                break
            if not _searchable(info, uid, gid):
                found.setdefault(folder, set()).add(parts[depth])
    return tuple((folder, tuple(sorted(names))) for folder, names in sorted(found.items(), key=lambda f: len(f[0])))


def _searchable(info: os.stat_result, uid: int, gid: int) -> bool:
    """Whether a process of `uid`/`gid` with no supplementary group may search a folder (its mode bits)."""
    if info.st_uid == uid:
        return bool(info.st_mode & stat.S_IXUSR)
    if info.st_gid == gid:
        return bool(info.st_mode & stat.S_IXGRP)
    return bool(info.st_mode & stat.S_IXOTH)


def drop_failure(output: bytes) -> str | None:
    """The line DROP_STEP wrote where a step failed (None where it did not)."""
    for line in output.decode(errors="replace").splitlines():
        if line.startswith("grpo-cli sandbox: cannot "):
            return line[len("grpo-cli sandbox: ") :]
    return None


@dataclass(frozen=True)
class HostIds:
    """A process's ids as the host sees them (/proc/<pid>/status read from the run): real, effective, saved and
    filesystem uids and gids, and its supplementary groups."""

    uids: tuple[int, ...]
    gids: tuple[int, ...]
    groups: tuple[int, ...]


def host_ids(pid: int, marker: str) -> HostIds | None:
    """The host ids of the interpreter started under `pid` (itself or a descendant: DROP_STEP and bwrap come
    between) whose command line holds `marker` (the prelude); None while it has not started."""
    interpreter = os.path.realpath(sys.executable).encode()
    marked, step = marker.encode(), DROP_STEP.encode()
    waiting = [pid]
    while waiting:
        current = waiting.pop()
        try:
            parts = Path(f"/proc/{current}/cmdline").read_bytes().split(b"\0")
            if parts[0] == interpreter and marked in parts and step not in parts:
                return _status_ids(Path(f"/proc/{current}/status").read_text())
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except (OSError, KeyError, ValueError, IndexError):
            continue
        waiting += [int(c) for c in children]
    return None


def _status_ids(status: str) -> HostIds:
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    uids, gids, groups = (tuple(int(n) for n in fields[key].split()) for key in ("Uid", "Gid", "Groups"))
    return HostIds(uids, gids, groups)


def root_owned() -> list[str]:
    """Files a program sees at their own path (at both levels) that host root owns: inside, one that shows as the
    program's own uid means its uid is host root's (the prelude's probe looks)."""
    owned = []
    for path in (os.path.realpath(sys.executable), "/usr/lib", "/etc/ld.so.cache"):
        try:
            if os.lstat(path).st_uid == 0:
                owned.append(path)
        except OSError:
            continue
    return owned


# Writable by their mode to every uid, yet refused to a program without CAP_SYS_ADMIN (or CAP_CHECKPOINT_RESTORE)
# over its pid namespace, which a dropped uid never has: the kernel checks that capability on each write.
CAPABILITY_GUARDED = frozenset({"/proc/sys/kernel/ns_last_pid"})


def privilege_problem(
    ids: HostIds | None, as_root: Sequence[str], writable: Sequence[str], spec: DropSpec | None
) -> str | None:
    """Why a started sandbox must not be used (None: it may), in words that follow "the sandbox": its program is
    host root (its host uid from outside, or a file host root owns showing as its own), kept root's group or
    another after dropping, or could write a kernel setting (access() only: nothing is written)."""
    if ids is None:
        return "started, but its program's host uid could not be read (/proc/<pid>/status)"
    if 0 in ids.uids or as_root:
        how = f"{as_root[0]}, owned by host root, is its own" if as_root else f"/proc/<pid>/status: Uid {ids.uids}"
        return (
            f"runs programs as host root (host uid 0: {how}); from there a program can write kernel settings such "
            "as /proc/sys/kernel/core_pattern"
        )
    if spec is not None and (0 in ids.gids or ids.groups):
        return f"kept groups after dropping to uid {spec.uid} (gids {ids.gids}, groups {ids.groups})"
    open_settings = [path for path in writable if path not in CAPABILITY_GUARDED]
    if open_settings:
        who = f"uid {spec.uid}" if spec is not None else "this user"
        return f"leaves kernel settings writable to its programs (as {who}): {', '.join(open_settings)}"
    return None
