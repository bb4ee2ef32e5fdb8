"""The escape suite: model-written code run by the python tool's bwrap sandbox (grpo_cli/sandbox/__init__.py) tries
each way out that the process-level sandbox left open (issue #39), and each attempt must fail.

Each test runs the attack for real, as a program given to `sandbox.run` or to the `python` tool inside a real
reward worker (usercode/reward_workers.py: the trainer here is this pytest process). Skipped only where bubblewrap
cannot run here; under GRPO_CLI_REQUIRE_SANDBOX=1 (.ci/run) that fails instead. The fork bomb and the memory test
also need the pids / memory cgroup (they say why they skip). The attacks that reach other processes (trace, take
descriptors, signal, fork) or remount run only once the program has proved it is in its own pid namespace (GUARD):
a sandbox that failed open must not stop, kill or write into this machine's processes.
"""

from __future__ import annotations

import functools
import os
import pickle
import signal
import stat
import struct
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import grpo_cli
from grpo_cli import sandbox
from grpo_cli.episodes.builtin_tools import make_python_tool
from grpo_cli.sandbox import SandboxLimits, cgroups
from grpo_cli.sandbox.bwrap import PACKAGES_DIR, SANDBOX_UID
from grpo_cli.sandbox.prelude import SYSCALL_NUMBERS
from grpo_cli.usercode.reward_workers import RewardWorkers

PROBLEM = sandbox.problem("bwrap")
if PROBLEM is not None and os.environ.get("GRPO_CLI_REQUIRE_SANDBOX") == "1":
    raise RuntimeError(f"GRPO_CLI_REQUIRE_SANDBOX=1 but the bwrap sandbox cannot run here: {PROBLEM}")
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=f"bwrap sandbox unavailable: {PROBLEM}")

LIMITS = SandboxLimits(cpu_time_s=2, wall_time_s=20.0, memory_mb=256, max_output_bytes=20_000, max_file_mb=1)
NUMBERS = SYSCALL_NUMBERS.get(os.uname().machine, (0, {}))[1]
SECRET = f"grpo-escape-secret-{uuid.uuid4().hex}"
PROJECT = Path(grpo_cli.__file__).resolve().parent


def run(code: str, limits: SandboxLimits = LIMITS) -> sandbox.SandboxResult:
    return sandbox.run(textwrap.dedent(code), limits, isolation="bwrap")


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


# A program that proves it is in another pid namespace than this process's before it does anything harmful.
GUARD = f"""
import os, sys
if os.stat("/proc/self/ns/pid").st_ino == {_pid_namespace()}:
    print("same pid namespace: not attacking")
    sys.exit(0)
"""


@pytest.fixture(scope="module")
def pool() -> Iterator[RewardWorkers]:
    """One reward worker (started with SECRET in its environment, as a worker keeps the user's API keys)."""
    os.environ["GRPO_ESCAPE_SECRET"] = SECRET
    workers = RewardWorkers(1, None)
    try:
        assert tool_call(workers, "print('ready')") == "ready"  # started: its pid is known
        yield workers
    finally:
        workers.close()
        del os.environ["GRPO_ESCAPE_SECRET"]


def tool_call(pool: RewardWorkers, code: str) -> str:
    """What the model reads back from the `python` tool called with `code` in a reward worker."""
    loader = functools.partial(make_python_tool, wall_time_s=20.0, max_output_bytes=20_000, isolation="bwrap")
    return pool.submit(loader, (textwrap.dedent(code),), {}).result()


