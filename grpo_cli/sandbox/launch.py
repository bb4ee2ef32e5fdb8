"""The command lines that start a sandboxed program, shared by the probe (probe.py) and a run (running.py):
under bubblewrap in the run's cgroups, or as a plain process; under root, through the drop to task.sandbox.uid
(privileges.py)."""

from __future__ import annotations

import os
import sys

from grpo_cli.sandbox.bwrap import bwrap_command, bwrap_needs, view_sources
from grpo_cli.sandbox.cgroups import Cgroup, join_command, make_cgroup
from grpo_cli.sandbox.prelude import PRELUDE
from grpo_cli.sandbox.privileges import DropSpec, drop_command, drop_spec
from grpo_cli.sandbox.settings import SandboxLimits, SandboxSettings


def bwrap_launch(
    bwrap: str, settings: SandboxSettings, program: list[str], group: Cgroup
) -> tuple[list[str], DropSpec | None]:
    """The command that starts `program` under bwrap in `group`'s cgroups, and under root the privilege drop it
    goes through (sandbox/privileges.py: cgroups entered as root, then bwrap started as task.sandbox.uid)."""
    command = bwrap_command(bwrap, settings, program)
    procs = [str(folder / "cgroup.procs") for folder in group.folders]
    spec = drop_spec(settings.uid, [*bwrap_needs(bwrap), *view_sources(command)], procs)
    if spec is None:
        return join_command(group, command), None
    return drop_command(spec, command), spec


def process_launch(settings: SandboxSettings, folder: str, prelude_arg: str) -> tuple[list[str], DropSpec | None]:
    """The command that starts the prelude at isolation=process in `folder` (its last argument, the code's file or
    --probe, to be added), and under root the privilege drop it goes through (to task.sandbox.uid, which then owns
    `folder`)."""
    interpreter = os.path.realpath(sys.executable)
    command = [interpreter, "-I", "-u", "-c", PRELUDE, prelude_arg]
    spec = drop_spec(settings.uid, [interpreter, *_interpreter_folders()])
    if spec is None:
        return command, None
    os.chown(folder, spec.uid, spec.gid)
    return drop_command(spec, command), spec


def _interpreter_folders() -> list[str]:
    """The folders a plain interpreter reads: its prefix, standard library and site-packages."""
    import site
    import sysconfig

    folders = {sys.prefix, sys.base_prefix, *site.getsitepackages()}
    folders |= {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    return sorted(os.path.realpath(f) for f in folders if os.path.isdir(f))


def memory_bytes(limits: SandboxLimits) -> int:
    """The memory cgroup's limit: the program's memory plus its files (tmpfs pages are memory)."""
    return (limits.memory_mb + limits.disk_mb + limits.shm_mb) << 20


def cgroup_for(limits: SandboxLimits) -> Cgroup:
    """The pids and memory cgroups a program under `limits` runs in (Cgroup.missing: the bounds it goes without)."""
    return make_cgroup(limits.max_processes, memory_bytes(limits))
