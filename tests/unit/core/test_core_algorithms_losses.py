"""The variants beyond the handout's losses: clip-higher, dual-clip, GSPO, CISPO (values and gradients by hand)."""

import math

import pytest
import torch

from grpo_cli.core import compute_cispo_loss, compute_grpo_clip_loss, compute_gspo_loss, compute_policy_gradient_loss

OLD = torch.zeros(2, 4)
# ratios: 0.5 (below 1 - .2), 1.1 (inside), 1.25 (between 1.2 and 1.28), 4.0 (above 1.28 and above c = 3)
RATIOS = torch.tensor([[0.5, 1.1, 1.25, 4.0], [0.5, 1.1, 1.25, 4.0]])
ADVANTAGES = torch.tensor([[1.0], [-1.0]])


def test_clip_higher_moves_only_the_upper_bound() -> None:
    loss, meta = compute_grpo_clip_loss(ADVANTAGES, RATIOS.log(), OLD, cliprange=0.2, cliprange_high=0.28)
    # A = +1: -min(r, clip(r, .8, 1.28)) = -[.5, 1.1, 1.25, 1.28] (1.25 no longer clipped: symmetric cuts at 1.2)
    # A = -1: -min(-r, -clip(r)) = [max(r, clip)] = [.8, 1.1, 1.25, 4.0]
    torch.testing.assert_close(loss, torch.tensor([[-0.5, -1.1, -1.25, -1.28], [0.8, 1.1, 1.25, 4.0]]))
    assert meta["clipped_high"].tolist() == [[False, False, False, True], [False] * 4]
    assert meta["clipped_low"].tolist() == [[False] * 4, [True, False, False, False]]
    symmetric, meta = compute_grpo_clip_loss(ADVANTAGES, RATIOS.log(), OLD, cliprange=0.2)
    assert symmetric[0, 2].item() == pytest.approx(-1.2)
    assert meta["clipped_high"][0].tolist() == [False, False, True, True]


def test_dual_clip_bounds_negative_advantages_only() -> None:
    log_probs = RATIOS.log().clone().requires_grad_()
    loss, meta = compute_grpo_clip_loss(ADVANTAGES, log_probs, OLD, cliprange=0.2, dual_clip=3.0)
    # A = -1, r = 4: the clipped objective -4 is below c * A = -3, so the loss is 3 (not 4) and has no gradient
    torch.testing.assert_close(loss[1], torch.tensor([0.8, 1.1, 1.25, 3.0]))
    torch.testing.assert_close(loss[0], torch.tensor([-0.5, -1.1, -1.2, -1.2]))  # A > 0 untouched
    assert meta["clipped_dual"].tolist() == [[False] * 4, [False, False, False, True]]
    loss.sum().backward()
    # d(-r A)/d log p = -A r: row 1 token 1 (r 1.1, A -1) -> 1.1; token 4 dual-clipped -> 0; token 0 clipped -> 0
    torch.testing.assert_close(log_probs.grad[1], torch.tensor([0.0, 1.1, 1.25, 0.0]))
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        compute_grpo_clip_loss(ADVANTAGES, RATIOS.log(), OLD, cliprange=0.2, dual_clip=0.5)


def test_gspo_uses_one_length_normalized_ratio_per_sequence() -> None:
    mask = torch.tensor([[True, True, False], [True, True, True]])
    old = torch.zeros(2, 3)
    # row 0 token log-ratios .1, .3 (the masked third is ignored): s = exp(.2); row 1: .0, .0, -.3 -> s = exp(-.1)
    log_probs = torch.tensor([[0.1, 0.3, 5.0], [0.0, 0.0, -0.3]], requires_grad=True)
    advantages = torch.tensor([[1.0], [2.0]])
    loss, meta = compute_gspo_loss(advantages, log_probs, old, mask, cliprange=0.2)
    s0, s1 = math.exp(0.2), math.exp(-0.1)
    torch.testing.assert_close(loss[:, 0], torch.tensor([-min(s0, 1.2), -2 * s1]))
    torch.testing.assert_close(meta["ratio"][1], torch.full((3,), s1))
    # the paper's objective: per-sequence loss, mean over sequences; d/d log p_t of -A s = -A s / |y|
    (loss * mask).sum(dim=-1).div(mask.sum(dim=-1)).mean().backward()
    expected_row1 = torch.full((3,), -2 * s1 / 3 / 2)
    torch.testing.assert_close(log_probs.grad[1], expected_row1)
    assert log_probs.grad[0].abs().sum() == 0  # s0 = 1.22 > 1.2 with A > 0: clipped, no gradient


def test_gspo_clip_range_acts_on_the_sequence_ratio() -> None:
    mask = torch.ones(1, 2, dtype=torch.bool)
    # token ratios e^.001 and e^-.001 (each outside GSPO's [1 - 3e-4, 1 + 4e-4]), their geometric mean is 1
    log_probs = torch.tensor([[0.001, -0.001]])
    loss, meta = compute_gspo_loss(torch.ones(1, 1), log_probs, torch.zeros(1, 2), mask, 3e-4, 4e-4)
    torch.testing.assert_close(loss, torch.full((1, 2), -1.0))
    assert not meta["clipped"].any()


def test_cispo_keeps_every_token_gradient_with_a_capped_stopped_weight() -> None:
    log_probs = RATIOS.log().clone().requires_grad_()
    loss, meta = compute_cispo_loss(ADVANTAGES, log_probs, OLD, cliprange_high=0.28)
    weights = torch.tensor([0.5, 1.1, 1.25, 1.28])  # capped at 1.28, no lower bound
    logp = RATIOS.log()
    torch.testing.assert_close(loss, torch.stack([-weights * logp[0], weights * logp[1]]))
    assert meta["clipped_high"].tolist() == [[False, False, False, True]] * 2
    loss.sum().backward()
    # the weight is a constant: d/d log p = -w A, for every token (none loses its gradient, unlike grpo_clip)
    torch.testing.assert_close(log_probs.grad, torch.stack([-weights, weights]))


def test_dispatch_reaches_the_new_losses_and_names_what_is_missing() -> None:
    log_probs = torch.zeros(1, 2)
    loss, _ = compute_policy_gradient_loss(
        log_probs, "cispo", advantages=torch.ones(1, 1), old_log_probs=log_probs, cliprange_high=0.28
    )
    torch.testing.assert_close(loss, torch.zeros(1, 2))  # log p = 0
    loss, _ = compute_policy_gradient_loss(
        log_probs,
        "gspo",
        advantages=torch.ones(1, 1),
        old_log_probs=log_probs,
        cliprange=3e-4,
        response_mask=torch.ones(1, 2),
    )
    torch.testing.assert_close(loss, torch.full((1, 2), -1.0))
    with pytest.raises(ValueError, match="'gspo' needs response_mask"):
        compute_policy_gradient_loss(
            log_probs, "gspo", advantages=torch.ones(1, 1), old_log_probs=log_probs, cliprange=0.1
        )
    with pytest.raises(ValueError, match="'cispo' needs cliprange_high"):
        compute_policy_gradient_loss(log_probs, "cispo", advantages=torch.ones(1, 1), old_log_probs=log_probs)
