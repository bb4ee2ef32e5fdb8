"""The settings built once from the config (grpo_cli/learner/settings.py, grpo_cli/batch/settings.py): every pass
that scores completions, the generator's behaviour log-probs included, gets the same ScoringSettings; the loss's
settings carry the config's loss keys, and each step trains with its scheduled KL coefficient (kl.beta_schedule)."""

from __future__ import annotations

import pytest
import torch

from grpo_cli.batch.forward import ScoringSettings
from grpo_cli.batch.rollout_data import RolloutData
from grpo_cli.core import LossSettings
from grpo_cli.learner.settings import loss_settings
from tests.conftest import compose_config


def test_the_generator_scores_with_the_learners_scoring_settings(tmp_path):
    from grpo_cli.learner.learner import Learner
    from grpo_cli.rollout.worker import RolloutWorker

    cfg = compose_config(
        ["debug=smoke", "model.mixed_precision=no", "rollout.temperature=0.7", "train.logits_chunk_tokens=3"],
        output_dir=str(tmp_path),
    )
    learner = Learner(cfg, tmp_path)
    worker = RolloutWorker(cfg, learner.model, learner.tokenizer)  # as the Ray generator builds its own
    expected = ScoringSettings(
        temperature=0.7,
        share_prompts=True,
        logits_chunk_tokens=3,
        microbatch_size=2,  # train_batch_size 4 / gradient_accumulation_steps 2
        pad_token_id=learner.tokenizer.pad_token_id,
        prompt_tree=True,  # the tiny Llama's probe passes (core/prompt_tree.py)
    )
    assert learner.scoring == expected and worker.scoring == expected
    assert learner.scorer.scoring is learner.scoring  # the training forward's


def test_loss_settings_read_the_loss_keys():
    cfg = compose_config(
        [
            "loss=cispo",
            "loss.cliprange_high=null",
            "normalization.length=constant",
            "kl.beta=0.04",
            "kl.estimator=k1",
            "rollout.max_tokens=32",
        ]
    )
    settings = loss_settings(cfg)
    assert settings == LossSettings(
        loss_type="cispo",
        cliprange=0.2,
        cliprange_high=0.2,  # cispo's cap falls back to the symmetric range
        length_normalization="constant",
        normalize_constant=32,  # normalization.length_constant null: rollout.max_tokens
        kl_beta=0.04,
        kl_estimator="k1",
        total_steps=cfg.train.steps,
    )
    assert loss_settings(compose_config(["loss=cispo", "loss.cliprange_high=0.28"])).cliprange_high == pytest.approx(
        0.28
    )


def test_each_step_trains_with_and_logs_its_scheduled_kl_coefficient(tmp_path):
    """kl.beta_schedule=linear from 0.2 to 0 over 3 steps, the weights held: the loss of step s is the same policy
    loss plus beta_s times the same KL, and train/kl_beta is beta_s."""
    from grpo_cli.learner.learner import Learner

    overrides = ["debug=smoke", "model.mixed_precision=no", "train.steps=3", "kl.beta=0.2"]
    cfg = compose_config([*overrides, "kl.beta_schedule=linear", "kl.beta_final=0"], output_dir=str(tmp_path))
    learner = Learner(cfg, tmp_path)
    learner.optimizer.step = lambda: None  # the same policy at every step
    torch.manual_seed(0)
    with torch.no_grad():  # a reference away from the policy: a KL > 0
        for parameter in learner.reference.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    metrics = [learner.learn(batch(), step)[0] for step in (1, 2, 3)]
    assert [m["train/kl_beta"] for m in metrics] == pytest.approx([0.2, 0.1, 0.0])
    kl = metrics[0]["train/kl"]
    assert kl > 1e-4 and [m["train/kl"] for m in metrics] == pytest.approx([kl] * 3)
    policy_loss = metrics[2]["train/loss"]  # beta 0 at the last step
    for m in metrics:
        assert m["train/loss"] == pytest.approx(policy_loss + m["train/kl_beta"] * kl, rel=1e-5, abs=1e-7)


def batch() -> RolloutData:
    """Four completions of two prompts (one train batch of debug=smoke: two microbatches of two)."""
    return RolloutData(
        prompt_ids=[[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]],
        completion_ids=[[5, 6], [7, 8, 9], [10], [11, 12]],
        raw_rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]),
        advantages=torch.tensor([0.7, -0.7, 0.7, -0.7]),
    )
