"""What every sandboxed program starts under, at either isolation level (grpo_cli/sandbox/__init__.py): the prelude, run
by the interpreter before the program's code, that sets the per-process limits, installs the seccomp filter and
refuses sockets; the filter itself (a BPF program built here for this machine's system call numbers); and the
program's small environment. sandbox/__init__.py's docstring says what each of them stops.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import struct
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from grpo_cli.sandbox.settings import DEFAULT_LIMITS, SandboxLimits

# seccomp (linux/seccomp.h, linux/filter.h, linux/audit.h): the constants of a filter that refuses some calls.
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_ERRNO = 0x00050000
_EPERM = 1
_BPF_LD_W_ABS = 0x20
_BPF_JEQ_K = 0x15
_BPF_JGE_K = 0x35
_BPF_RET_K = 0x06
_X32_SYSCALL_BIT = 0x40000000
# The system calls the filter refuses: name -> (its number on x86_64, asm/unistd_64.h; on aarch64,
# asm-generic/unistd.h), one row a call (tests/unit/sandbox/test_sandbox.py checks them against the kernel's headers).
_BLOCKED: dict[str, tuple[int, int]] = {
    "socket": (41, 198),
    "socketpair": (53, 199),
    "io_uring_setup": (425, 425),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "pidfd_open": (434, 434),
    "pidfd_getfd": (438, 438),
    "kcmp": (312, 272),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "userfaultfd": (323, 282),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
}
BLOCKED_SYSCALLS: tuple[str, ...] = tuple(_BLOCKED)
# platform.machine() -> (AUDIT_ARCH_*, {name: number}).
SYSCALL_NUMBERS: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (0xC000003E, {name: numbers[0] for name, numbers in _BLOCKED.items()}),
    "aarch64": (0xC00000B7, {name: numbers[1] for name, numbers in _BLOCKED.items()}),
}


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
PRELUDE = r"""
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
def _privileges(root_owned):
    # Read only, never written: the host uids the program's uid maps to (/proc/self/uid_map), which of
    # `root_owned` (files host root owns) show as its own, and the kernel settings it could write.
    import os
    uid = os.getuid()
    host = []
    with open("/proc/self/uid_map") as f:
        for line in f:
            inside, outside, count = (int(n) for n in line.split())
            if inside <= uid < inside + count:
                host.append(outside + uid - inside)
    as_root = [p for p in root_owned if os.path.lexists(p) and os.lstat(p).st_uid == uid]
    writable = [p for p in ("/proc/sysrq-trigger",) if os.access(p, os.W_OK)]
    for folder, _, names in os.walk("/proc/sys"):
        writable += [os.path.join(folder, n) for n in names if os.access(os.path.join(folder, n), os.W_OK)]
    return {"host_uids": host, "as_root": as_root, "writable": writable[:3], "groups": os.getgroups()}
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
    print(json.dumps([_seccomp, os.getuid(), os.getgid(), _privileges(json.loads(sys.argv[1])["root_owned"])]))
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


def prelude_settings(limits: SandboxLimits, path: str, root_owned: Sequence[str] = ()) -> str:
    """The prelude's first argument: the limits, the seccomp filter, the packages' folder, and for the probe the
    files host root owns that the program can see (how it tells whether its uid is host root's)."""
    data = {**asdict(limits), "filter": (socket_filter() or b"").hex(), "path": path, "root_owned": list(root_owned)}
    return json.dumps(data)


def program_environment(folder: str) -> dict[str, str]:
    """A small environment: none of the caller's variables; one thread per numeric library."""
    threads = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    path = os.path.dirname(os.path.realpath(sys.executable))
    return {"PATH": path, "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8"} | threads


@dataclass(frozen=True)
class ProbeReport:
    """What the prelude's probe found inside: the seccomp state, its uid and gid, the host uids its uid maps to,
    the files host root owns that show as its own uid, the kernel settings it could write (the first few), and
    its supplementary groups."""

    seccomp: str
    uid: int
    gid: int
    host_uids: tuple[int, ...]
    as_root: tuple[str, ...]
    writable: tuple[str, ...]
    groups: tuple[int, ...]


def probe_report(stdout: bytes) -> ProbeReport | None:
    """The report the prelude's probe printed; None for anything else."""
    try:
        seccomp, uid, gid, privileges = json.loads(stdout)
        return ProbeReport(
            str(seccomp),
            int(uid),
            int(gid),
            tuple(int(u) for u in privileges["host_uids"]),
            tuple(str(p) for p in privileges["as_root"]),
            tuple(str(p) for p in privileges["writable"]),
            tuple(int(g) for g in privileges["groups"]),
        )
    except (ValueError, TypeError, KeyError):
        return None


@functools.cache
def socket_block() -> str:
    """How the sandbox blocks sockets on this machine, in a few words for the log: "seccomp and Python" where the
    filter installs (found out by running the prelude once), else "Python only (<why>)"."""
    if socket_filter() is None:
        return f"Python only (no seccomp filter for {sys.platform}/{platform.machine()})"
    probe = subprocess.run(
        [sys.executable, "-I", "-c", PRELUDE, prelude_settings(DEFAULT_LIMITS, ""), "--probe"],
        input=b"",
        capture_output=True,
        timeout=60,
        env=program_environment(tempfile.gettempdir()),
    )
    said = probe_report(probe.stdout)
    if said is not None and said.seccomp == "on":
        return "seccomp and Python"
    return f"Python only (seccomp {said.seccomp if said else probe.stderr.decode(errors='replace').strip()[-200:]})"
