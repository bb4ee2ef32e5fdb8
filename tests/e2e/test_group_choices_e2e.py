"""The grpo-run end-to-end half of tests/unit/config/test_group_choices.py: grpo-run as a subprocess."""

from __future__ import annotations

from tests.conftest import run_grpo
from tests.unit.config.test_group_choices import choices_on_disk, listed_choices


def test_grpo_run_with_a_mistyped_experiment_stops_with_one_line(tmp_path):
    # Before the fix: exit 0 after training the default setup.
    result = run_grpo(["experiment=cs336_mathh", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("grpo-run: error: experiment=cs336_mathh: no such experiment choice, use one of ")
    assert listed_choices(line) == choices_on_disk("experiment")
    assert not (tmp_path / "run").exists()


def test_grpo_run_sweeping_over_a_mistyped_algorithm_starts_no_job(tmp_path):
    sweep_dir = tmp_path / "sweep"
    args = ["-m", "debug=smoke", "algorithm=grpo,dapoo", f"hydra.sweep.dir={sweep_dir}"]
    result = run_grpo(args, cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert "algorithm=dapoo: no such algorithm choice" in line
    assert listed_choices(line) == choices_on_disk("algorithm")
    assert not sweep_dir.exists()
