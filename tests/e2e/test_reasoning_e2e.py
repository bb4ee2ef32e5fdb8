"""End to end through `grpo-run`: GSM8K baseline eval from a local fixture, composite rewards in training."""

import json

import pytest

from grpo_cli.tracking import read_metrics
from tests.conftest import FIXTURES, run_grpo

pytestmark = pytest.mark.slow

GSM8K_FIXTURE = FIXTURES / "gsm8k_sample.jsonl"


def test_gsm8k_baseline_eval_from_a_local_file(tmp_path):
    run_dir = tmp_path / "run"
    result = run_grpo(
        [
            "job=baseline_eval",
            "task=gsm8k",
            f"task.eval_path={GSM8K_FIXTURE}",
            "model=tiny_random",
            "rollout.max_tokens=8",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "baseline_eval.jsonl").read_text().splitlines()]
    assert len(records) == 20  # n_eval: null reads the whole file
    assert records[0]["ground_truth"] == "72" and records[0]["prompt"].endswith("Assistant: <think>")
    assert {"reward", "format_reward", "answer_reward", "unparseable"} <= records[0].keys()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert sum(summary["counts"].values()) == 20
    # a random 3M-parameter model never writes "</think> <answer>": every answer is unparseable
    assert summary["counts"]["format_0"] == 20 and summary["unparseable_rate"] == 1.0
    assert summary["metrics"]["eval/unparseable_rate"] == 1.0 and summary["metrics"]["eval/reward_timeouts"] == 0
    assert "unparseable 1.000" in result.stdout


def test_training_logs_reward_components_unparseable_rate_and_timeouts(tmp_path):
    run_dir = tmp_path / "run"
    result = run_grpo(
        ["debug=smoke", "task=regex_sum", "task.reward_weights.format=0.1", f"hydra.run.dir={run_dir}"], cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "eval/reward" in r]
    assert len(train) == 2 and len(evals) == 3
    for row in train:
        assert {"train/unparseable_rate", "train/reward_timeouts", "train/reward_errors"} <= row.keys()
        assert {"train/reward/correctness", "train/reward/format"} <= row.keys()
        assert row["train/reward"] == pytest.approx(row["train/reward/correctness"] + 0.1 * row["train/reward/format"])
    assert {"eval/unparseable_rate", "eval/reward/format"} <= evals[0].keys()


def test_gsm8k_offline_without_a_path_fails_in_one_line(tmp_path):
    result = run_grpo(
        ["job=baseline_eval", "task=gsm8k", "model=tiny_random", f"hydra.run.dir={tmp_path}"], cwd=tmp_path, timeout=120
    )
    assert result.returncode == 2
    assert "task.eval_path" in result.stderr and "openai/gsm8k" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
