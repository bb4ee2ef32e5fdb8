"""The code stays ruff clean (lint and format), with the ruff version pinned in the [dev] extra."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

CHECKED = ["grpo_cli", "hydra_plugins", "tests", "benchmarks"]


def ruff(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    return subprocess.run([exe, *args, *CHECKED], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", [("check",), ("format", "--check")], ids=["lint", "format"])
def test_ruff_is_clean(command):
    result = ruff(*command)
    assert result.returncode == 0, f"`ruff {' '.join(command)}` found problems:\n{result.stdout}{result.stderr}"