def _processes_with(marker: str, excluding: int | None = None) -> list[int]:
    """The pids of this machine whose command line holds `marker` (but `excluding`'s)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) not in (os.getpid(), excluding):
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# ------------------------------------------------------------------------------------------ reading


def test_it_cannot_read_etc_passwd_the_users_home_or_the_project() -> None:
    interpreter = os.path.realpath(sys.executable)
    home = Path.home()
    home_entries = []
    if home.is_dir():
        home_entries = [str(e) for e in sorted(home.iterdir()) if not interpreter.startswith(str(e) + "/")][:5]
    paths = ["/etc/passwd", "/etc/shadow", str(PROJECT / "sandbox" / "__init__.py"), str(PROJECT.parent), *home_entries]
    result = run(
        f"""
        import os
        for path in {paths!r}:
            try:
                if os.path.isdir(path):
                    print("listed", path, os.listdir(path)[:3])
                else:
                    open(path, "rb").read(1)
                    print("read", path)
            except OSError as e:
                print("refused", path, type(e).__name__)
        """
    )
    lines = result.output.splitlines()
    assert len(lines) == len(paths) and all(line.startswith("refused ") for line in lines), result.output


def test_it_cannot_write_outside_its_tmp_or_into_the_installed_package() -> None:
    name = f"escape-{uuid.uuid4().hex}"
    folders = ["/", "/usr/lib", "/dev", PACKAGES_DIR, os.path.dirname(os.path.realpath(sys.executable))]
    folders += [os.path.dirname(os.__file__), str(PROJECT / "tasks"), str(Path.home())]
    package_file = str(PROJECT / "tasks" / "graders.py")
    try:
        result = run(
            f"""
            import os
            for folder in {folders!r}:
                try:
                    open(os.path.join(folder, {name!r}), "x").close()
                    print("wrote in", folder)
                except OSError as e:
                    print("refused", folder, type(e).__name__)
            try:
                open({package_file!r}, "ab").close()  # opened for writing, nothing written
                print("opened the package's file for writing")
            except OSError as e:
                print("refused", type(e).__name__)
            open({name!r}, "x").close()  # its own /tmp is writable
            print("wrote in its tmp")
            """
        )
    finally:
        leaked = [f for f in folders if os.path.exists(os.path.join(f, name))]
        for folder in leaked:
            os.remove(os.path.join(folder, name))
    lines = result.output.splitlines()
    assert [line.split()[0] for line in lines] == ["refused"] * (len(folders) + 1) + ["wrote"], result.output
    assert not leaked


def test_it_cannot_read_the_environment_of_any_process_of_the_run(pool: RewardWorkers) -> None:
    """The worker keeps the user's environment (SECRET stands for an API key); no /proc/<pid>/environ the program
    can open holds it, the worker's and this trainer's pids included."""
    output = tool_call(
        pool,
        f"""
        import os
        found, readable = [], 0
        pids = [p for p in os.listdir("/proc") if p.isdigit()] + ["{pool.pids()[0]}", "{os.getpid()}"]
        for pid in pids:
            try:
                data = open(f"/proc/{{pid}}/environ", "rb").read()
            except OSError:
                continue
            readable += 1
            if b"{SECRET}" in data:
                found.append(pid)
        print("found in", found)
        """,
    )
    assert output == "found in []", output


# ------------------------------------------------------------------------------------------ the worker and the trainer


def test_it_cannot_trace_the_worker_or_take_its_descriptors(pool: RewardWorkers) -> None:
    """ptrace and pidfd_getfd (how a program once copied its worker's socket) on every process it can name: the
    worker's and the trainer's pids from outside, its parent, and every pid it sees."""
    worker = pool.pids()[0]
    output = tool_call(
        pool,
        GUARD
        + f"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
targets = {{os.getppid(), 1, {worker}, {os.getpid()}}} | {{int(p) for p in os.listdir("/proc") if p.isdigit()}}
targets.discard(os.getpid())
got = []
for pid in sorted(targets):
    if libc.syscall({NUMBERS["ptrace"]}, 16, pid, 0, 0) == 0:  # PTRACE_ATTACH
        libc.syscall({NUMBERS["ptrace"]}, 17, pid, 0, 0)  # PTRACE_DETACH
        got.append(("traced", pid))
    pidfd = libc.syscall({NUMBERS["pidfd_open"]}, pid, 0)
    if pidfd >= 0:
        got.append(("pidfd", pid))
        for fd in range(64):
            if libc.syscall({NUMBERS["pidfd_getfd"]}, pidfd, fd, 0) >= 0:
                got.append(("took fd", pid, fd))
print("got", got)
""",
    )
    assert output == "got []", output


