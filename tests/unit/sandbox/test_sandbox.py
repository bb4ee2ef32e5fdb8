"""The python tool's sandbox (grpo_cli/sandbox/__init__.py): each limit is hit for real, at both isolation levels
(bwrap: skipped only where bubblewrap cannot run here, and failed instead under GRPO_CLI_REQUIRE_SANDBOX=1, as
.ci/run sets; the attacks it holds against are in test_sandbox_escape.py)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import pytest

from grpo_cli import sandbox
from grpo_cli.sandbox import SandboxLimits, describe_run
from grpo_cli.sandbox.prelude import BLOCKED_SYSCALLS, SYSCALL_NUMBERS, socket_block, socket_filter

# Small limits, so that each test hits its own quickly.
LIMITS = SandboxLimits(cpu_time_s=1, wall_time_s=20.0, memory_mb=256, max_output_bytes=300, max_file_mb=1)

BWRAP_PROBLEM = sandbox.problem("bwrap")
if BWRAP_PROBLEM is not None and os.environ.get("GRPO_CLI_REQUIRE_SANDBOX") == "1":
    raise RuntimeError(f"GRPO_CLI_REQUIRE_SANDBOX=1 but the bwrap sandbox cannot run here: {BWRAP_PROBLEM}")
ISOLATIONS = [
    "process",
    pytest.param("bwrap", marks=pytest.mark.skipif(BWRAP_PROBLEM is not None, reason=str(BWRAP_PROBLEM))),
]


@pytest.fixture(params=ISOLATIONS)
def run_python(request: pytest.FixtureRequest):
    """sandbox.run at each isolation level."""
    return partial(sandbox.run, isolation=request.param)


def test_a_program_runs_and_its_output_comes_back(run_python) -> None:
    result = run_python("import sys\nprint(6 * 7)\nprint('to stderr', file=sys.stderr)", LIMITS)
    assert (result.output, result.exit_code) == ("42\nto stderr\n", 0)
    assert not (result.timed_out or result.cpu_exceeded or result.output_cut)
    assert describe_run(result, LIMITS) == "42\nto stderr"
    assert describe_run(run_python("x = 1", LIMITS), LIMITS) == "(no output: print the values you want to see)"


def test_an_error_shows_the_traceback_of_the_programs_own_file(run_python) -> None:
    result = run_python("def f():\n    return 1 / 0\nf()", LIMITS)
    assert result.exit_code == 1
    assert 'File "main.py", line 2, in f' in result.output
    assert result.output.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "<string>" not in result.output  # the sandbox's own prelude is not shown


def test_no_socket_can_be_opened_from_python(run_python) -> None:
    code = "import socket\ntry:\n    socket.socket()\nexcept OSError as e:\n    print('refused', e.errno)\n"
    code += "try:\n    socket.create_connection(('127.0.0.1', 9))\nexcept OSError as e:\n    print('refused', e.errno)"
    assert run_python(code, LIMITS).output == "refused 1\nrefused 1\n"


@pytest.mark.skipif(not socket_block().startswith("seccomp"), reason="seccomp filter not available here")
def test_no_socket_can_be_opened_even_through_libc(run_python) -> None:
    """ctypes goes around the Python-level block: the seccomp filter makes the system call itself fail (EPERM),
    for the program's own subprocesses too."""
    code = (
        "import ctypes, subprocess, sys\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.socket(2, 1, 0), ctypes.get_errno())\n"  # AF_INET, SOCK_STREAM
        "print(libc.socket(1, 1, 0), ctypes.get_errno())\n"  # AF_UNIX
        "child = 'import ctypes; l = ctypes.CDLL(None, use_errno=True); print(l.socket(2, 2, 0), ctypes.get_errno())'\n"
        "print(subprocess.run([sys.executable, '-c', child], capture_output=True, text=True).stdout.strip())"
    )
    assert run_python(code, LIMITS).output == "-1 1\n-1 1\n-1 1\n"


def test_the_socket_filter_is_known_per_architecture() -> None:
    x86 = socket_filter("x86_64")
    assert x86 is not None and len(x86) % 8 == 0  # struct sock_filter is 8 bytes
    assert socket_filter("riscv64") is None


