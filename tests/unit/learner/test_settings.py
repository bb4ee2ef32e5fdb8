"""The settings the learner builds once from the config (grpo_cli/learner/settings.py): every pass that scores
completions, the generator's behaviour log-probs included, gets the same ScoringSettings; the loss's settings
carry the config's loss keys."""

from __future__ import annotations

import pytest

from grpo_cli.core import LossSettings
from grpo_cli.learner.batch import ScoringSettings
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
    )
    assert loss_settings(compose_config(["loss=cispo", "loss.cliprange_high=0.28"])).cliprange_high == pytest.approx(
        0.28
    )
