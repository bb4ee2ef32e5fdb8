"""The grpo-run end-to-end half of tests/unit/config/test_bad_input.py: grpo-run as a subprocess."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_grpo


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["task.n_eval=0"], "task.n_eval=0 must be >= 1"),
        (["train.eval_examples=-3"], "train.eval_examples=-3 must be >= 1"),
        (["hydra.run.dir=/proc/forbidden/run"], "cannot create /proc/forbidden"),
        (["hydra/launcher=nope"], "hydra/launcher=nope: no such hydra/launcher choice, use one of basic, processes"),
        (["rollout.stop=abc"], "rollout.stop=abc"),
    ],
)
def test_bad_input_through_grpo_run_is_one_line_and_exit_2(tmp_path, args, message):
    result = run_grpo(["model=tiny_random", *args], cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("grpo-run: error: ") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


@pytest.mark.slow
def test_grpo_run_resumes_a_run_whose_config_run_info_and_metrics_were_damaged(tmp_path):
    # The whole chain a user goes through: a real run stopped after step 1, its files damaged as a killed process
    # or a bad edit leaves them, then `grpo-run resume=<dir>`: recovered with one message each, nothing lost.
    run_dir = tmp_path / "run"
    args = ["debug=smoke", "train.eval_every=0", "train.checkpoint_every=1", f"hydra.run.dir={run_dir}"]
    first = run_grpo([*args, "train.steps=1"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    (run_dir / "config.yaml").write_text("model: {name: [\n")
    (run_dir / "run_info.json").write_text('{"command": "grpo-run", "overr')
    with (run_dir / "metrics.jsonl").open("a") as metrics:
        metrics.write('{"step": 2, "train/lo')  # a torn last line
    resumed = run_grpo([f"resume={run_dir}", "train.steps=2"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Traceback" not in resumed.stdout + resumed.stderr
    output = resumed.stdout + resumed.stderr
    assert "config.yaml was damaged" in output and "run_info.json" in output
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "train/loss" in row] == [1, 2]  # step 1 kept, the torn line dropped
    assert json.loads((run_dir / "run_info.json").read_text())["command"]
