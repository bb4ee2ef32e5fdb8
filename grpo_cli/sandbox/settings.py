"""task.sandbox as a task declares it and the sandbox uses it: the isolation level, the limits of one run, the
packages a program may import and the uid programs run as under root (tasks/schema.py takes its defaults and allowed
values from here, each value declared once); and the settings this process runs with (`configure`,
`current_settings`), which the worker processes it starts inherit through SETTINGS_ENV. Nothing of grpo_cli but
the standard library: the task's schema imports it without the sandbox importing tasks/."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

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


# The environment variable that carries task.sandbox to the worker processes (they inherit it; the sandboxed
# program does not: its environment is empty).
SETTINGS_ENV = "GRPO_CLI_SANDBOX"

# The settings configure() gave this process, and who is told each time (the python tool's description).
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
