"""An example runs from any folder (its README's way): `--config-dir <example>/conf task.base_dir=<example>` finds
its data, rewards and tools, and nothing is written into the example (the repository may be read-only). Before,
task.tools / task.environment / task.agent were found from where grpo-run was started, whatever task.base_dir said."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, run_grpo


@pytest.mark.slow
def test_an_example_with_a_tool_runs_from_another_folder(tmp_path: Path) -> None:
    example = Path(REPO_ROOT) / "examples" / "tool_add"
    before = sorted(p.name for p in example.iterdir())
    args = ["--config-dir", str(example / "conf"), "task=sums", f"task.base_dir={example}", "job=check_reward"]
    result = run_grpo(args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "all 4 cases agree" in result.stdout
    assert sorted(p.name for p in example.iterdir()) == before  # no outputs/ in the example
    assert list((tmp_path / "outputs").glob("check_reward/*/config.yaml"))  # the run went where it was started