def test_it_cannot_signal_the_worker_or_the_trainer(pool: RewardWorkers) -> None:
    """SIGKILL to the worker's and the trainer's pids, to its parent, and to every process it may signal
    (kill(-1)): the worker answers the call and serves the next, and this process lives."""
    worker = pool.pids()[0]
    output = tool_call(
        pool,
        GUARD
        + f"""
import signal
for pid in ({worker}, {os.getpid()}, os.getppid()):
    try:
        os.kill(pid, signal.SIGKILL)
        print("signalled", pid)
    except OSError as e:
        print("refused", type(e).__name__)
try:
    os.kill(-1, signal.SIGKILL)  # every process it may signal, but itself
except OSError as e:
    print("kill(-1) refused", type(e).__name__)
print("alive")
""",
    )
    assert "same pid namespace" not in output and output.endswith("alive"), output
    assert pool.pids() == [worker]
    os.kill(worker, 0)  # the worker still exists
    assert tool_call(pool, "print(6 * 7)") == "42"


def test_a_forged_worker_reply_never_reaches_the_trainer(pool: RewardWorkers, tmp_path: Path) -> None:
    """A program writes a reply in the worker's framing whose unpickling would run code in the trainer, on every
    descriptor it has and every one it could copy from another process: the trainer reads the tool's own output."""
    marker = tmp_path / "pwned"

    class Forged:
        def __reduce__(self):  # what unpickling it runs
            return (exec, (f"open({str(marker)!r}, 'w').write('pwned')",))

    payload = pickle.dumps(("ok", Forged(), []))
    framed = struct.pack("!i", len(payload)) + payload
    worker = pool.pids()[0]
    output = tool_call(
        pool,
        GUARD
        + f"""
import ctypes
framed = {framed!r}
libc = ctypes.CDLL(None, use_errno=True)
sent = []
for fd in range(3, 1024):  # its own descriptors
    try:
        os.write(fd, framed)
        sent.append(fd)
    except OSError:
        pass
for pid in {{os.getppid(), {worker}}} | {{int(p) for p in os.listdir("/proc") if p.isdigit()}}:
    pidfd = libc.syscall({NUMBERS["pidfd_open"]}, pid, 0)
    for fd in range(64) if pidfd >= 0 else ():
        copy = libc.syscall({NUMBERS["pidfd_getfd"]}, pidfd, fd, 0)
        if copy >= 0:
            try:
                os.write(copy, framed)
                sent.append((pid, fd))
            except OSError:
                pass
print("sent", sent)
""",
    )
    assert output == "sent []", output
    assert not marker.exists()
    assert tool_call(pool, "print('next call')") == "next call"


def test_the_worker_is_not_dumpable(tmp_path: Path) -> None:
    """PR_SET_DUMPABLE 0 in every worker: no other process of the user may trace it or read its environ."""
    from grpo_cli.usercode.user_code import load_reward_spec

    (tmp_path / "probe.py").write_text(
        "import ctypes\n\ndef dumpable():\n    return ctypes.CDLL(None).prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE\n"
    )
    workers = RewardWorkers(1, None)
    try:
        loader = functools.partial(load_reward_spec, "probe", f"{tmp_path}/probe.py:dumpable", tmp_path)
        assert workers.submit(loader, (), {}).result() == 0
    finally:
        workers.close()


# ------------------------------------------------------------------------------------------ outliving the call


def _spawner(marker: str, then: str) -> str:
    """A program that leaves three processes holding `marker` (a plain child, a setsid one, a double-forked one),
    then does `then`."""
    sleeper = f"[sys.executable, '-c', 'import time; time.sleep(120)', {marker!r}]"
    return f"""
import os, subprocess, sys
subprocess.Popen({sleeper})
subprocess.Popen({sleeper}, start_new_session=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, {sleeper})
    os._exit(0)
print("started", flush=True)
{then}
"""


@pytest.mark.parametrize("ending", ["exits", "times out"])
def test_no_process_outlives_the_call(ending: str) -> None:
    marker = f"grpo-escape-{uuid.uuid4().hex}"
    then = "import time; time.sleep(0.5)" if ending == "exits" else "import time; time.sleep(60)"
    limits = SandboxLimits(wall_time_s=3.0 if ending == "times out" else 20.0)
    try:
        result = run(_spawner(marker, then), limits)
        left = _processes_with(marker)
    finally:
        _kill_all(_processes_with(marker))
    assert result.output.startswith("started") and result.timed_out == (ending == "times out")
    assert left == []


