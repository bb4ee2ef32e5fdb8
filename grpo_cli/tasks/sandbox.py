"""Running a model's Python code (the `python` tool of task=python_math) in a subprocess that cannot do much harm.

Each run is a fresh interpreter (`python -I -u`: isolated mode, so PYTHONPATH, the user's site-packages and the
current folder are not on its path) in a new, empty temporary folder that is removed afterwards, with:
- a CPU-time limit (RLIMIT_CPU: the kernel stops it with SIGXCPU) and a wall-clock limit (the caller kills its
  whole process group, for code that sleeps or waits);
- an address-space limit (RLIMIT_AS: a huge allocation raises MemoryError) and a file-size limit (RLIMIT_FSIZE);
- an output limit: at `max_output_bytes` of stdout and stderr together the output is cut and the program stopped;
- no sockets: a seccomp filter (Linux x86_64 and aarch64, no root needed) makes the `socket` system call (and
  io_uring, which can open sockets too) fail with EPERM for the program and anything it starts, and, on any
  platform, `socket.socket` is replaced by a class that refuses (the Python-level block, which code using ctypes
  could get around: the seccomp filter is what holds). `socket_block()` says which of the two this machine has.
The limits are set by the child itself (a prelude passed with `-c`, before the model's code runs), so the caller
needs no preexec_fn (unsafe in a threaded process). The prelude also asks for SIGKILL when its parent dies.

What this is not: a container. The code runs as the same user and can read what that user can read; for untrusted
code at scale use a real sandbox service (verl's SandboxFusion) through a tool of your own.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

# seccomp (linux/seccomp.h, linux/filter.h, linux/audit.h): the constants of a filter that refuses some calls.
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_ERRNO = 0x00050000
_EPERM = 1
_BPF_LD_W_ABS = 0x20
_BPF_JEQ_K = 0x15
_BPF_JGE_K = 0x35
_BPF_RET_K = 0x06
_X32_SYSCALL_BIT = 0x40000000
# platform.machine() -> (AUDIT_ARCH_*, the numbers of socket and io_uring_setup on it).
_SOCKET_SYSCALLS: dict[str, tuple[int, tuple[int, ...]]] = {
    "x86_64": (0xC000003E, (41, 425)),
    "aarch64": (0xC00000B7, (198, 425)),
}


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. wall_time_s also covers the interpreter's start (~0.05 s)."""

    cpu_time_s: int = 5
    wall_time_s: float = 10.0
    memory_mb: int = 1024
    max_output_bytes: int = 4096
    max_file_mb: int = 16


DEFAULT_LIMITS = SandboxLimits()


@dataclass(frozen=True)
class SandboxResult:
    """How a run went. `output`: stdout and stderr as written (decoded as UTF-8), cut at the output limit."""

    output: str
    exit_code: int | None  # negative: the signal that ended it; None: killed by the caller (time, output)
    timed_out: bool  # past the wall-clock limit (killed)
    cpu_exceeded: bool  # past the CPU-time limit (SIGXCPU)
    output_cut: bool  # more output than max_output_bytes (cut, and the program stopped)


def socket_filter(machine: str | None = None) -> bytes | None:
    """The seccomp BPF program (struct sock_filter[], native byte order) that makes socket() and io_uring_setup()
    fail with EPERM and allows everything else, for `machine` (default: this one); None where it is not known.
    System calls made through another ABI (32-bit int 0x80, x32) are all refused: no Python program uses them."""
    known = _SOCKET_SYSCALLS.get(machine or platform.machine())
    if known is None or not sys.platform.startswith("linux"):
        return None
    arch, blocked = known

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)

    refuse = op(_BPF_RET_K, _SECCOMP_RET_ERRNO | _EPERM)
    program = [op(_BPF_LD_W_ABS, 4), op(_BPF_JEQ_K, arch, jt=1), refuse]  # seccomp_data.arch
    program += [op(_BPF_LD_W_ABS, 0), op(_BPF_JGE_K, _X32_SYSCALL_BIT, jf=1), refuse]  # seccomp_data.nr
    for number in blocked:
        program += [op(_BPF_JEQ_K, number, jf=1), refuse]
    program.append(op(_BPF_RET_K, _SECCOMP_RET_ALLOW))
    return b"".join(program)


# Runs in the child before the model's code. argv: [settings JSON, the code's file]. Keeps to the standard library
# (isolated mode: grpo_cli may not be importable there). Each step that can fail says so on stderr only in the
# probe (socket_block); a run goes on with what it got.
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
    return seccomp
def _hook(kind, value, tb):
    import traceback
    report = traceback.TracebackException(kind, value, tb)
    report.stack = traceback.StackSummary.from_list([f for f in report.stack if f.filename != "<string>"])
    sys.stderr.write("".join(report.format()))
import json
_seccomp = _lock_down(json.loads(sys.argv[1]))
if sys.argv[2] == "--probe":
    print(_seccomp)
else:
    sys.excepthook = _hook
    _path = sys.argv[2]
    sys.argv = [_path]
    with open(_path, encoding="utf-8") as _file:
        _code = compile(_file.read(), _path, "exec")
    del _lock_down, _hook, _file, json
    exec(_code, {"__name__": "__main__", "__file__": _path, "__builtins__": __builtins__})
"""

# The file the model's code is saved as, in its temporary folder (tracebacks name it).
CODE_FILE = "main.py"


def _settings(limits: SandboxLimits) -> str:
    return json.dumps({**asdict(limits), "filter": (socket_filter() or b"").hex()})


def _environment(folder: str) -> dict[str, str]:
    """A small environment: no credentials or proxies of the caller's; one thread per numeric library."""
    threads = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8"} | (
        threads
    )


def run_python(code: str, limits: SandboxLimits = DEFAULT_LIMITS) -> SandboxResult:
    """Run `code` as a program in a fresh interpreter under `limits` (see the module's docstring) and return what
    it printed and how it ended. Its temporary folder is removed before this returns."""
    with tempfile.TemporaryDirectory(prefix="grpo-python-tool-", ignore_cleanup_errors=True) as folder:
        with open(os.path.join(folder, CODE_FILE), "w", encoding="utf-8") as f:
            f.write(code)
        process = subprocess.Popen(
            [sys.executable, "-I", "-u", "-c", _PRELUDE, _settings(limits), CODE_FILE],
            cwd=folder,
            env=_environment(folder),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a kill ends what it started too
        )
        try:
            output, timed_out, cut = _read_output(process, limits)
        finally:
            _kill_group(process)
    exit_code = None if (timed_out or cut) else process.returncode
    cpu_exceeded = exit_code == -signal.SIGXCPU
    text = output.decode("utf-8", errors="replace")
    return SandboxResult(text, exit_code, timed_out, cpu_exceeded, cut)


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


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(OSError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        process.kill()
    process.wait()
    if process.stdout is not None:
        process.stdout.close()


def describe_run(result: SandboxResult, limits: SandboxLimits = DEFAULT_LIMITS) -> str:
    """What the model reads back: the output, then a line saying why the run was stopped, if it was."""
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
        [sys.executable, "-I", "-c", _PRELUDE, _settings(DEFAULT_LIMITS), "--probe"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_environment(tempfile.gettempdir()),
    )
    state = probe.stdout.strip()
    return "seccomp and Python" if state == "on" else f"Python only (seccomp {state or probe.stderr.strip()[-200:]})"
