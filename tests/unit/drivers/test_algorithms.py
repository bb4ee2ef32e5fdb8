"""The algorithm presets, their config keys and one-line errors, dynamic sampling, and the learner's sampler/learner
mismatch correction (the math itself: tests/unit/core/; token_mean over microbatches and ranks:
tests/unit/learner/test_step_totals.py)."""

from __future__ import annotations

import json

import pytest
import torch

from grpo_cli.batch.rollout_data import RolloutData, concat_rollouts, select_completions
from grpo_cli.config import validate_config
from grpo_cli.drivers.dynamic_sampling import SignalBatch, extra_round_batch_number, groups_with_signal
from grpo_cli.errors import UserFacingError
from tests.conftest import compose_config

# --- the presets: what each sets, and that everything stays overridable -----------------------------------------

PRESETS = {
    "grpo": {"loss.type": "grpo_clip", "loss.cliprange_high": None, "normalization.advantage": "std",
             "normalization.length": "sequence_mean", "kl.beta": 0.04, "train.dynamic_sampling": False},
    "dr_grpo": {"loss.type": "grpo_clip", "normalization.advantage": "mean", "normalization.length": "constant",
                "kl.beta": 0.0},
    "dapo": {"loss.type": "grpo_clip", "loss.cliprange": 0.2, "loss.cliprange_high": 0.28,
             "normalization.length": "token_mean", "train.dynamic_sampling": True,
             "task.reward_weights.overlong": 1.0, "kl.beta": 0.0},
    "gspo": {"loss.type": "gspo", "loss.cliprange": 3e-4, "loss.cliprange_high": 4e-4,
             "normalization.length": "sequence_mean", "kl.beta": 0.0},
    "cispo": {"loss.type": "cispo", "loss.cliprange_high": 0.28, "normalization.length": "token_mean",
              "kl.beta": 0.0},
    "rloo": {"loss.type": "reinforce_with_baseline", "normalization.advantage": "rloo",
             "normalization.length": "constant", "kl.beta": 0.0},
}  # fmt: skip


def value(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_sets_its_papers_choices_and_validates(name):
    cfg = compose_config([f"algorithm={name}"])
    assert {key: value(cfg, key) for key in PRESETS[name]} == PRESETS[name]
    validate_config(cfg)


def test_a_preset_stays_overridable_by_key_group_and_experiment():
    cfg = compose_config(["algorithm=dapo", "loss.cliprange_high=0.3", "train.dynamic_sampling=false"])
    assert (cfg.loss.cliprange_high, cfg.train.dynamic_sampling, cfg.loss.type) == (0.3, False, "grpo_clip")
    cfg = compose_config(["algorithm=gspo", "loss=grpo_clip"])  # the command line's group choice wins
    assert (cfg.loss.type, cfg.loss.cliprange, cfg.loss.cliprange_high) == ("grpo_clip", 0.2, None)
    cfg = compose_config(["algorithm=grpo", "experiment=keyword_ablation"])
    assert cfg.kl.beta == 0.04 and cfg.train.steps == 12


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["loss.dual_clip=3"], "loss.dual_clip=3.0 bounds grpo_clip's ratio, but loss=reinforce_with_baseline"),
        (["loss.dual_clip=0.5", "loss=grpo_clip"], "loss.dual_clip"),
        (["loss.cliprange_high=0.28"], "loss.cliprange_high=0.28 clips an importance ratio"),
        (["normalization.advantage=rloo", "train.group_size=1", "train.rollout_batch_size=4",
          "train.train_batch_size=4"], "train.group_size=1 with normalization.advantage=rloo"),
        (["train.dynamic_sampling=true", "normalization.advantage=mean", "train.group_size=1",
          "train.rollout_batch_size=4", "train.train_batch_size=4"], "with train.dynamic_sampling=true"),
        (["rollout.importance_threshold=2", "rollout.importance_threshold_low=3"], "the band \\[low, C\\] is empty"),
        (["normalization.length=seq_mean"], "normalization.length"),
        (["sync=multi_epoch", "sync.epochs_per_rollout_batch=2"], "use loss=grpo_clip .*, gspo or cispo"),
        (["kl.beta=0.1", "kl.beta_final=0"], "kl.beta_final=0.0 is where a KL schedule ends, but .*=constant"),
        (["kl.beta=0.1", "kl.beta_schedule=cosine"], "kl.beta_schedule=cosine moves .* set kl.beta_final"),
    ],
)  # fmt: skip
def test_settings_that_cannot_act_are_one_line_errors(overrides, message):
    with pytest.raises(UserFacingError, match=message):
        validate_config(compose_config(overrides))


