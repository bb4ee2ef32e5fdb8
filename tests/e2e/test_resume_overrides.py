"""resume= never drops an override silently (config.resume.resumed_config), and init_from= branches a new run from a
checkpoint's weights: through the real `grpo-run`, on one 2-step smoke run shared by the tests of this module."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_grpo
from safetensors.torch import load_file

from grpo_cli.learner.checkpoint import CheckpointError, init_from_checkpoint, list_checkpoints, load_weights

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("resume")
    run_dir = root / "run"
    done = run_grpo(["debug=smoke", "train.checkpoint_every=1", f"hydra.run.dir={run_dir}"], cwd=root)
    assert done.returncode == 0, done.stderr
    return run_dir


def test_an_override_resume_cannot_apply_stops_with_one_line_naming_it(finished_run: Path) -> None:
    before = (finished_run / "config.yaml").read_text()
    stopped = run_grpo([f"resume={finished_run}", "optim.lr=0.5"], cwd=finished_run.parent)
    assert stopped.returncode == 2
    line = stopped.stderr.strip()
    assert "\n" not in line and "optim.lr" in line and f"init_from={finished_run}" in line, stopped.stderr
    assert (finished_run / "config.yaml").read_text() == before  # nothing of the run was touched


def test_overrides_safe_on_resume_apply_and_are_recorded(finished_run: Path) -> None:
    resumed = run_grpo(
        [f"resume={finished_run}", "train.steps=3", "train.eval_every=1", f"hydra.run.dir={finished_run.parent / 'r'}"],
        cwd=finished_run.parent,
    )
    assert resumed.returncode == 0, resumed.stderr
    steps = [json.loads(line)["step"] for line in (finished_run / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 3
    info = json.loads((finished_run / "run_info.json").read_text())
    assert {"train.steps=3", "train.eval_every=1"} <= set(info["resumes"][-1]["overrides"])
    config = (finished_run / "config.yaml").read_text()
    assert "eval_every: 1" in config and "steps: 3" in config


def test_init_from_starts_a_new_run_from_the_checkpoints_weights(finished_run: Path, tmp_path: Path) -> None:
    branch = tmp_path / "branch"
    result = run_grpo(
        [f"init_from={finished_run}", "debug=smoke", "optim.lr=0.5", "train.steps=1", f"hydra.run.dir={branch}"],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    steps = [json.loads(line)["step"] for line in (branch / "metrics.jsonl").read_text().splitlines()]
    assert min(steps) == 0 and max(steps) == 1  # a new run: step 0, not the source run's step
    assert "init_from:" in (branch / "config.yaml").read_text()


def test_init_from_loads_the_newest_complete_checkpoints_weights(finished_run: Path) -> None:
    from grpo_cli.models import TINY_RANDOM, load_policy

    newest = list_checkpoints(finished_run)[-1]
    assert init_from_checkpoint(str(finished_run)) == newest
    assert init_from_checkpoint(str(newest)) == newest
    model, _ = load_policy(TINY_RANDOM, torch.device("cpu"), torch.float32, seed=0)
    load_weights(newest, model)
    saved = load_file(str(newest / "model.safetensors"))
    name = next(iter(saved))
    assert torch.equal(dict(model.named_parameters())[name].detach(), saved[name])
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        init_from_checkpoint(str(finished_run / "eval"))
