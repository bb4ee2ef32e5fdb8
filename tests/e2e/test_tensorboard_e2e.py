"""The grpo-run end-to-end half of tests/unit/tracking/test_tensorboard.py: grpo-run as a subprocess."""

from __future__ import annotations

import pytest

from grpo_cli.tracking import read_metrics
from grpo_cli.tracking.tensorboard_sink import (
    MISSING_PACKAGE,
)
from tests.conftest import run_grpo
from tests.unit.tracking.test_tensorboard import read_events, scalars, texts


@pytest.mark.slow
def test_grpo_run_without_tensorboard_fails_in_one_line_before_loading_a_model(tmp_path, monkeypatch):
    hide = tmp_path / "hide"
    hide.mkdir()
    # None in sys.modules makes `import tensorboard` fail and find_spec report it missing
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['tensorboard'] = None\n")
    monkeypatch.setenv("PYTHONPATH", str(hide))
    result = run_grpo(
        ["debug=smoke", "logger=tensorboard", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.strip() == f"grpo-run: error: {MISSING_PACKAGE}"
    assert "batch shapes" not in result.stdout and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_grpo_run_logger_tensorboard_logs_a_training_run(tmp_path):
    run_dir = tmp_path / "run"
    result = run_grpo(
        ["model=tiny_random", "debug=smoke", "logger=tensorboard", "train.steps=1", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"TensorBoard: {run_dir / 'tensorboard'}" in result.stdout
    rows = read_metrics(run_dir / "metrics.jsonl")
    events = read_events(run_dir / "tensorboard")
    for tag in ("train/reward", "train/loss", "time/step_s", "eval/reward"):
        assert scalars(events, tag) == [(row["step"], row[tag]) for row in rows if tag in row], tag
    assert [e.step for e in events.Scalars("eval/reward")] == [0, 1]
    logged = texts(events)
    assert sorted(logged) == [0, 1] and logged[1].count("### Sample") == 4  # debug=smoke: task.n_eval=4
