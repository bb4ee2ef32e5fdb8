"""The training loop on the tiny random model: it learns, it scores what it sampled, its metrics are honest."""

from pathlib import Path

import pytest
import torch
from rich.console import Console

from grpo_cli import tasks
from grpo_cli.config import validate_config
from grpo_cli.drivers.loop import TrainingLoop
from grpo_cli.drivers.prompts import PromptSampler
from grpo_cli.tasks import Example, TaskSpec
from grpo_cli.tracking import read_metrics
from tests.conftest import build_prompts, compose_config


def run_trainer(tmp_path: Path, overrides: list[str], sharpen: float = 1.0) -> list[dict]:
    cfg = compose_config(["debug=smoke", "task.name=letter_e", *overrides], output_dir=str(tmp_path))
    validate_config(cfg)
    loop = TrainingLoop(cfg, tmp_path, Console(quiet=True))
    if sharpen != 1.0:
        # A fresh random model is uniform over 49k tokens: a bandit with 49k arms that no unit test can wait
        # for. Scaling the (tied) embeddings concentrates it on ~20 plausible tokens (entropy ~3 nats).
        with torch.no_grad():
            loop.executor.learner.model.get_input_embeddings().weight.mul_(sharpen)
    loop.run()
    return read_metrics(tmp_path / "metrics.jsonl")


LEARNING_RUN = [
    "train.steps=30",
    "optim.lr=1e-3",
    "train.rollout_batch_size=16",
    "train.group_size=8",
    "train.train_batch_size=16",
    "train.eval_every=0",
]


@pytest.mark.parametrize("loss", ["reinforce_with_baseline", "no_baseline"])
def test_grpo_climbs_the_reward_on_the_tiny_model(tmp_path, letter_e_task, loss):
    rows = run_trainer(tmp_path, [f"loss={loss}", *LEARNING_RUN], sharpen=10.0)
    rewards = [r["train/reward"] for r in rows if "train/reward" in r]
    assert len(rewards) == 30
    first, last = sum(rewards[:4]) / 4, sum(rewards[-10:]) / 10
    # Seen here (mean of the first 4 steps -> of the last 10), seeds 0-4: reinforce_with_baseline 0.03-0.08 ->
    # 0.22-0.25 (with generate()'s sampler before: 0.06-0.09 -> 0.18-0.67); a sign error would fall. Averaged over
    # 10 steps, as one step's 16 samples are noisy; without learning the reward stays within ~0.05 of the start.
    assert last > first + 0.08, rewards


def test_on_policy_grpo_clip_equals_reinforce_with_baseline(tmp_path, letter_e_task):
    # With one optimizer step per rollout batch the ratio is exactly 1 and nothing is clipped, so grpo_clip's
    # gradient is -A * grad log p: the same run, step for step (the loss values differ: -A * rho averages to
    # 0 over a group, -A * log p does not).
    runs = {}
    for loss in ("reinforce_with_baseline", "grpo_clip"):
        rows = run_trainer(
            tmp_path / loss, [f"loss={loss}", "train.steps=3", "optim.lr=1e-3", "train.eval_every=0"], sharpen=10.0
        )
        runs[loss] = [r[k] for r in rows if "train/loss" in r for k in ("train/reward", "train/grad_norm")]
        if loss == "grpo_clip":
            assert all(r["train/clip_fraction"] == 0.0 for r in rows if r.get("train/optimizer_steps"))
    assert runs["grpo_clip"] == pytest.approx(runs["reinforce_with_baseline"], rel=1e-5, abs=1e-7)


def test_kl_penalty_is_zero_at_the_first_step_and_grows(tmp_path, letter_e_task):
    rows = run_trainer(
        tmp_path, ["kl.beta=0.1", "kl.estimator=k3", "train.steps=6", "optim.lr=3e-3", "train.eval_every=0"]
    )
    kls = [r["train/kl"] for r in rows if "train/kl" in r]
    # the policy equals the reference until the first update, so the first step's KL is exactly 0
    assert kls[0] == pytest.approx(0.0, abs=1e-6)
    assert max(kls[1:]) > 0.0


def test_multi_epoch_reuses_old_log_probs_and_reports_clipping(tmp_path, letter_e_task):
    rows = run_trainer(
        tmp_path,
        [
            "loss=grpo_clip",
            "sync=multi_epoch",
            "sync.epochs_per_rollout_batch=3",
            "optim.lr=3e-3",
            "train.steps=3",
            "train.eval_every=0",
        ],
        sharpen=10.0,  # rewards that vary: a flat step takes no optimizer step and moves nothing
    )
    train_rows = [r for r in rows if "train/loss" in r]
    assert all(r["train/optimizer_steps"] + r["train/flat_steps"] == 3 for r in train_rows)
    assert all(r["time/old_log_probs_s"] > 0 for r in train_rows)
    # later epochs run on a moved policy, so ratios leave 1 and some tokens get clipped at this learning rate
    assert any(r.get("train/clip_fraction", 0.0) > 0 for r in train_rows)


def test_eval_runs_at_start_every_n_steps_and_at_the_end(tmp_path, letter_e_task):
    rows = run_trainer(tmp_path, ["train.steps=5", "train.eval_every=2"])
    assert [r["step"] for r in rows if "eval/reward" in r] == [0, 2, 4, 5]
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == [
        "step_00000.jsonl",
        "step_00002.jsonl",
        "step_00004.jsonl",
        "step_00005.jsonl",
    ]


def test_a_crashing_reward_scores_zero_and_is_counted(tmp_path, monkeypatch, letter_e_task):
    def flaky(response, truth):
        raise RuntimeError("grader bug")

    monkeypatch.setitem(tasks.TASKS, "letter_e", TaskSpec("letter_e", flaky, build_prompts))
    rows = run_trainer(tmp_path, ["train.steps=1", "train.eval_every=0"])
    train = next(r for r in rows if "train/loss" in r)
    assert train["train/reward_errors"] == 4 and train["train/reward"] == 0.0


def test_prompt_sampler_covers_the_data_before_repeating():
    examples = [Example(prompt=str(i), ground_truth=i) for i in range(10)]
    sampler = PromptSampler(examples, seed=0)
    first_pass = [e.ground_truth for e in sampler.next_batch(5) + sampler.next_batch(5)]
    assert sorted(first_pass) == list(range(10))
    again = PromptSampler(examples, seed=0)
    assert [e.ground_truth for e in again.next_batch(10)] == first_pass