def test_the_cpu_time_limit_stops_an_infinite_loop(run_python) -> None:
    result = run_python("while True:\n    pass", LIMITS)
    assert result.cpu_exceeded and result.exit_code == -signal.SIGXCPU and not result.timed_out
    assert describe_run(result, LIMITS) == "error: the program used more than 1 s of CPU time and was stopped"


def test_the_wall_clock_limit_stops_a_sleeping_program_and_what_it_started() -> None:
    """(process level: the child's pid means the same outside; bwrap's are in test_sandbox_escape.py.)"""
    code = (
        "import subprocess, sys\np = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(p.pid, flush=True)\np.wait()"
    )
    limits = SandboxLimits(cpu_time_s=5, wall_time_s=1.0)
    result = sandbox.run(code, limits, isolation="process")
    assert result.timed_out and result.exit_code is None
    assert describe_run(result, limits).endswith("error: the program ran longer than 1 s and was stopped")
    pid = int(result.output.split()[0])
    # Killed with its process group: SIGKILL lands asynchronously, so give it a moment to die (a zombie until its
    # new parent reaps it).
    deadline = time.monotonic() + 10
    while _state(pid) not in ("gone", "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _state(pid) in ("gone", "Z")


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"


def test_the_memory_limit_stops_a_huge_allocation(run_python) -> None:
    result = run_python("x = bytearray(2 * 1024**3)\nprint('allocated')", LIMITS)
    assert result.exit_code == 1 and "allocated" not in result.output
    assert result.output.rstrip().endswith("MemoryError")


def test_output_past_the_limit_is_cut_and_the_program_stopped(run_python) -> None:
    result = run_python("while True:\n    print('x' * 50)", LIMITS)
    assert result.output_cut and len(result.output.encode()) == LIMITS.max_output_bytes
    assert describe_run(result, LIMITS).endswith("[output cut at 300 bytes: the program was stopped]")


def test_files_land_in_a_fresh_temporary_folder_that_is_removed() -> None:
    code = "import os\nopen('notes.txt', 'w').write('hi')\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))"
    first = sandbox.run(code, LIMITS, "process").output.splitlines()
    second = sandbox.run(code, LIMITS, "process").output.splitlines()
    folder = Path(first[0])
    assert folder.name.startswith("grpo-python-tool-") and folder.parent == Path(tempfile.gettempdir()).resolve()
    assert first[1] == "['main.py', 'notes.txt']"  # fresh: nothing but the program and what it wrote
    assert second[0] != first[0]
    assert not folder.exists() and not Path(second[0]).exists()


def test_the_file_size_limit_refuses_a_large_file(run_python) -> None:
    code = "try:\n    open('big', 'wb').write(b'0' * (2 << 20))\nexcept OSError as e:\n    print(e.strerror)"
    assert run_python(code, LIMITS).output == "File too large\n"


def test_the_program_does_not_see_the_callers_environment(run_python, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECRET_TOKEN", "abc")
    monkeypatch.setenv("PYTHONPATH", "/nowhere")
    code = "import os, sys\n"
    code += "print('SECRET_TOKEN' in os.environ, '/nowhere' in sys.path, os.environ['HOME'] == os.getcwd())"
    assert run_python(code, LIMITS).output == "False False True\n"
    assert os.environ["SECRET_TOKEN"] == "abc"


@pytest.mark.skipif(BWRAP_PROBLEM is not None, reason=str(BWRAP_PROBLEM))
def test_bwrap_files_land_in_a_private_tmp_that_starts_empty_each_call() -> None:
    code = "import os\nprint(sorted(os.listdir('.')), os.getcwd())\nopen('notes.txt', 'w').write('hi')"
    assert sandbox.run(code, LIMITS, "bwrap").output == "['main.py'] /tmp\n"
    assert sandbox.run(code, LIMITS, "bwrap").output == "['main.py'] /tmp\n"  # nothing left from the call before


@pytest.mark.skipif(BWRAP_PROBLEM is not None, reason=str(BWRAP_PROBLEM))
def test_bwrap_a_program_imports_the_packages_of_its_view_and_no_other() -> None:
    """numpy and sympy (task.sandbox.packages) import from the read-only view; pytest, installed beside them, does
    not: the interpreter's site-packages is hidden."""
    code = (
        "import numpy, sympy\nprint(int(numpy.arange(5).sum()), sympy.factor('x**2 - 1'))\n"
        "try:\n    import pytest\nexcept ImportError:\n    print('no pytest')"
    )
    for name in ("numpy", "sympy"):
        pytest.importorskip(name)
    result = sandbox.run(code, SandboxLimits(wall_time_s=60.0), "bwrap")
    assert result.output == "10 (x - 1)*(x + 1)\nno pytest\n", result.output


def test_the_seccomp_numbers_are_the_kernels(tmp_path: Path) -> None:
    """Each blocked system call's number, per architecture, against the kernel's own headers (x86_64's
    asm/unistd_64.h, aarch64's asm-generic/unistd.h) where this machine has them."""
    headers = {
        "x86_64": [Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"), Path("/usr/include/asm/unistd_64.h")],
        "aarch64": [Path("/usr/include/asm-generic/unistd.h")],
    }
    checked = 0
    for machine, candidates in headers.items():
        header = next((h for h in candidates if h.is_file()), None)
        if header is None:
            continue
        defined = dict(re.findall(r"#define __NR_(\w+)\s+(\d+)", header.read_text()))
        numbers = SYSCALL_NUMBERS[machine][1]
        assert set(numbers) == set(BLOCKED_SYSCALLS)
        for name in BLOCKED_SYSCALLS:
            assert int(defined[name]) == numbers[name], (machine, name)
        checked += 1
    if not checked:
        pytest.skip("no kernel headers here (linux-libc-dev)")


@pytest.mark.skipif(not sys.platform.startswith("linux") or socket_filter() is None, reason="seccomp: Linux only")
def test_every_blocked_system_call_fails_with_eperm(run_python) -> None:
    """Each of the filter's calls, made through libc's syscall() with harmless arguments, is refused before the
    kernel looks at them: errno EPERM, never EINVAL/EBADF/ENOSYS."""
    numbers = SYSCALL_NUMBERS[os.uname().machine][1]
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"for number in {sorted(numbers.values())}:\n"
        "    ctypes.set_errno(0)\n"
        "    print(libc.syscall(number, -1, 0, 0, 0, 0, 0), ctypes.get_errno())"
    )
    result = run_python(code, SandboxLimits(max_output_bytes=10_000))
    assert result.output.splitlines() == ["-1 1"] * len(numbers), result.output


@pytest.fixture
def fresh_settings(monkeypatch: pytest.MonkeyPatch):
    """task.sandbox configured by the test alone: the module's settings, the variable the workers read and the
    probe's cache are restored afterwards."""
    monkeypatch.setenv(sandbox.SETTINGS_ENV, "")
    monkeypatch.setattr(sandbox.settings, "_configured", None)
    sandbox.probe._probe.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    sandbox.probe._probe.cache_clear()
    for listener in sandbox.settings._listeners:  # the python tool's description, as the restored settings give it
        listener(sandbox.current_settings())


def test_python_math_stops_before_any_model_loads_where_the_sandbox_cannot_start(fresh_settings, caplog) -> None:
    """No bwrap here (as on a platform without the wheel): validate_task_config, grpo-run's preflight, stops in one
    line naming the cause and the opt-in; with the opt-in the run goes on and the log calls it unsafe."""
    from grpo_cli.errors import UserFacingError
    from grpo_cli.tasks import validate_task_config
    from tests.conftest import compose_config

    fresh_settings.setattr(sandbox.probe, "find_bwrap", lambda: None)
    with pytest.raises(UserFacingError) as stopped:
        validate_task_config(compose_config(["task=python_math"]).task)
    message = str(stopped.value)
    assert "\n" not in message and "bubblewrap" in message and "task.sandbox.isolation=process" in message
    assert "unsafe" in message
    validate_task_config(compose_config(["task=python_math", "task.sandbox.isolation=process"]).task)
    assert any("unsafe for untrusted code" in r.getMessage().lower() for r in caplog.records)


def test_task_sandbox_reaches_the_python_tool_in_its_worker_process(fresh_settings) -> None:
    """task.sandbox's limits, configured in the trainer, are those of the python tool in a worker process (which
    inherits them), in what it does and in the description the model reads."""
    from grpo_cli.episodes import builtin_tools
    from grpo_cli.usercode.reward_workers import RewardWorkers
    from grpo_cli.usercode.user_code import load_reward_spec

    settings = sandbox.SandboxSettings("process", SandboxLimits(max_output_bytes=7, cpu_time_s=3))
    sandbox.configure(settings)
    assert "at most 3 s of CPU time" in (builtin_tools.python.__doc__ or "")
    workers = RewardWorkers(1, None)
    try:
        loader = partial(load_reward_spec, "task.tools.python", "grpo_cli.episodes.builtin_tools:python", Path.cwd())
        output = workers.submit(loader, ("print('abcdefghijkl')",), {}).result()
    finally:
        workers.close()
    assert output == "abcdefg\n[output cut at 7 bytes: the program was stopped]"


@pytest.mark.skipif(BWRAP_PROBLEM is not None, reason=str(BWRAP_PROBLEM))
def test_a_machine_without_cgroups_gets_one_log_line_naming_the_missing_bounds(fresh_settings, caplog) -> None:
    from grpo_cli.sandbox.cgroups import Cgroup

    why = ["pids (no cgroup hierarchy offers it)", "memory (cgroup v2 at /x does not delegate it to this process)"]
    fresh_settings.setattr(sandbox.launch, "make_cgroup", lambda *args: Cgroup(missing=list(why)))
    with caplog.at_level("INFO", logger="grpo_cli.sandbox"):
        assert sandbox.problem("bwrap") is None  # the sandbox still starts
        result = sandbox.run("print('ran')", LIMITS, "bwrap")
    assert result.output == "ran\n" and result.missing_bounds == tuple(why)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "no pids cgroup" in lines[0] and "no memory cgroup" in lines[0]
    assert "does not delegate it" in lines[0]


# ------------------------------------------------------------------------------------------ under root (issue #48)

ROOT = os.geteuid() == 0


@pytest.mark.skipif(not ROOT, reason="the privilege drop applies to a run that is root")
def test_under_root_the_process_level_runs_as_task_sandbox_uid() -> None:
    """A process-level program started by root was root. Now it runs as task.sandbox.uid (65534) with no group, and
    kernel.core_pattern is not writable to it (access() only: nothing is written); the interpreter under a folder
    that uid cannot search (pyenv under /root, drwx------) still starts, with its site-packages."""
    code = (
        "import os, sys\nprint(os.getresuid(), os.getresgid(), os.getgroups())\n"
        "print(os.access('/proc/sys/kernel/core_pattern', os.W_OK), os.access('/proc/sys/vm/drop_caches', os.W_OK))\n"
        "import json, subprocess\nprint(subprocess.run([sys.executable, '-c', 'print(1)'], capture_output=True).stdout)"
    )
    result = sandbox.run(code, LIMITS, "process")
    assert result.output.splitlines() == [
        "(65534, 65534, 65534) (65534, 65534, 65534) []",
        "False False",
        "b'1\\n'",
    ], result.output


@pytest.mark.parametrize("uid", [0, -1, 2**32 - 1, "abc", True])
def test_a_bad_task_sandbox_uid_stops_in_one_line(fresh_settings, uid) -> None:
    sandbox.configure(sandbox.SandboxSettings("process", LIMITS, uid=uid))
    message = sandbox.problem()
    assert message is not None and "\n" not in message and message.startswith(f"task.sandbox.uid={uid!r}"), message
    with pytest.raises(sandbox.SandboxUnavailable):
        sandbox.require()


def test_task_sandbox_uid_0_on_the_command_line_is_one_line() -> None:
    """grpo-run's config check names the key before anything starts."""
    from grpo_cli.config.validation import validate_config
    from grpo_cli.errors import UserFacingError
    from tests.conftest import compose_config

    with pytest.raises(UserFacingError) as stopped:
        validate_config(compose_config(["task=python_math", "task.sandbox.uid=0"]))
    message = str(stopped.value)
    assert "\n" not in message and "task.sandbox.uid" in message and "not 0 (root)" in message, message


@pytest.mark.skipif(not ROOT or shutil.which("setpriv") is None, reason="needs root and setpriv (util-linux)")
def test_a_root_run_that_cannot_drop_privileges_stops_in_one_line() -> None:
    """Root without CAP_SETUID / CAP_SETGID (a container that dropped them): neither level may run the program as
    root, so each stops in one line naming the drop that failed."""
    check = "from grpo_cli.tasks import sandbox\nfor level in ('bwrap', 'process'):\n    print(sandbox.problem(level))"
    probe = subprocess.run(
        ["setpriv", "--inh-caps=-all", "--bounding-set=-setuid,-setgid", sys.executable, "-c", check],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = probe.stdout.splitlines()
    assert len(lines) == 2, (probe.stdout, probe.stderr)
    for line in lines:
        assert "runs programs as uid 65534 (task.sandbox.uid) because this run is root" in line, line
        assert "cannot drop privileges to uid 65534, gid 65534: Operation not permitted" in line, line


def test_covers_are_the_folders_the_uid_cannot_search(tmp_path: Path) -> None:
    """A folder the unprivileged uid may not search (mode 0700, owned by another uid) is covered, with the one
    entry on the way bound back; a searchable one (0755) is not; nothing is covered twice."""
    from grpo_cli.sandbox.privileges import covers

    closed, opened = tmp_path / "closed", tmp_path / "open"
    (closed / "inner").mkdir(parents=True)
    (opened / "inner").mkdir(parents=True)
    (closed / "inner" / "python").write_text("")
    closed.chmod(0o700)
    opened.chmod(0o755)
    tmp_path.chmod(0o755)
    owner = os.stat(closed).st_uid
    uid = owner + 1 if owner < 65534 else owner - 1  # any uid but the owner's
    needed = (str(closed / "inner" / "python"), str(closed / "inner"), str(opened / "inner"))
    found = covers(needed, uid, uid)
    own_ancestors = [p for p in tmp_path.parents if not os.stat(p).st_mode & stat.S_IXOTH]
    assert found[len(own_ancestors) :] == ((str(closed), ("inner",)),), found


@pytest.mark.skipif(not ROOT or BWRAP_PROBLEM is not None, reason="needs root and bwrap")
def test_the_probe_refuses_a_bwrap_started_by_root_directly(fresh_settings) -> None:
    """The launch before issue #48 (bwrap started by root, which maps the program's uid to host uid 0): the
    start-up probe reads the program's host uid from outside and stops in one line."""
    from grpo_cli.sandbox import privileges as sandbox_privileges

    fresh_settings.setattr(sandbox_privileges, "running_as_root", lambda: False)
    message = sandbox.problem("bwrap")
    assert message is not None and "\n" not in message, message
    assert message.startswith("the python tool's sandbox runs programs as host root (host uid 0"), message


def test_a_writable_kernel_setting_or_a_kept_group_is_refused() -> None:
    """The probe's verdict on what it found: a writable /proc/sys file or a group of root's kept after the drop
    stops the sandbox; ns_last_pid (mode 0666, each write checked for a capability the uid lacks) does not."""
    from grpo_cli.sandbox.privileges import DropSpec, HostIds, privilege_problem

    spec = DropSpec(65534, 65534)
    dropped = HostIds((65534,) * 4, (65534,) * 4, ())
    assert privilege_problem(dropped, (), ("/proc/sys/kernel/ns_last_pid",), spec) is None
    writable = privilege_problem(dropped, (), ("/proc/sys/kernel/core_pattern",), spec)
    assert writable == "leaves kernel settings writable to its programs (as uid 65534): /proc/sys/kernel/core_pattern"
    kept = privilege_problem(HostIds((65534,) * 4, (65534,) * 4, (0,)), (), (), spec)
    assert kept is not None and "kept groups" in kept
    root = privilege_problem(HostIds((0,) * 4, (0,) * 4, ()), (), (), None)
    assert root is not None and root.startswith("runs programs as host root (host uid 0")
    assert privilege_problem(None, (), (), spec) is not None  # ids not read: not trusted
