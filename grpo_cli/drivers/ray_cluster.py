"""What a run needs of a Ray cluster it joins (sync.ray_address): checked from the actors, said in one line.

On one machine the actors see what the driver sees. On a cluster each actor runs on some node, started by that
node's `ray start`, so three things the driver takes for granted must hold there too:

    storage     the learner writes checkpoints into the run directory from its own node and a resume reads them:
                every node must see the run directory at the same path (shared storage). Checked, not assumed:
                the driver writes a marker there, each actor must read it and write its reply, the driver must
                read the reply.
    files       the task's files (data, rewards, agents, environments) and a local model are read on the nodes, at
                the paths the config holds: every file the config names must exist on each actor's node.
    environment an actor inherits its node's environment, not the driver's: the variables that steer the hub,
                transformers and logging (HF_*, TRANSFORMERS_*, WANDB_*) and PYTHONPATH travel in the job's
                runtime_env.

Code is not shipped (no runtime_env working_dir): grpo-cli and its dependencies must be installed on every node,
and user code is read from the shared paths above. Standard library only; the Ray calls are the executor's.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

# The environment variables a run's actors get from the driver on a cluster (by prefix, and by name).
SHIPPED_PREFIXES = ("HF_", "TRANSFORMERS_", "WANDB_")
SHIPPED_NAMES = ("PYTHONPATH",)


def shipped_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The driver's variables that the actors on a cluster must see as the driver does."""
    return {k: v for k, v in environ.items() if k.startswith(SHIPPED_PREFIXES) or k in SHIPPED_NAMES}


def _values(node: Any, key: str) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a config (dataclasses, dicts, lists)."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for field in dataclasses.fields(node):
            yield from _values(getattr(node, field.name), f"{key}.{field.name}" if key else field.name)
    elif isinstance(node, Mapping):
        for name, value in node.items():
            yield from _values(value, f"{key}.{name}")
    elif isinstance(node, list | tuple):
        for i, value in enumerate(node):
            yield from _values(value, f"{key}[{i}]")
    else:
        yield key, node


def node_files(cfg: Any) -> list[tuple[str, str]]:
    """(key, path) of every file or folder the config names by an absolute path that exists here: each must
    exist on every actor's node too. A user-code reference (`/dir/rewards.py:score`) names its file."""
    found = []
    for key, value in _values(cfg, ""):
        if not isinstance(value, str) or not value.startswith("/"):
            continue
        path = value.rsplit(":", 1)[0] if ":" in value else value
        if Path(path).exists():
            found.append((key, path))
    return found


def reply_path(marker: str, role: str) -> Path:
    """Where the actor of `role` answers the driver's marker."""
    return Path(f"{marker}.{role.replace(' ', '_')}")


def node_problem(marker: str, token: str, files: list[tuple[str, str]], role: str) -> str | None:
    """Run inside an actor: None when its node sees the run directory (the driver's `marker` holding `token`; the
    reply written next to it) and every file the config names; else the one line that says what is missing."""
    where = f"the {role} actor's node ({socket.gethostname()})"
    try:
        seen = Path(marker).read_text() == token
        reply_path(marker, role).write_text(token)
    except OSError:
        seen = False
    if not seen:
        return (
            f"sync.ray_address: {where} does not share the run directory {Path(marker).parent} with this machine; "
            "on a Ray cluster the run directory must be on storage every node mounts at the same path "
            "(hydra.run.dir=/shared/...)"
        )
    for key, path in files:
        if not os.path.exists(path):
            return (
                f"sync.ray_address: {key}={path} does not exist on {where}; every node needs the task's files and a "
                "local model at the same paths (shared storage, or copy them there)"
            )
    return None


def reply_problem(marker: Path, token: str, role: str) -> str | None:
    """Run in the driver after node_problem: did the actor's write reach this machine?"""
    reply = reply_path(str(marker), role)
    try:
        ok = reply.read_text() == token
    except OSError:
        ok = False
    finally:
        reply.unlink(missing_ok=True)
    if ok:
        return None
    return (
        f"sync.ray_address: what the {role} actor wrote into the run directory {marker.parent} does not reach "
        "this machine; on a Ray cluster the run directory must be on storage every node mounts at the same path "
        "(hydra.run.dir=/shared/...)"
    )


def actor_lost(error: BaseException, output_dir: Path) -> str:
    """The one line of a run whose actor died under it (its node lost, its process killed)."""
    checkpoints = output_dir / "checkpoints"
    kept = (
        f"the checkpoints in {checkpoints} are kept; continue with: grpo-run resume={output_dir}"
        if any(checkpoints.glob("step_*/COMPLETE"))
        else "no checkpoint was written yet"
    )
    return f"a Ray actor of this run is gone ({type(error).__name__}: its node died or its process was killed); {kept}"


def cannot_join(address: str, error: BaseException) -> str:
    """The one line of a run that could not join the cluster at sync.ray_address (Ray gives up after ~20 s)."""
    return (
        f"sync.ray_address={address}: could not join the Ray cluster ({error}); check the address (`ray status "
        f"--address={address}`), and where the cluster has token authentication on (`ray start --head` in Ray 2.60 "
        "turns it on), run grpo-run with RAY_AUTH_MODE=token as the nodes were started"
    )