def test_the_ratio_losses_run_off_policy():
    for loss in ("gspo", "cispo"):
        validate_config(compose_config([f"loss={loss}", "sync=multi_epoch", "sync.epochs_per_rollout_batch=2"]))


# --- dynamic sampling -------------------------------------------------------------------------------------------


def rollout(rewards: list[float], tag: int = 0) -> RolloutData:
    n = len(rewards)
    return RolloutData(
        prompt_ids=[[tag, i // 2] for i in range(n)],
        completion_ids=[[tag, i] for i in range(n)],
        raw_rewards=torch.tensor(rewards),
        advantages=torch.zeros(n),
        sampler_log_probs=[torch.tensor([-0.5, -1.0]) for _ in range(n)],
        metrics={"train/reward": sum(rewards) / n, "time/generation_s": 1.0},
    )


def test_groups_with_signal_are_those_whose_rewards_differ():
    assert groups_with_signal(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), 2) == [1]


def test_signal_batch_fills_from_later_rounds_and_recomputes_advantages():
    signal = SignalBatch(group_size=2, target_groups=2, advantage="batch_std", advantage_eps=0.0)
    signal.add(rollout([1.0, 1.0, 0.0, 1.0]))  # group 0 all equal: dropped
    assert (signal.kept_groups, signal.full) == (1, False)
    signal.add(rollout([0.0, 0.0, 1.0, 0.0], tag=1))
    assert signal.full
    batch = signal.batch()
    assert batch.completion_ids == [[0, 2], [0, 3], [1, 2], [1, 3]]
    assert len(batch.sampler_log_probs) == 4
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.0])
    torch.testing.assert_close(batch.advantages, torch.tensor([-0.5, 0.5, 0.5, -0.5]) / rewards.std())
    assert batch.metrics["train/groups_dropped"] == 2 and batch.metrics["train/extra_rounds"] == 1
    assert batch.metrics["train/groups_short"] == 0 and batch.metrics["time/generation_s"] == 2.0
    assert batch.metrics["train/reward"] == pytest.approx(0.5)  # the trained batch: [0, 1, 1, 0]
    assert batch.metrics["train/reward_all_sampled"] == pytest.approx(0.5)  # every round's: (.75 + .25) / 2


def test_dynamic_sampling_reads_only_the_scored_rewards_of_a_group_with_skipped_episodes():
    from grpo_cli.core import compute_advantages

    # G = 3. Round 1: group 0's scored rewards are all 1 (its skipped episode's placeholder 0 is no signal), group 1
    # differs among its scored ones. Round 2: group 0 differs.
    first, second = rollout([1.0, 0.0, 1.0, 2.0, 0.0, 0.0]), rollout([0.5, 1.0, 0.0, 1.0, 1.0, 1.0], tag=1)
    first.scored = torch.tensor([True, False, True, True, True, False])
    signal = SignalBatch(group_size=3, target_groups=2, advantage="std", advantage_eps=1e-6)
    signal.add(first)
    assert signal.kept_groups == 1  # group 1 only (before: group 0 too, by its placeholder)
    signal.add(second)
    batch = signal.batch()
    assert batch.scored is not None and batch.scored.tolist() == [True, True, False, True, True, True]
    # Independent: each group's scored rewards alone through compute_advantages; the skipped one gets 0.
    expected = torch.zeros(6)
    expected[[0, 1]] = compute_advantages(torch.tensor([2.0, 0.0]), 2, "std", 1e-6)
    expected[[3, 4, 5]] = compute_advantages(torch.tensor([0.5, 1.0, 0.0]), 3, "std", 1e-6)
    torch.testing.assert_close(batch.advantages, expected)
    assert batch.metrics["train/reward"] == pytest.approx((2.0 + 0.0 + 0.5 + 1.0 + 0.0) / 5)


