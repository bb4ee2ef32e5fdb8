"""The grpo-run end-to-end half of tests/unit/rollout/test_sampled_eval.py: grpo-run as a subprocess."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_grpo


@pytest.mark.slow
def test_baseline_eval_with_four_samples_writes_pass_maj_and_mean(tmp_path):
    run_dir = tmp_path / "run"
    result = run_grpo(
        [
            "job=baseline_eval",
            "model=tiny_random",
            "eval.n_samples=4",
            "rollout.eval_temperature=1.0",
            "task.n_eval=4",
            "rollout.max_tokens=8",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics_line = json.loads((run_dir / "metrics.jsonl").read_text())
    for metrics in (summary["metrics"], metrics_line):
        values = {key: metrics[key] for key in ("eval/pass@1", "eval/pass@4", "eval/maj@4", "eval/mean@4")}
        assert all(0.0 <= v <= 1.0 for v in values.values()), values
        assert values["eval/pass@4"] >= values["eval/pass@1"] == pytest.approx(values["eval/mean@4"])
    records = [json.loads(line) for line in (run_dir / "baseline_eval.jsonl").read_text().splitlines()]
    assert len(records) == 16 and [r["sample"] for r in records[:4]] == [0, 1, 2, 3]
    assert summary["n_prompts"] == 4 and summary["n_samples"] == 4


@pytest.mark.slow
def test_training_evaluates_extra_sets_with_samples_and_logs_shaping_and_masking(tmp_path):
    extra = tmp_path / "extra.jsonl"
    extra.write_text("".join(json.dumps({"question": f"Use {w}.", "ground_truth": [w]}) + "\n" for w in "ab"))
    run_dir = tmp_path / "run"
    result = run_grpo(
        [
            "debug=smoke",
            "train.steps=1",
            "eval.n_samples=2",
            "rollout.eval_temperature=1.0",
            f"+task.eval_sets.extra={extra}",
            "task.reward_weights.repetition=0.5",
            "task.reward_weights.overlong=1",
            "train.mask_truncated=true",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/reward" in r]
    train = next(r for r in rows if "train/masked_frac" in r)
    assert [r["step"] for r in evals] == [0, 1]
    assert {"eval/pass@2", "eval/maj@2", "eval/mean@2", "eval/extra/pass@2", "eval/extra/reward"} <= set(evals[0])
    # The random model never stops within 8 tokens: every completion is cut, masked, and gets the full -1.
    assert train["train/truncated_frac"] == 1.0 and train["train/masked_frac"] == 1.0
    assert train["train/reward/overlong"] == -1.0 and "train/reward/repetition" in train
    # No token left in the loss: a step with nothing to train (docs/algorithm.md), no optimizer step, no loss.
    assert train["train/empty_steps"] == 1 and train["train/optimizer_steps"] == 0 and "train/loss" not in train
    samples = [json.loads(line) for line in (run_dir / "eval" / "step_00000.jsonl").read_text().splitlines()]
    assert len(samples) == 4 * 2 + 2 * 2 and {r.get("eval_set") for r in samples} == {None, "extra"}
    assert "| extra: reward" in result.stdout
