"""The bwrap sandbox of grpo-cli run from a virtual environment (as the README installs it) over a base interpreter
with packages of its own: the program in the sandbox runs the base interpreter, whose site-packages sits inside the
bound standard library, and imports none of them (inside a venv `site.getsitepackages()` names only the venv's
folder, which is all the view used to hide). Skipped only where bubblewrap cannot run here (failed instead under
GRPO_CLI_REQUIRE_SANDBOX=1, as .ci/run sets)."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_cli import sandbox
from tests.conftest import REPO_ROOT

PROBLEM = sandbox.problem("bwrap")
if PROBLEM is not None and os.environ.get("GRPO_CLI_REQUIRE_SANDBOX") == "1":
    raise RuntimeError(f"GRPO_CLI_REQUIRE_SANDBOX=1 but the bwrap sandbox cannot run here: {PROBLEM}")

# Run by the venv's interpreter: what site names there, then a program in the sandbox that imports `extra`.
PROBE = """
import json, site, sys
from grpo_cli import sandbox
from grpo_cli.sandbox import SandboxLimits

program = "try:\\n    import {extra}\\n    print('imported', {extra}.__file__)\\n"
program += "except ImportError:\\n    print('hidden')"
result = sandbox.run(program, SandboxLimits(wall_time_s=60.0), "bwrap")
print(json.dumps({{"sitepackages": site.getsitepackages(), "prefix": sys.prefix, "output": result.output}}))
"""


@pytest.mark.skipif(PROBLEM is not None, reason=f"bwrap sandbox unavailable: {PROBLEM}")
def test_a_program_in_the_sandbox_of_a_venv_imports_none_of_the_base_interpreters_packages(tmp_path: Path) -> None:
    import json

    base_site = [d for d in site.getsitepackages([sys.base_prefix]) if os.path.isdir(d)]
    extra = next(
        (name for name in ("pytest", "pip") if any((Path(d) / name / "__init__.py").is_file() for d in base_site)), None
    )
    if extra is None:
        pytest.skip(f"the base interpreter ({sys.base_prefix}) has no package of its own to hide")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    # grpo-cli's own imports from this process's paths (as its venv would hold them); the venv's site stays its own.
    paths = [str(REPO_ROOT), *(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-c", PROBE.format(extra=extra)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    # The case the view missed: inside the venv, site names only the venv's folder, not the base's.
    assert seen["prefix"] == str(venv) and not any(d in seen["sitepackages"] for d in base_site)
    assert seen["output"] == "hidden\n", (extra, seen["output"])
