import math

import pytest
import torch

from grpo_cli.core import (
    compute_grpo_clip_loss,
    compute_kl,
    compute_naive_policy_gradient_loss,
    compute_policy_gradient_loss,
)

# Ratios chosen around the clip range [0.8, 1.2] (cliprange .2): 1.5 above it, 1.1 inside, 0.5 below.
OLD_LOG_PROBS = torch.full((2, 3), math.log(0.5))
RATIOS = torch.tensor([[1.5, 1.1, 0.5], [1.5, 1.1, 0.5]])
ADVANTAGES = torch.tensor([[1.0], [-1.0]])


def test_naive_policy_gradient_loss() -> None:
    log_probs = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    # -A * logp: row 0 A = 2 -> [2, 4]; row 1 A = -1 -> [-.5, 0]
    loss = compute_naive_policy_gradient_loss(torch.tensor([[2.0], [-1.0]]), log_probs)
    torch.testing.assert_close(loss, torch.tensor([[2.0, 4.0], [-0.5, 0.0]]))
    # a (batch,) tensor is read as one value per example, not broadcast along the sequence
    torch.testing.assert_close(compute_naive_policy_gradient_loss(torch.tensor([2.0, -1.0]), log_probs), loss)


def test_naive_loss_rejects_wrong_advantage_shape() -> None:
    with pytest.raises(ValueError, match="shape \\(2, 1\\)"):
        compute_naive_policy_gradient_loss(torch.ones(3, 1), torch.zeros(2, 4))


def test_grpo_clip_loss_values_and_clipped_tokens() -> None:
    log_probs = OLD_LOG_PROBS + RATIOS.log()
    loss, metadata = compute_grpo_clip_loss(ADVANTAGES, log_probs, OLD_LOG_PROBS, cliprange=0.2)
    # A = +1: min(1.5, 1.2) = 1.2 (clipped); min(1.1, 1.1) = 1.1; min(.5, .8) = .5   -> loss = -min
    # A = -1: min(-1.5, -1.2) = -1.5; min(-1.1, -1.1) = -1.1; min(-.5, -.8) = -.8 (clipped)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -1.1, -0.5], [1.5, 1.1, 0.8]]))
    assert metadata["clipped"].tolist() == [[True, False, False], [False, False, True]]
    torch.testing.assert_close(metadata["ratio"], RATIOS)


def test_grpo_clip_gradcheck_away_from_the_kinks() -> None:
    old = torch.zeros(2, 3, dtype=torch.float64)
    # log-ratios .5 / .05 / -.5: clip edges are at ln 1.2 = .18 and ln .8 = -.22, far from every point
    log_probs = torch.tensor([[0.5, 0.05, -0.5], [-0.5, 0.05, 0.5]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[0.7], [-1.3]], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda lp: compute_grpo_clip_loss(advantages, lp, old, 0.2)[0], (log_probs,))


def test_policy_gradient_loss_dispatch() -> None:
    log_probs = torch.tensor([[-1.0, -2.0]])
    loss, metadata = compute_policy_gradient_loss(log_probs, "no_baseline", raw_rewards=torch.tensor([[3.0]]))
    torch.testing.assert_close(loss, torch.tensor([[3.0, 6.0]]))
    assert metadata == {}
    loss, _ = compute_policy_gradient_loss(log_probs, "reinforce_with_baseline", advantages=torch.tensor([[-1.0]]))
    torch.testing.assert_close(loss, torch.tensor([[-1.0, -2.0]]))
    # ratio 1 everywhere -> plain -A
    loss, metadata = compute_policy_gradient_loss(
        log_probs, "grpo_clip", advantages=torch.tensor([[2.0]]), old_log_probs=log_probs, cliprange=0.2
    )
    torch.testing.assert_close(loss, torch.tensor([[-2.0, -2.0]]))
    assert set(metadata) == {"clipped", "clipped_low", "clipped_high", "ratio"}


@pytest.mark.parametrize(
    ("loss_type", "kwargs", "message"),
    [
        ("no_baseline", {"advantages": torch.ones(1, 1)}, "'no_baseline' needs raw_rewards"),
        (
            "reinforce_with_baseline",
            {"raw_rewards": torch.ones(1, 1)},
            "'reinforce_with_baseline' needs advantages",
        ),
        ("grpo_clip", {"advantages": torch.ones(1, 1), "cliprange": 0.2}, "'grpo_clip' needs old_log_probs"),
        ("grpo_clip", {"advantages": torch.ones(1, 1)}, "needs old_log_probs, cliprange"),
        ("ppo", {}, "unknown loss_type 'ppo'.*'no_baseline', 'reinforce_with_baseline', 'grpo_clip'"),
    ],
)
def test_policy_gradient_loss_errors(loss_type: str, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compute_policy_gradient_loss(torch.zeros(1, 2), loss_type, **kwargs)


def test_kl_estimators_hand_values() -> None:
    policy = torch.tensor([[0.0, math.log(0.5)]])
    ref = torch.tensor([[math.log(0.5), 0.0]])
    ln2 = math.log(2.0)
    # k1 = logp - logp_ref = [ln 2, -ln 2]
    torch.testing.assert_close(compute_kl(policy, ref, "k1"), torch.tensor([[ln2, -ln2]]))
    # k3: d = logp_ref - logp = [-ln 2, ln 2] -> e^d - d - 1 = [.5 + ln2 - 1, 2 - ln2 - 1] = [.1931, .3069]
    torch.testing.assert_close(compute_kl(policy, ref), torch.tensor([[ln2 - 0.5, 1.0 - ln2]]))


def test_k3_is_nonnegative_and_zero_when_equal() -> None:
    generator = torch.Generator().manual_seed(0)
    policy, ref = -torch.rand(4, 5, generator=generator) * 3, -torch.rand(4, 5, generator=generator) * 3
    assert (compute_kl(policy, ref, "k3") >= 0).all()
    assert (compute_kl(policy, policy, "k3") == 0).all()


def test_kl_unknown_estimator_raises() -> None:
    with pytest.raises(ValueError, match="unknown KL estimator 'k9'.*'k1', 'k3'"):
        compute_kl(torch.zeros(1, 1), torch.zeros(1, 1), "k9")