def test_no_process_outlives_the_run(tmp_path: Path) -> None:
    """The caller (a run) is killed while its program and three descendants run: they go with it
    (--die-with-parent takes the pid namespace's init, and with it everything inside)."""
    marker = f"grpo-escape-{uuid.uuid4().hex}"
    caller = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from grpo_cli import sandbox; sandbox.run(sys.argv[1], isolation='bwrap')",
            _spawner(marker, "import time; time.sleep(60)"),
        ],
        env={**os.environ, "PYTHONPATH": str(PROJECT.parent)},
    )
    try:
        deadline = time.monotonic() + 20
        while len(_processes_with(marker, caller.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_processes_with(marker, caller.pid)) == 3
        caller.kill()
        caller.wait()
        deadline = time.monotonic() + 5  # PR_SET_PDEATHSIG lands asynchronously
        while _processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _processes_with(marker) == []
    finally:
        caller.kill()
        caller.wait()
        _kill_all(_processes_with(marker))
        cgroups.remove_stale()  # the killed caller's


# ------------------------------------------------------------------------------------------ resources


def test_disk_is_bounded_in_total_across_files_and_in_dev_shm() -> None:
    """disk_mb bounds all files in its /tmp together (max_file_mb each), shm_mb its /dev/shm: 1 MB files until
    the first refusal."""
    limits = SandboxLimits(max_file_mb=1, disk_mb=4, shm_mb=2, wall_time_s=20.0)
    tag = f"grpo-escape-{uuid.uuid4().hex}"
    result = run(
        f"""
        import os
        for folder in (".", "/dev/shm"):
            written = 0
            for i in range(32):
                try:
                    with open(os.path.join(folder, f"{tag}-{{i}}"), "wb") as f:
                        f.write(b"x" * (1 << 20))
                    written += 1
                except OSError as e:
                    break
            print(folder, written)
        """,
        limits,
    )
    tmp, shm = (int(line.split()[1]) for line in result.output.splitlines())
    assert 0 < tmp <= limits.disk_mb and 0 < shm <= limits.shm_mb, result.output


def _needs_cgroup(controller: str) -> None:
    group = cgroups.make_cgroup(8, 64 << 20)
    group.remove()
    missing = [m for m in group.missing if m.startswith(controller)]
    if missing:
        pytest.skip(f"no {controller} cgroup can be made here: {missing[0]}")


def test_memory_is_bounded_across_children() -> None:
    """Three children of 150 MB each under memory_mb=200 (RLIMIT_AS alone lets each have it): the memory
    cgroup (memory_mb + disk_mb + shm_mb = 216 MB) holds one at a time."""
    _needs_cgroup("memory")
    limits = SandboxLimits(memory_mb=200, disk_mb=8, shm_mb=8, wall_time_s=20.0, cpu_time_s=5)
    hog = "import time; x = bytearray(b'1') * (150 << 20); print('allocated', flush=True); time.sleep(3)"
    result = run(
        f"""
        import subprocess, sys
        children = [subprocess.Popen([sys.executable, "-c", {hog!r}]) for _ in range(3)]
        print("codes", [c.wait() for c in children], flush=True)
        """,
        limits,
    )
    assert result.output.count("allocated") <= 1, result.output
    assert "codes" in result.output and "-9" in result.output, result.output


def test_a_fork_bomb_is_bounded_and_ends_with_the_call() -> None:
    _needs_cgroup("pids")
    limits = SandboxLimits(max_processes=16, wall_time_s=3.0, cpu_time_s=2)
    marker = f"grpo-escape-{uuid.uuid4().hex}"
    started = time.monotonic()
    try:
        result = run(
            GUARD
            + f"""
import time
n = 0
while True:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import os, time\\nwhile True:\\n    try: os.fork()\\n    "
                 "except OSError: time.sleep(0.2)", {marker!r}])
    n += 1
print("forked", n, flush=True)
time.sleep(60)
""",
            limits,
        )
        elapsed = time.monotonic() - started
        left = _processes_with(marker)
    finally:
        _kill_all(_processes_with(marker))
    assert result.output.startswith("forked") and result.timed_out, result.output
    assert int(result.output.split()[1]) < limits.max_processes
    assert elapsed < limits.wall_time_s + 10 and left == []


# ------------------------------------------------------------------------------------------ network and mounts


def test_no_socket_by_raw_syscall_or_socketpair_and_no_network() -> None:
    result = run(
        f"""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        print("socket", libc.syscall({NUMBERS["socket"]}, 2, 1, 0), ctypes.get_errno())  # AF_INET, SOCK_STREAM
        pair = (ctypes.c_int * 2)()
        print("socketpair", libc.socketpair(1, 1, 0, pair), ctypes.get_errno())  # AF_UNIX
        interfaces = [line.split(":")[0].strip() for line in open("/proc/net/dev").read().splitlines()[2:]]
        print("interfaces", interfaces)
        """
    )
    assert result.output.splitlines() == ["socket -1 1", "socketpair -1 1", "interfaces ['lo']"], result.output


def test_a_remount_cannot_make_its_read_only_view_writable() -> None:
    """The machine runs this as root; inside, the program is uid 1000 with no capabilities, cannot remount its
    read-only binds or its root (mount is refused), nor make a user namespace to get capabilities back."""
    result = run(
        GUARD
        + """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
status = open("/proc/self/status").read()
print("uid", os.getuid(), "caps", [l.split()[1] for l in status.splitlines() if l.startswith("CapEff")][0])
for target in (b"/usr/lib", b"/"):
    code = libc.mount(None, target, None, 32 | 4096, None)  # MS_REMOUNT | MS_BIND, no MS_RDONLY
    print("remount", target.decode(), code, ctypes.get_errno())
print("unshare", libc.unshare(0x10000000 | 0x00020000), ctypes.get_errno())  # CLONE_NEWUSER | CLONE_NEWNS
for path in ("/usr/lib/escape", "/escape"):
    try:
        open(path, "x")
        print("wrote", path)
    except OSError as e:
        print("refused", path, type(e).__name__)
"""
    )
    lines = result.output.splitlines()
    assert lines[0] == f"uid {SANDBOX_UID} caps 0000000000000000", result.output
    assert lines[1:3] == ["remount /usr/lib -1 1", "remount / -1 1"], result.output
    assert lines[3].startswith("unshare -1 ") and lines[4:] == [
        "refused /usr/lib/escape OSError",
        "refused /escape OSError",
    ], result.output


# ------------------------------------------------------------------------------------------ the host's root
# What a sandbox started by root invites (issue #48): CI runs this suite as root. Host-wide settings are probed
# with access() and read-only files only, never written.


def test_no_kernel_setting_is_writable() -> None:
    """Every file under /proc/sys (kernel.core_pattern runs a program as host root on a crash), /proc/sysrq-trigger
    and /sys where they are visible: access(W_OK) refuses each. Started by root, bwrap mapped the program to host
    uid 0, and the kernel judges these files by that uid."""
    result = run(
        """
        import os
        writable, seen = [p for p in ("/proc/sysrq-trigger",) if os.access(p, os.W_OK)], 0
        for top in ("/proc/sys", "/sys"):
            for folder, _, names in os.walk(top):
                for name in names:
                    seen += 1
                    if os.access(os.path.join(folder, name), os.W_OK):
                        writable.append(os.path.join(folder, name))
        print("walked", seen > 50, "writable", writable[:5])
        """
    )
    assert result.output == "walked True writable []\n", result.output


def test_its_processes_are_unprivileged_on_the_host() -> None:
    """A program's child, seen from here (/proc/<pid>/status gives the ids the kernel checks, in this process's
    namespace): no uid or gid of it is 0 and it has no supplementary group of root's; inside, files host root owns
    (the interpreter, /usr/lib) do not show as its own."""
    interpreter = os.path.realpath(sys.executable)
    owned = [p for p in (interpreter, "/usr/lib") if os.stat(p).st_uid == 0]
    marker = f"grpo-escape-{uuid.uuid4().hex}"
    code = f"""
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", {marker!r}])
print("own", [p for p in {owned!r} if os.stat(p).st_uid == os.getuid()], flush=True)
child.wait()
"""
    done: list[sandbox.SandboxResult] = []
    runner = threading.Thread(target=lambda: done.append(run(code)))
    runner.start()
    try:
        deadline = time.monotonic() + 20
        while not _processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        (child,) = _processes_with(marker)
        status = dict(line.split(":", 1) for line in Path(f"/proc/{child}/status").read_text().splitlines())
    finally:
        _kill_all(_processes_with(marker))
        runner.join()
    uids, gids = ([int(n) for n in status[key].split()] for key in ("Uid", "Gid"))
    groups = [int(n) for n in status["Groups"].split()]
    assert 0 not in uids and 0 not in gids and 0 not in groups, status
    assert done[0].output.startswith("own []"), done[0].output


# Programs installed setuid or setgid that a view of /usr/lib may hold.
SETUID_CANDIDATES = (
    "/usr/lib/openssh/ssh-keysign",
    "/usr/libexec/openssh/ssh-keysign",
    "/usr/lib/dbus-1.0/dbus-daemon-launch-helper",
    "/usr/lib/polkit-1/polkit-agent-helper-1",
    "/usr/lib/eject/dmcrypt-get-device",
    "/usr/lib/x86_64-linux-gnu/utempter/utempter",
    "/usr/lib/aarch64-linux-gnu/utempter/utempter",
)


def test_setuid_programs_in_its_view_give_it_nothing() -> None:
    """A setuid-root program in the view (ssh-keysign) must neither be the program's own (owned by host root, which
    a root-started bwrap mapped to the program's uid) nor keep its setuid bit (a nosuid mount). Looked at with
    stat() and statvfs(); none is run."""
    present = [p for p in SETUID_CANDIDATES if os.path.isfile(p) and os.stat(p).st_mode & (stat.S_ISUID | stat.S_ISGID)]
    if not present:
        pytest.skip("no setuid program of SETUID_CANDIDATES on this machine")
    result = run(
        f"""
        import os
        for path in {present!r}:
            if os.path.exists(path):
                info = os.stat(path)
                print(path, "own" if info.st_uid == os.getuid() else "not-own",
                      "nosuid" if os.statvfs(path).f_flag & os.ST_NOSUID else "suid")
        """
    )
    lines = result.output.splitlines()
    assert lines and all(line.endswith(" not-own nosuid") for line in lines), result.output


def test_no_key_of_the_host_is_listed_and_keyctl_is_refused() -> None:
    """/proc/keys lists the keys its reader may view: host root's keyrings, for a program that is host root.
    keyctl, add_key and request_key are refused (EPERM)."""
    result = run(
        f"""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        for path in ("/proc/keys", "/proc/key-users"):
            try:
                print(path, len(open(path).read().splitlines()))
            except OSError as e:
                print(path, "refused")
        print("keyctl", libc.syscall({NUMBERS["keyctl"]}, 0, -3, 0, 0, 0), ctypes.get_errno())  # GET_KEYRING_ID
        print("add_key", libc.syscall({NUMBERS["add_key"]}, b"user", b"x", b"y", 1, -3), ctypes.get_errno())
        """
    )
    lines = result.output.splitlines()
    assert all(line.endswith((" 0", " refused")) for line in lines[:2]), result.output
    assert lines[2:] == ["keyctl -1 1", "add_key -1 1"], result.output


def test_it_cannot_mount_proc_or_sysfs_again_nor_nest_a_user_namespace() -> None:
    """A fresh proc or sysfs mount would show the host's settings without the read-only cover; a nested user
    namespace would give back capabilities. Each is refused, directly and after unshare."""
    result = run(
        GUARD
        + """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
for kind in (b"proc", b"sysfs"):
    os.makedirs("/tmp/" + kind.decode(), exist_ok=True)
    code = libc.mount(kind, b"/tmp/" + kind, kind, 0, None)
    print("mount", kind.decode(), code, ctypes.get_errno())
for flags in (0x10000000, 0x10000000 | 0x00020000 | 0x20000000):  # NEWUSER; NEWUSER | NEWNS | NEWPID
    print("unshare", libc.unshare(flags) == 0)
"""
    )
    lines = result.output.splitlines()
    assert lines == ["mount proc -1 1", "mount sysfs -1 1", "unshare False", "unshare False"], result.output
