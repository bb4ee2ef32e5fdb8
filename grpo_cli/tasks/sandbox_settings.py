"""task.sandbox as a task declares it and the sandbox uses it: the isolation level, the limits of one run, the
packages a program may import and the uid programs run as under root. Declared here, in tasks/, so that the task's
schema (tasks/schema.py takes its defaults and allowed values from here) does not import the sandbox;
grpo_cli/sandbox/ runs programs under these settings and imports them from here, each value declared once."""

from __future__ import annotations

from dataclasses import dataclass

# The uid (and gid of the same number) sandboxed programs run as when the run is root: task.sandbox.uid's default
# (nobody/nogroup on Debian, Ubuntu and Red Hat; a uid with no file of its own on the machine).
DEFAULT_UID = 65534
ISOLATION_LEVELS: tuple[str, ...] = ("bwrap", "process")
# The packages a program may import besides the standard library (task.sandbox.packages' default).
DEFAULT_PACKAGES: tuple[str, ...] = ("numpy", "sympy", "mpmath")


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
    """task.sandbox as the sandbox uses it: the level, the limits, the packages a program may import, and the
    unprivileged host uid programs run as when the run is root (sandbox/privileges.py)."""

    isolation: str = "bwrap"
    limits: SandboxLimits = DEFAULT_LIMITS
    packages: tuple[str, ...] = DEFAULT_PACKAGES
    uid: int = DEFAULT_UID
