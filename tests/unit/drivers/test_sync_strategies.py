"""Each sync strategy completes a short run on the tiny model, and its lag, staleness and time breakdown are
what the strategy promises. on_policy and multi_epoch run in-process; one_behind and replay_buffer through the
real `grpo-run` with Ray actors (skipped when Ray is not installed)."""

from pathlib import Path

import pytest
from rich.console import Console

from grpo_cli.config import validate_config
from grpo_cli.drivers.loop import TrainingLoop
from grpo_cli.learner import learner as learner_module
from grpo_cli.tracking import read_metrics
from tests.conftest import compose_config

TIME_KEYS = {
    "time/step_s",
    "time/generation_s",
    "time/scoring_s",
    "time/old_log_probs_s",
    "time/training_s",
    "time/sync_s",
    "time/waiting_s",
    "time/overlap_frac",
}


def train_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r]


def run_in_process(tmp_path: Path, overrides: list[str]) -> list[dict]:
    cfg = compose_config(["debug=smoke", "train.eval_every=0", *overrides], output_dir=str(tmp_path))
    validate_config(cfg)
    TrainingLoop(cfg, tmp_path, Console(quiet=True)).run()
    return train_rows(tmp_path)


def test_on_policy_trains_every_batch_at_lag_0_without_overlap(tmp_path, letter_e_task):
    rows = run_in_process(tmp_path, ["task.name=letter_e", "train.steps=3"])
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert TIME_KEYS <= row.keys()
        assert row["sync/lag"] == 0 and row["sync/policy_version"] == row["step"] - 1
        # the learner waits for all of generation: it runs in turn with training
        assert row["time/overlap_frac"] == 0.0
        assert row["time/waiting_s"] >= row["time/generation_s"]


def test_multi_epoch_takes_the_expected_optimizer_steps_and_computes_old_log_probs_once(
    tmp_path, letter_e_task, monkeypatch
):
    calls = []
    real = learner_module.log_probs_of_rows

    def counting(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append(all(t.is_inference() for t in result.values()))  # computed under torch.inference_mode
        return result

    monkeypatch.setattr(learner_module, "log_probs_of_rows", counting)
    # 3 epochs x (4 completions / 2 per train batch) = 6 optimizer steps per rollout batch
    rows = run_in_process(
        tmp_path,
        [
            "task.name=letter_e",
            "loss=grpo_clip",
            "sync=multi_epoch",
            "sync.epochs_per_rollout_batch=3",
            "train.train_batch_size=2",
            "train.gradient_accumulation_steps=1",
            "train.steps=3",
            "optim.lr=3e-3",
        ],
    )
    # (a step whose every loss weight is 0, flat, takes none: train/flat_steps)
    assert [r["train/optimizer_steps"] + r["train/flat_steps"] for r in rows] == [6, 6, 6]
    # once per rollout batch (3 steps), not once per epoch or per optimizer step (18)
    assert calls == [True, True, True]
    assert all(r["time/old_log_probs_s"] > 0 and r["sync/lag"] == 0 for r in rows)


# --- Ray: one_behind and replay_buffer -------------------------------------------------------------------


def test_actors_that_fail_to_start_leave_no_ray_running_in_this_process(tmp_path, ray_installed):
    # The caller never gets a half-built executor to close: a failed start stops the local Ray (both actors, one
    # holding its policy and CPUs, and the sentinel) itself, or the next run in this process (a sweep's next job
    # under hydra/launcher=basic) finds them still there.
    import ray

    from grpo_cli.drivers.prompts import PromptSampler
    from grpo_cli.drivers.ray_executor import RayExecutor
    from grpo_cli.errors import UserFacingError

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama", ')  # passes the preflight, fails to load
    (broken / "model.safetensors").write_bytes(b"not weights")
    overrides = ["debug=smoke", "sync=one_behind", "model=hf", f"model.name_or_path={broken}"]
    cfg = compose_config(overrides, output_dir=str(tmp_path / "run"))
    assert not ray.is_initialized()
    with pytest.raises(UserFacingError, match="could not load model.name_or_path"):
        RayExecutor(cfg, tmp_path / "run", PromptSampler([], seed=0))
    assert not ray.is_initialized()
