"""run_info.json: what it takes to reproduce a run directory on its own, next to its resolved config.yaml.

The code version (git commit, and whether the working tree differed from it), the package versions, the
seeds, a hash of the exact train and eval examples, and the command that reruns the run.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from grpo_cli.tasks.custom import CustomTaskConfig, code_hashes

if TYPE_CHECKING:
    from grpo_cli.config.schemas import GRPOConfig
    from grpo_cli.tasks.base import Example

PACKAGES = (
    "grpo-cli",
    "torch",
    "transformers",
    "accelerate",
    "hydra-core",
    "omegaconf",
    "wandb",
    "math-verify",
    "vllm",
)
RUN_INFO_FILE = "run_info.json"
GIT_TIMEOUT_S = 5.0


def rerun_command(overrides: list[str]) -> str:
    """The shell command that composes the same config: `grpo-run` plus the run's own overrides, quoted."""
    return " ".join(["grpo-run", *(shlex.quote(o) for o in overrides)])


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Installed version of each package (None when it is not installed)."""
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def examples_sha256(examples: list[Example]) -> str:
    """A hash of prompts and ground truths, stable across processes (JSON with sorted keys, not hash())."""
    digest = hashlib.sha256()
    for example in examples:
        row = [example.prompt, example.ground_truth]
        digest.update(json.dumps(row, sort_keys=True, default=repr).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def git_state(source_dir: Path) -> dict[str, Any]:
    """The commit of the repository holding the code, and whether the tree differs from it.

    An installed wheel is not a repository: commit and dirty are then null.
    """

    def git(*args: str) -> str | None:
        try:
            # --no-optional-locks: `git status` must not take index.lock under someone else's commit.
            command = ["git", "--no-optional-locks", "-C", str(source_dir), *args]
            result = subprocess.run(command, capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return result.stdout if result.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None, "changed_files": []}
    status = git("status", "--porcelain") or ""
    changed = [line[3:] for line in status.splitlines() if line.strip()]
    return {"commit": commit.strip(), "dirty": bool(changed), "changed_files": changed[:50]}


def _is_custom(cfg: GRPOConfig) -> bool:
    """Whether the task is task=custom (the only task config with task.rewards)."""
    return getattr(cfg.task, "rewards", None) is not None


def build_run_info(cfg: GRPOConfig, examples: dict[str, list[Example]], overrides: list[str]) -> dict[str, Any]:
    """Everything but the config itself (config.yaml holds that) needed to rerun this run."""
    import grpo_cli

    return {
        "command": rerun_command(overrides),
        "overrides": list(overrides),
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git": git_state(Path(grpo_cli.__file__).resolve().parent),
        "packages": package_versions(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        # Which process ran it, where: every job of a sweep has its own (hydra/launcher=processes, submitit).
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "seeds": {"seed": cfg.seed, "model.init_seed": cfg.model.init_seed, "task.data_seed": cfg.task.data_seed},
        "data": {split: {"n_examples": len(rows), "sha256": examples_sha256(rows)} for split, rows in examples.items()},
        # task=custom: the file and content hash of each reward function and the generator, so a rerun can tell
        # the user's code changed.
        **({"user_code": code_hashes(cast(CustomTaskConfig, cfg.task))} if _is_custom(cfg) else {}),
    }


def write_run_info(output_dir: Path, info: dict[str, Any], resumed: bool = False) -> str | None:
    """Write run_info.json. A resumed run keeps the record of how the run started and appends its own
    command, time, code and package versions to "resumes" (a resume may run on newer code).

    A damaged run_info.json (a kill mid-write, a full disk, a bad edit) is kept beside it as
    run_info.json.damaged and written anew from this start: the returned message says so (None otherwise).
    """
    path = output_dir / RUN_INFO_FILE
    message = None
    if resumed and path.exists():
        original, problem = _read_run_info(path)
        if original is not None:
            original.setdefault("resumes", []).append(
                {key: info[key] for key in ("command", "overrides", "created_utc", "git", "packages") if key in info}
            )
            info = original
        else:
            kept = path.with_name(f"{RUN_INFO_FILE}.damaged")
            os.replace(path, kept)
            message = f"{path} was damaged ({problem}): kept as {kept.name} and written anew from this start"
    temp = path.with_name(f".{RUN_INFO_FILE}.tmp")
    temp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(temp, path)  # whole or not at all: a kill mid-write leaves the previous file
    return message


def _read_run_info(path: Path) -> tuple[dict[str, Any] | None, str]:
    """(the record, "") or (None, what is wrong with it)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    except json.JSONDecodeError as e:
        return None, f"not valid JSON at line {e.lineno}"
    if not isinstance(record, dict) or not isinstance(record.get("resumes", []), list):
        return None, "not a run_info record"
    return record, ""
