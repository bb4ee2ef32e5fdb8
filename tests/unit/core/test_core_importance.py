"""compute_importance_weights: TIS and MIS at token and sequence level, by hand and against verl 0.9.1's own
functions (values stored by tests/fixtures/make_verl_importance_reference.py)."""

import json
import math

import pytest
import torch

from grpo_cli.core import compute_importance_weights
from tests.conftest import FIXTURES

# learner / sampler token ratios: row 0 [3, 1, .25], row 1 [1.5, .8, (masked 100)]
SAMPLER = torch.zeros(2, 3)
LEARNER = torch.tensor([[math.log(3), 0.0, math.log(0.25)], [math.log(1.5), math.log(0.8), math.log(100)]])
MASK = torch.tensor([[True, True, True], [True, True, False]])


def test_none_weighs_one_and_reports_the_ratio() -> None:
    weights, meta = compute_importance_weights(LEARNER, SAMPLER, MASK, "none")
    assert torch.equal(weights, MASK.float())  # 1 on response tokens, 0 off them (as verl's weights)
    torch.testing.assert_close(meta["ratio"], torch.tensor([[3.0, 1.0, 0.25], [1.5, 0.8, 1.0]]))


def test_truncated_caps_token_ratios() -> None:
    weights, meta = compute_importance_weights(LEARNER, SAMPLER, MASK, "truncated", threshold=2.0)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 1.0, 0.25], [1.5, 0.8, 0.0]]))
    assert meta["truncated"].tolist() == [[True, False, False], [False, False, False]]


def test_masked_keeps_the_ratio_inside_the_band_and_rejects_outside() -> None:
    # C = 2, low = 1/C = .5: 3 and .25 are rejected, 1.5 and .8 keep their ratio (MIS corrects inside the band);
    # the masked-out 100 is not a response token
    weights, meta = compute_importance_weights(LEARNER, SAMPLER, MASK, "masked", threshold=2.0)
    torch.testing.assert_close(weights, torch.tensor([[0.0, 1.0, 0.0], [1.5, 0.8, 0.0]]))
    assert meta["masked"].tolist() == [[True, False, True], [False, False, False]]
    weights, _ = compute_importance_weights(LEARNER, SAMPLER, MASK, "masked", threshold=4.0, threshold_low=0.9)
    torch.testing.assert_close(weights, torch.tensor([[3.0, 1.0, 0.0], [1.5, 0.0, 0.0]]))


def test_sequence_level_uses_the_product_of_token_ratios() -> None:
    # row 0: 3 * 1 * .25 = .75; row 1: 1.5 * .8 = 1.2
    weights, meta = compute_importance_weights(LEARNER, SAMPLER, MASK, "truncated", "sequence", threshold=1.0)
    torch.testing.assert_close(weights, torch.tensor([[0.75] * 3, [1.0, 1.0, 0.0]]))
    torch.testing.assert_close(meta["ratio"][1, :2], torch.tensor([1.2, 1.2]))
    weights, meta = compute_importance_weights(LEARNER, SAMPLER, MASK, "masked", "sequence", 1.1, 0.5)
    torch.testing.assert_close(weights, torch.tensor([[0.75] * 3, [0.0, 0.0, 0.0]]))  # row 1 rejected whole
    assert meta["masked"].tolist() == [[False] * 3, [True, True, False]]


def test_weights_carry_no_gradient_and_bad_arguments_are_named() -> None:
    learner = LEARNER.clone().requires_grad_()
    weights, _ = compute_importance_weights(learner, SAMPLER, MASK, "truncated")
    assert not weights.requires_grad
    with pytest.raises(ValueError, match="unknown importance correction 'tis'"):
        compute_importance_weights(LEARNER, SAMPLER, MASK, "tis")
    with pytest.raises(ValueError, match="0 < low <= C"):
        compute_importance_weights(LEARNER, SAMPLER, MASK, "masked", threshold=2.0, threshold_low=3.0)


VERL_REFERENCE = json.loads((FIXTURES / "verl_importance_reference.json").read_text())


@pytest.mark.parametrize("case", VERL_REFERENCE["cases"], ids=[case["name"] for case in VERL_REFERENCE["cases"]])
def test_weights_and_rejections_equal_verls(case: dict) -> None:
    # verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_weights with a "low_C" threshold (IcePop / MIS)
    # or a single C (TIS), and for MIS its compute_rollout_rejection_mask, on the same tensors (padded rows, an
    # empty row, one ratio of e^25).
    mask = torch.tensor(case["response_mask"])
    weights, meta = compute_importance_weights(
        torch.tensor(case["learner_log_probs"]),
        torch.tensor(case["sampler_log_probs"]),
        mask,
        case["mode"],
        case["level"],
        case["threshold"],
        case["threshold_low"],
    )
    torch.testing.assert_close(weights[mask], torch.tensor(case["weights"])[mask], rtol=1e-6, atol=0.0)
    if case["mode"] == "masked":
        assert meta["masked"].tolist() == case["rejected"]
