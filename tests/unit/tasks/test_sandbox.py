"""The python tool's sandbox (grpo_cli/tasks/sandbox.py): each limit is hit for real in a subprocess."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import pytest

from grpo_cli.tasks.sandbox import SandboxLimits, describe_run, run_python, socket_block, socket_filter

# Small limits, so that each test hits its own quickly.
LIMITS = SandboxLimits(cpu_time_s=1, wall_time_s=20.0, memory_mb=256, max_output_bytes=300, max_file_mb=1)


def test_a_program_runs_and_its_output_comes_back() -> None:
    result = run_python("import sys\nprint(6 * 7)\nprint('to stderr', file=sys.stderr)", LIMITS)
    assert (result.output, result.exit_code) == ("42\nto stderr\n", 0)
    assert not (result.timed_out or result.cpu_exceeded or result.output_cut)
    assert describe_run(result, LIMITS) == "42\nto stderr"
    assert describe_run(run_python("x = 1", LIMITS), LIMITS) == "(no output: print the values you want to see)"


def test_an_error_shows_the_traceback_of_the_programs_own_file() -> None:
    result = run_python("def f():\n    return 1 / 0\nf()", LIMITS)
    assert result.exit_code == 1
    assert 'File "main.py", line 2, in f' in result.output
    assert result.output.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "<string>" not in result.output  # the sandbox's own prelude is not shown


def test_no_socket_can_be_opened_from_python() -> None:
    code = "import socket\ntry:\n    socket.socket()\nexcept OSError as e:\n    print('refused', e.errno)\n"
    code += "try:\n    socket.create_connection(('127.0.0.1', 9))\nexcept OSError as e:\n    print('refused', e.errno)"
    assert run_python(code, LIMITS).output == "refused 1\nrefused 1\n"


@pytest.mark.skipif(not socket_block().startswith("seccomp"), reason="seccomp filter not available here")
def test_no_socket_can_be_opened_even_through_libc() -> None:
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


def test_the_cpu_time_limit_stops_an_infinite_loop() -> None:
    result = run_python("while True:\n    pass", LIMITS)
    assert result.cpu_exceeded and result.exit_code == -signal.SIGXCPU and not result.timed_out
    assert describe_run(result, LIMITS) == "error: the program used more than 1 s of CPU time and was stopped"


def test_the_wall_clock_limit_stops_a_sleeping_program_and_what_it_started() -> None:
    code = "import subprocess\np = subprocess.Popen(['sleep', '600'])\nprint(p.pid, flush=True)\np.wait()"
    limits = SandboxLimits(cpu_time_s=5, wall_time_s=1.0)
    result = run_python(code, limits)
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


def test_the_memory_limit_stops_a_huge_allocation() -> None:
    result = run_python("x = bytearray(2 * 1024**3)\nprint('allocated')", LIMITS)
    assert result.exit_code == 1 and "allocated" not in result.output
    assert result.output.rstrip().endswith("MemoryError")


def test_output_past_the_limit_is_cut_and_the_program_stopped() -> None:
    result = run_python("while True:\n    print('x' * 50)", LIMITS)
    assert result.output_cut and len(result.output.encode()) == LIMITS.max_output_bytes
    assert describe_run(result, LIMITS).endswith("[output cut at 300 bytes: the program was stopped]")


def test_files_land_in_a_fresh_temporary_folder_that_is_removed() -> None:
    code = "import os\nopen('notes.txt', 'w').write('hi')\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))"
    first = run_python(code, LIMITS).output.splitlines()
    second = run_python(code, LIMITS).output.splitlines()
    folder = Path(first[0])
    assert folder.name.startswith("grpo-python-tool-") and folder.parent == Path(tempfile.gettempdir()).resolve()
    assert first[1] == "['main.py', 'notes.txt']"  # fresh: nothing but the program and what it wrote
    assert second[0] != first[0]
    assert not folder.exists() and not Path(second[0]).exists()


def test_the_file_size_limit_refuses_a_large_file() -> None:
    code = "try:\n    open('big', 'wb').write(b'0' * (2 << 20))\nexcept OSError as e:\n    print(e.strerror)"
    assert run_python(code, LIMITS).output == "File too large\n"


def test_the_program_does_not_see_the_callers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECRET_TOKEN", "abc")
    monkeypatch.setenv("PYTHONPATH", "/nowhere")
    code = (
        "import os, sys\nprint('SECRET_TOKEN' in os.environ, '/nowhere' in sys.path, os.environ['HOME'] == os.getcwd())"
    )
    assert run_python(code, LIMITS).output == "False False True\n"
    assert os.environ["SECRET_TOKEN"] == "abc"