def test_signal_batch_trains_on_fewer_when_the_rounds_run_out():
    signal = SignalBatch(group_size=2, target_groups=2, advantage="std", advantage_eps=1e-6)
    signal.add(rollout([1.0, 0.0, 1.0, 1.0]))
    batch = signal.batch()
    assert len(batch.completion_ids) == 2
    assert (batch.metrics["train/groups_trained"], batch.metrics["train/groups_short"]) == (1, 1)
    empty = SignalBatch(group_size=2, target_groups=2, advantage="std", advantage_eps=1e-6)
    empty.add(rollout([1.0, 1.0, 0.0, 0.0]))
    # no group with signal at all: the first round as it was (zero advantages), and the metrics say so
    assert len(empty.batch().completion_ids) == 4 and empty.batch().metrics["train/groups_trained"] == 0


def test_extra_rounds_sample_with_seeds_no_step_uses():
    assert extra_round_batch_number(5, 0) == 5
    assert len({extra_round_batch_number(s, r) for s in range(1, 100) for r in range(4)}) == 99 * 4


def test_select_and_concat_keep_every_per_completion_field():
    a, b = rollout([1.0, 0.0]), rollout([0.0, 1.0], tag=1)
    b.loss_mask = torch.tensor([0.0, 1.0])
    joined = concat_rollouts([a, b])
    assert joined.loss_mask.tolist() == [1.0, 1.0, 0.0, 1.0] and len(joined.sampler_log_probs) == 4
    picked = select_completions(joined, [3, 0])
    assert picked.completion_ids == [[1, 1], [0, 0]] and picked.loss_mask.tolist() == [1.0, 1.0]


def test_replay_trajectories_carry_the_sampler_log_probs():
    from grpo_cli.drivers.ray_executor import join_trajectories, split_trajectories

    data = rollout([1.0, 0.0])
    joined = join_trajectories(split_trajectories(data)[::-1], versions=[3, 2])
    torch.testing.assert_close(joined.sampler_log_probs[0], data.sampler_log_probs[1])


# --- the learner's sampler/learner mismatch correction -----------------------------------------------------------


def learner_and_batch(tmp_path, overrides: list[str]):
    from grpo_cli.learner.learner import Learner

    cfg = compose_config(["debug=smoke", *overrides], output_dir=str(tmp_path))
    learner = Learner(cfg, tmp_path)
    learner.optimizer.step = lambda: None  # keep the weights: only gradients and metrics are compared
    data = RolloutData(
        [[1, 2, 3]] * 4,
        [[5, 6], [7, 8, 9], [10], [11, 12]],
        torch.tensor([1.0, 0.0, 1.0, 0.0]),
        torch.tensor([0.8, -0.3, 0.5, -1.0]),
    )
    exact = learner.log_probs_under(learner.model, data)
    return learner, data, exact


