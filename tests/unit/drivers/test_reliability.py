"""Reliability: exact resume after SIGKILL, clean SIGTERM, damaged checkpoints, non-finite updates, bad input."""

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from grpo_cli.config import validate_config
from grpo_cli.drivers.loop import TrainingLoop
from grpo_cli.errors import RunStopped
from grpo_cli.learner import learner as learner_module
from grpo_cli.learner.checkpoint import list_checkpoints, verify_checkpoint
from grpo_cli.tracking import read_metrics
from tests.conftest import compose_config


def make_trainer(tmp_path: Path, overrides: list[str]):
    cfg = compose_config(["debug=smoke", *overrides], output_dir=str(tmp_path))
    validate_config(cfg)
    return TrainingLoop(cfg, tmp_path, Console(quiet=True))


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    make_trainer(tmp_path, ["train.steps=4", "train.checkpoint_every=2"]).run()
    newest = list_checkpoints(tmp_path)[-1]
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a disk that filled up mid-write
    assert "truncated" in verify_checkpoint(newest)
    messages = []
    cfg = compose_config(
        ["debug=smoke", "train.steps=4", "train.checkpoint_every=2", "resume=true"], output_dir=str(tmp_path)
    )
    console = Console(record=True, width=300)
    loop = TrainingLoop(cfg, tmp_path, console)
    loop.close()
    messages = console.export_text()
    assert loop.start_step == 2
    assert f"skipping checkpoint {newest}" in messages and "truncated" in messages


def test_non_finite_updates_are_skipped_then_the_run_stops(tmp_path, monkeypatch):
    real = learner_module.score_microbatch  # the training forward's (PolicyScorer)

    def poisoned(*args, **kwargs):
        out = real(*args, **kwargs)
        return {**out, "log_probs": out["log_probs"] * float("nan")}

    # A reward that varies: a flat step (every group one reward, as the tiny model's keyword rewards are) computes
    # no row, so there would be nothing to poison.
    varying = ["task=lipogram", "task.reward_weights.correctness=0", "task.reward_weights.answer=1"]
    loop = make_trainer(tmp_path, [*varying, "train.steps=10", "train.max_nonfinite_steps=2", "train.eval_every=0"])
    model = loop.executor.learner.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(learner_module, "score_microbatch", poisoned)
    with pytest.raises(RunStopped) as info:
        loop.run()
    assert info.value.exit_code == 3 and "not finite in 2 consecutive steps" in str(info.value)
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert [r["train/nonfinite_skipped"] for r in rows] == [1, 1]
    # the skipped updates left the weights untouched, and they were checkpointed
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert list_checkpoints(tmp_path)[-1].name == "step_000002"


def test_checkpoint_holds_what_resume_needs(tmp_path):
    make_trainer(tmp_path, ["train.steps=2", "train.checkpoint_every=1", "train.keep_checkpoints=1"]).run()
    (checkpoint,) = list_checkpoints(tmp_path)
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["step"] == 2 and state["sampler"]["position"] == 4  # 2 steps x 2 prompts
    assert {"python", "torch"} <= torch.load(checkpoint / "rng.pt", weights_only=False).keys()


FLAKY_ENVIRONMENT = """
import os


class Flaky:
    def step(self, messages):
        if os.path.exists({marker!r}):
            raise RuntimeError("the board broke")
        return [{{"role": "user", "content": "Again."}}], float(len(messages[-1]["content"]) % 2), False
"""


def test_an_environment_failing_at_step_2_stops_the_run_with_step_1_kept(tmp_path):
    # As a reward function failing at step 2 does (tests/e2e/test_custom_task_e2e.py): one line, step 1's update
    # saved, how to resume (under skip the run goes on: test_episode_rollout.py's skipped-episode test).
    marker = tmp_path / "broken"
    (tmp_path / "flaky_env.py").write_text(FLAKY_ENVIRONMENT.format(marker=str(marker)))
    loop = make_trainer(
        tmp_path / "run",
        [
            "task=guess_number",
            f"task.environment={tmp_path / 'flaky_env.py'}:Flaky",
            "task.max_turns=2",
            "task.reward_workers=0",
            "task.on_reward_error=stop",
            "rollout.max_tokens=4",
            "train.steps=2",
            "train.eval_every=0",
            "model.mixed_precision=no",
        ],
    )
    real_step = loop.executor.step

    def step(number: int):
        if number == 2:
            marker.touch()  # the environment breaks from step 2 on
        return real_step(number)

    loop.executor.step = step
    with pytest.raises(RunStopped) as info:
        loop.run()
    line = str(info.value)
    assert info.value.exit_code == 2 and "\n" not in line
    assert line.startswith("task.environment: the environment raised RuntimeError: the board broke on the row")
    assert "step 1's update is saved in" in line and f"grpo-run resume={tmp_path / 'run'}" in line
    (kept,) = list_checkpoints(tmp_path / "run")
    assert kept.name == "step_000001" and verify_checkpoint(kept) is None
