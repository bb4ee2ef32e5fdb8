"""aggregate_token_loss: the three length normalizations by hand, and shares that add up to the step's loss."""

import pytest
import torch

from grpo_cli.core import aggregate_token_loss

# row 0: 2 response tokens with losses 1, 3; row 1: 4 tokens with losses 2, 2, 2, 6
LOSS = torch.tensor([[1.0, 3.0, 99.0, 99.0], [2.0, 2.0, 2.0, 6.0]])
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])


def test_the_three_modes_by_hand() -> None:
    # sequence_mean: (2 + 3) / 2 = 2.5; constant 8: (4/8 + 12/8) / 2 = 1; token_mean: 16 / 6
    torch.testing.assert_close(aggregate_token_loss(LOSS, MASK, "sequence_mean"), torch.tensor(2.5))
    torch.testing.assert_close(aggregate_token_loss(LOSS, MASK, "constant", 8.0), torch.tensor(1.0))
    torch.testing.assert_close(aggregate_token_loss(LOSS, MASK, "token_mean"), torch.tensor(16 / 6))


def test_token_mean_gives_every_token_the_same_weight() -> None:
    loss = LOSS.clone().requires_grad_()
    aggregate_token_loss(loss, MASK, "token_mean").backward()
    torch.testing.assert_close(loss.grad, MASK.float() / 6)
    loss.grad = None
    aggregate_token_loss(loss, MASK, "sequence_mean").backward()  # short rows weigh more per token
    torch.testing.assert_close(loss.grad, torch.tensor([[0.25, 0.25, 0, 0], [0.125] * 4]))


@pytest.mark.parametrize("mode", ["sequence_mean", "constant", "token_mean"])
def test_microbatch_shares_add_up_to_the_whole_batch(mode: str) -> None:
    whole = aggregate_token_loss(LOSS, MASK, mode, 8.0)
    totals = {"total_sequences": 2.0, "total_tokens": 6.0}
    shares = [aggregate_token_loss(LOSS[i : i + 1], MASK[i : i + 1], mode, 8.0, **totals) for i in range(2)]
    torch.testing.assert_close(sum(shares), whole)


def test_empty_rows_add_zero_and_bad_arguments_are_named() -> None:
    empty = torch.zeros(1, 4, dtype=torch.bool)
    for mode in ("sequence_mean", "token_mean"):
        assert aggregate_token_loss(LOSS[:1], empty, mode).item() == 0.0
    with pytest.raises(ValueError, match="unknown length_normalization 'seq-mean'"):
        aggregate_token_loss(LOSS, MASK, "seq-mean")
    with pytest.raises(ValueError, match="positive normalize_constant"):
        aggregate_token_loss(LOSS, MASK, "constant")
    with pytest.raises(ValueError, match="total_tokens must be > 0"):
        aggregate_token_loss(LOSS, MASK, "token_mean", total_tokens=0)