def test_the_mismatch_is_measured_and_a_masked_correction_drops_what_is_beyond_it(tmp_path):
    learner, data, exact = learner_and_batch(
        tmp_path, ["rollout.importance_correction=masked", "rollout.importance_threshold=1.5"]
    )
    # the sampler saw completion 1's tokens with 4x the learner's probability (ratio 1/4 < 1/1.5): masked
    data.sampler_log_probs = [lp + (1.3863 if i == 1 else 0.0) for i, lp in enumerate(exact)]
    metrics = learner.update(data, step=1)
    # a mean over the 2 microbatches: 3 of the 5 response tokens of the first, none of the second
    assert metrics["train/importance_masked_frac"] == pytest.approx((3 / 5 + 0) / 2)
    assert metrics["train/importance_weight_max"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["train/sampler_kl"] > 0.1
    # the same batch without completion 1's tokens in the loss
    masked = torch.cat([p.grad.flatten() for p in learner.trainable_parameters]).clone()
    data.sampler_log_probs = exact
    data.loss_mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    learner.cfg.rollout.importance_correction = "none"
    learner.update(data, step=1)
    left_out = torch.cat([p.grad.flatten() for p in learner.trainable_parameters])
    torch.testing.assert_close(masked, left_out, rtol=1e-4, atol=1e-6)


def test_a_rejected_response_leaves_token_means_step_total_when_old_log_probs_fix_it_first(tmp_path):
    # token_mean, masked at the sequence level: completion 1 (3 of the step's 8 tokens) is rejected whole
    overrides = ["rollout.importance_correction=masked", "rollout.importance_level=sequence"]
    # no gradient clipping, fp32: the gradients are compared as they come out of the loss, up to a scale
    learner, data, exact = learner_and_batch(
        tmp_path, [*overrides, "normalization.length=token_mean", "train.max_grad_norm=1e9", "model.mixed_precision=no"]
    )
    sampler = [lp + (1.3863 if i == 1 else 0.0) for i, lp in enumerate(exact)]  # completion 1: ratio 1/4
    grads = {}
    for old_log_probs in (True, False):
        learner.needs_old_log_probs = old_log_probs  # sync.old_log_probs=true|false
        data.old_log_probs, data.sampler_log_probs = None, sampler
        metrics, _ = learner.learn(data, step=1)
        assert metrics["train/importance_masked_frac"] == pytest.approx((3 / 5 + 0) / 2)
        grads[old_log_probs] = torch.cat([p.grad.flatten() for p in learner.trainable_parameters]).clone()
    # the same batch with completion 1 left out by train.mask_truncated instead: its tokens do not count either
    learner.cfg.rollout.importance_correction = "none"
    data.old_log_probs, data.sampler_log_probs, data.loss_mask = None, exact, torch.tensor([1.0, 0.0, 1.0, 1.0])
    learner.learn(data, step=1)
    left_out = torch.cat([p.grad.flatten() for p in learner.trainable_parameters])
    torch.testing.assert_close(grads[True], left_out, rtol=1e-4, atol=1e-6)
    # without old log-probs the rejection is known only in the step's forward: the 3 tokens stay in the total (8)
    torch.testing.assert_close(grads[False], left_out * 5 / 8, rtol=1e-4, atol=1e-6)


def test_a_correction_without_sampler_log_probs_is_one_line(tmp_path):
    learner, data, _ = learner_and_batch(tmp_path, ["rollout.importance_correction=truncated"])
    with pytest.raises(UserFacingError, match="rollout.importance_correction=truncated needs the sampler's"):
        learner.learn(data, step=1)


# --- dynamic sampling through the executors ----------------------------------------------------------------------


def test_dynamic_sampling_in_process_fills_the_batch_or_says_what_is_missing(tmp_path, letter_e_task):
    from rich.console import Console

    from grpo_cli.drivers.loop import TrainingLoop

    cfg = compose_config(
        ["debug=smoke", "train.eval_every=0", "task.name=letter_e", "train.steps=3", "train.dynamic_sampling=true"],
        output_dir=str(tmp_path),
    )
    validate_config(cfg)
    TrainingLoop(cfg, tmp_path, Console(quiet=True)).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/loss" in r]
    assert len(train) == 3
    for row in train:
        # debug=smoke: 2 groups of 2 per step
        assert row["train/groups_trained"] + row["train/groups_short"] == 2
        assert 0 <= row["train/extra_rounds"] <= 3
        # a round is only added while the batch is short; dropped groups are what made it short
        assert row["train/groups_dropped"] >= row["train/extra_rounds"]
    assert any(row["train/groups_trained"] > 0 for row in train)  # the letter-e reward varies within groups
