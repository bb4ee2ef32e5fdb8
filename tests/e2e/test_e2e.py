"""End to end through the real `grpo-run` entrypoint, offline, on the tiny random model (and SmolLM2 once)."""

import json
import re

import pytest

from grpo_cli.tracking import read_metrics
from tests.conftest import run_grpo

pytestmark = pytest.mark.slow

REQUIRED_TRAIN_KEYS = {
    "train/reward",
    "train/format_reward",
    "train/answer_reward",
    "train/loss",
    "train/grad_norm",
    "train/entropy",
    "train/frac_zero_std_groups",
    "train/response_length_mean",
    "train/response_length_max",
    "train/truncated_frac",
    "time/step_s",
    "time/generation_s",
    "time/training_s",
    "time/sync_s",
    "throughput/tokens_per_s",
}


def test_smoke_training_run_writes_metrics_and_eval_generations(tmp_path):
    run_dir = tmp_path / "run"
    result = run_grpo(["debug=smoke", f"hydra.run.dir={run_dir}", "kl.monitor=true"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "prompts per rollout batch" in result.stdout  # the shape report comes first
    # the cost before it is paid (2 steps x 2 prompts x 2 completions, 8 tokens each; 3 evaluations x 4 rows), then
    # the time left on each step line, evaluations included
    assert (
        "size: 2 steps x 2 prompts x 2 completions = 8 completions (at most 64 new tokens); "
        "3 evaluations (at steps 0, 1, 2) x 4 rows = 12 completions (at most 96 new tokens)"
    ) in result.stdout
    assert re.search(r"^step    1  reward .*  eta [0-9hms]+$", result.stdout, re.MULTILINE), result.stdout
    rows = read_metrics(run_dir / "metrics.jsonl")
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    for row in train_rows:
        assert REQUIRED_TRAIN_KEYS - {"train/entropy"} <= row.keys()
        assert row["train/response_length_max"] <= 8
        if row["train/optimizer_steps"]:  # rows were forwarded: their entropy and (kl.monitor) KL measured
            assert "train/entropy" in row and row["train/kl"] >= 0.0
        else:  # the tiny random model scores 0 on the built-in task: every group flat, no row forwarded
            assert row["train/flat_steps"] == 1 and row["perf/zero_weight_skipped_frac"] == 1.0
            assert f"step {row['step']}: every row's loss weight is 0 in its update" in result.stdout
    eval_steps = [r["step"] for r in rows if "eval/reward" in r]
    assert eval_steps == [0, 1, 2]
    records = [json.loads(line) for line in (run_dir / "eval" / "step_00002.jsonl").read_text().splitlines()]
    assert len(records) == 4 and {"prompt", "response", "reward", "format_reward", "answer_reward"} <= records[0].keys()
    assert (run_dir / "config.yaml").exists()


def test_grpo_clip_multi_epoch_takes_two_optimizer_steps_per_rollout_batch(tmp_path):
    run_dir = tmp_path / "run"
    result = run_grpo(
        ["debug=smoke", "loss=grpo_clip", "sync=multi_epoch", "normalization=dr_grpo", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    train_rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r]
    # the tiny random model scores 0 on the built-in task: a step whose groups are all flat takes no optimizer step
    # (train/flat_steps), planned all the same
    assert all(r["train/optimizer_steps"] + r["train/flat_steps"] == 2 for r in train_rows)
    assert all(0.0 <= r.get("train/clip_fraction", 0.0) <= 1.0 for r in train_rows)


def test_baseline_eval_writes_generations_and_summary(tmp_path):
    run_dir = tmp_path / "run"
    result = run_grpo(["debug=smoke", "job=baseline_eval", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["n"] == 4 and sum(summary["counts"].values()) == 4
    lines = (run_dir / "baseline_eval.jsonl").read_text().splitlines()
    assert len(lines) == 4
    assert summary["accuracy"] == pytest.approx(sum(json.loads(line)["reward"] for line in lines) / 4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train.gradient_accumulation_steps=3"], "train.train_batch_size=4 is not divisible by"),
        (["sync=multi_epoch"], "use loss=grpo_clip"),
        (["model=hf", "model.name_or_path=/no/such/model"], "/no/such/model"),
        (["task.eval_path=/no/such/file.jsonl"], "/no/such/file.jsonl"),
    ],
)
def test_bad_input_fails_fast_with_one_line_and_exit_code_2(tmp_path, args, message):
    result = run_grpo(["debug=smoke", f"hydra.run.dir={tmp_path / 'run'}", *args], cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_unknown_group_choice_lists_the_available_ones(tmp_path):
    result = run_grpo(["loss=ppo"], cwd=tmp_path, timeout=120)
    assert result.returncode != 0
    assert "grpo_clip" in result.stderr and "Traceback" not in result.stderr


def test_baseline_eval_on_the_embedded_smollm2(tmp_path):
    run_dir = tmp_path / "run"
    result = run_grpo(
        ["job=baseline_eval", "job.n_examples=4", "rollout.max_tokens=24", f"hydra.run.dir={run_dir}"], cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "baseline_eval.jsonl").read_text().splitlines()]
    # a real instruct model writes real words back: at least one response names one of its keywords
    assert any(r["answer_reward"] > 0 for r in records), records
