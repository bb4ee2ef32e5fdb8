"""Hydra's own plugin scan finds `hydra/launcher=processes` wherever grpo-cli is installed, editable included.

Hydra lists plugins by walking the `hydra_plugins` namespace package with pkgutil. Under setuptools' default
editable install (an import hook) that walk missed our launcher; `package-dir = {"" = "."}` in pyproject.toml makes
the editable install a plain path entry that the walk sees. The scan runs in a fresh process, outside the project
directory, so that neither an earlier registration nor the working directory can make it pass.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

from tests.conftest import REPO_ROOT

DISCOVER = (
    "from hydra.core.plugins import Plugins; from hydra.plugins.launcher import Launcher; "
    "print(sorted(p.__name__ for p in Plugins.instance().discover(Launcher)))"
)


def test_hydras_plugin_scan_finds_the_process_launcher(tmp_path: Path) -> None:
    found = subprocess.run([sys.executable, "-c", DISCOVER], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert "ProcessLauncher" in found.stdout, found.stdout + found.stderr


def test_the_editable_install_is_a_plain_path_entry() -> None:
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert pyproject["tool"]["setuptools"]["package-dir"] == {"": "."}
