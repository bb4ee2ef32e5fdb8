"""compute_importance_weights: TIS and MIS at token and sequence level, by hand."""

import math

import pytest
import torch

from grpo_cli.core import compute_importance_weights

# learner / sampler token ratios: row 0 [3, 1, .25], row 1 [1.5, .8, (masked 100)]
SAMPLER = torch.zeros(2, 3)
LEARNER = torch.tensor([[math.log(3), 0.0, math.log(0.25)], [math.log(1.5), math.log(0.8), math.log(100)]])
MASK = torch.tensor([[True, True, True], [True, True, False]])


def test_none_weighs_one_and_reports_the_ratio() -> None:
    weights, meta = compute_importance_weights(LEARNER, SAMPLER, MASK, "none")
    assert (weights == 1).all()
    torch.testing.assert_close(meta["ratio"], torch.tensor([[3.0, 1.0, 0.25], [1.5, 0.8, 1.0]]))


def test_truncated_caps_token_ratios() -> None:
    weights, meta = compute_importance_weights(LEARNER, SAMPLER, MASK, "truncated", threshold=2.0)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 1.0, 0.25], [1.5, 0.8, 1.0]]))
    assert meta["truncated"].tolist() == [[True, False, False], [False, False, False]]


def test_masked_drops_tokens_outside_the_band() -> None:
    # C = 2, low = 1/C = .5: 3 and .25 are dropped; the masked-out 100 is not a response token
    weights, meta = compute_importance_weights(LEARNER, SAMPLER, MASK, "masked", threshold=2.0)
    torch.testing.assert_close(weights, torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.0, 1.0]]))
    assert meta["masked"].sum() == 2
    weights, _ = compute_importance_weights(LEARNER, SAMPLER, MASK, "masked", threshold=4.0, threshold_low=0.9)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]]))


def test_sequence_level_uses_the_product_of_token_ratios() -> None:
    # row 0: 3 * 1 * .25 = .75; row 1: 1.5 * .8 = 1.2
    weights, meta = compute_importance_weights(LEARNER, SAMPLER, MASK, "truncated", "sequence", threshold=1.0)
    torch.testing.assert_close(weights, torch.tensor([[0.75] * 3, [1.0, 1.0, 1.0]]))
    torch.testing.assert_close(meta["ratio"][1, :2], torch.tensor([1.2, 1.2]))
    weights, meta = compute_importance_weights(LEARNER, SAMPLER, MASK, "masked", "sequence", 1.1, 0.5)
    torch.testing.assert_close(weights, torch.tensor([[1.0] * 3, [0.0, 0.0, 1.0]]))  # row 1 dropped whole
    assert meta["masked"].tolist() == [[False] * 3, [True, True, False]]


def test_weights_carry_no_gradient_and_bad_arguments_are_named() -> None:
    learner = LEARNER.clone().requires_grad_()
    weights, _ = compute_importance_weights(learner, SAMPLER, MASK, "truncated")
    assert not weights.requires_grad
    with pytest.raises(ValueError, match="unknown importance correction 'tis'"):
        compute_importance_weights(LEARNER, SAMPLER, MASK, "tis")
    with pytest.raises(ValueError, match="0 < low <= C"):
        compute_importance_weights(LEARNER, SAMPLER, MASK, "masked", threshold=2.0, threshold_low=3.0)
