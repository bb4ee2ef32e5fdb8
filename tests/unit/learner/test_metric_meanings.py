"""Metrics report what their names say (docs/tracking.md#metrics), each checked against the value computed
directly from the batch: `train/kl` under `train.mask_truncated` (the completions kept in the loss),
`train/reward` under `train.dynamic_sampling` (the batch the update trains on) and `throughput/tokens_per_s`
over data-parallel ranks (every rank's tokens; the collectives on a real two-process gloo group are in
tests/unit/distributed/test_distributed.py)."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_cli.batch.rollout_data import RolloutData
from grpo_cli.drivers.dynamic_sampling import SignalBatch
from tests.conftest import compose_config


def one_row_log_probs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log p(completion | prompt) per token by one unpadded forward of prompt + completion (temperature 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()  # (P + C, V)
    predicting = logits[len(prompt) - 1 : -1]  # the positions that predict each completion token
    return torch.log_softmax(predicting, dim=-1).gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)


def test_kl_under_mask_truncated_is_the_mean_over_the_completions_kept_in_the_loss(tmp_path):
    from grpo_cli.learner.learner import Learner

    cfg = compose_config(
        ["debug=smoke", "train.mask_truncated=true", "kl.monitor=true", "model.mixed_precision=no"],
        output_dir=str(tmp_path),
    )
    learner = Learner(cfg, tmp_path)
    learner.optimizer.step = lambda: None  # the KL is measured before the update; keep the weights anyway
    assert learner.shape.microbatch_size == 2 and cfg.rollout.temperature == 1.0
    prompts = [[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]]
    completions = [[5, 6], [7, 8, 9], [10], [11, 12]]
    keep = [1.0, 0.0, 1.0, 1.0]  # microbatches [kept, left out] and [kept, kept]
    # Reference log-probs a chosen distance d below the policy's (d differs per completion): k3 per token is
    # exp(-d) + d - 1, so each completion's KL is known without the learner.
    shifts = [0.2, 0.9, 0.5, 1.1]
    policy = [one_row_log_probs(learner.model, p, c) for p, c in zip(prompts, completions, strict=True)]
    data = RolloutData(
        prompts,
        completions,
        raw_rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]),
        advantages=torch.tensor([0.5, -0.5, 0.5, -0.5]),
        ref_log_probs=[lp - d for lp, d in zip(policy, shifts, strict=True)],
        loss_mask=torch.tensor(keep),
    )
    metrics = learner.update(data, step=1)
    per_completion = [math.exp(-d) + d - 1 for d in shifts]  # k3 = e^(ref - policy) - (ref - policy) - 1
    kept = [kl for kl, k in zip(per_completion, keep, strict=True) if k]
    expected = sum(kl for kl in kept) / len(kept)
    assert metrics["train/kl"] == pytest.approx(expected, rel=1e-4)
    everything_masked = RolloutData(**{**data.__dict__, "loss_mask": torch.zeros(4), "metrics": {}})
    assert "train/kl" not in learner.update(everything_masked, step=2)  # no completion in the loss: no KL


def rounds_batch(rewards: list[float], tag: int) -> RolloutData:
    """One round of a rollout batch, its train/reward as the worker logs it (the mean over the round)."""
    n = len(rewards)
    return RolloutData(
        prompt_ids=[[tag, i // 3] for i in range(n)],
        completion_ids=[[tag, i] for i in range(n)],
        raw_rewards=torch.tensor(rewards),
        advantages=torch.zeros(n),
        metrics={"train/reward": sum(rewards) / n, "train/reward_std": torch.tensor(rewards).std().item()},
    )


def test_dynamic_sampling_reward_is_the_trained_batchs_and_the_sampled_mean_keeps_its_own_name():
    signal = SignalBatch(group_size=3, target_groups=2, advantage="std", advantage_eps=1e-6)
    signal.add(rounds_batch([1.0, 1.0, 1.0, 1.0, 0.0, 0.0], tag=0))  # group 0 all equal: dropped
    signal.add(rounds_batch([0.0, 0.0, 0.0, 1.0, 0.0, 0.0], tag=1))  # group 0 all equal: dropped
    batch = signal.batch()
    assert batch.completion_ids == [[0, 3], [0, 4], [0, 5], [1, 3], [1, 4], [1, 5]]
    trained = batch.raw_rewards
    assert batch.metrics["train/reward"] == pytest.approx(trained.mean().item())  # 1/3; every round's: 5/12
    assert batch.metrics["train/reward_std"] == pytest.approx(trained.std().item())
    assert batch.metrics["train/reward_all_sampled"] == pytest.approx(5 / 12)
    # No group with signal at all: it trains on the first round, and that is its reward.
    empty = SignalBatch(group_size=3, target_groups=2, advantage="std", advantage_eps=1e-6)
    empty.add(rounds_batch([1.0, 1.0, 1.0, 0.0, 0.0, 0.0], tag=0))
    empty.add(rounds_batch([1.0, 1.0, 1.0, 1.0, 1.0, 1.0], tag=1))
    first_round = empty.batch()
    assert first_round.metrics["train/reward"] == 0.5 and first_round.metrics["train/reward_all_sampled"] == 0.75
