"""Running a program in the sandbox to its end or its limit (`run`): the code on its stdin, its output read up to
`max_output_bytes` and `wall_time_s`, then everything it started ended before the call returns; and what the model
reads back (`describe_run`)."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from grpo_cli.sandbox.bwrap import PACKAGES_DIR, find_bwrap
from grpo_cli.sandbox.launch import bwrap_launch, cgroup_for, process_launch
from grpo_cli.sandbox.prelude import PRELUDE, prelude_settings, program_environment
from grpo_cli.sandbox.privileges import DROP_FAILED, drop_failure
from grpo_cli.sandbox.probe import require
from grpo_cli.sandbox.settings import SandboxLimits, SandboxSettings, current_settings

# The file the model's code is saved as, in its folder (tracebacks name it).
CODE_FILE = "main.py"


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
        command, spec = process_launch(settings, folder, prelude_settings(limits, ""))
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
    group = cgroup_for(limits)
    try:
        command, spec = bwrap_launch(bwrap, settings, program, group)
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
