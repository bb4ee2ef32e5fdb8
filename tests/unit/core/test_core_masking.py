import pytest
import torch

from grpo_cli.core import masked_mean, masked_normalize

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
BOOL_MASK = torch.tensor([[True, True, False], [False, False, True]])


@pytest.mark.parametrize("mask", [BOOL_MASK, BOOL_MASK.float()], ids=["bool", "float"])
def test_masked_mean(mask: torch.Tensor) -> None:
    # selected: 1, 2 | 6
    torch.testing.assert_close(masked_mean(VALUES, mask), torch.tensor(3.0))  # (1 + 2 + 6) / 3
    torch.testing.assert_close(masked_mean(VALUES, mask, dim=-1), torch.tensor([1.5, 6.0]))  # 3/2, 6/1
    torch.testing.assert_close(masked_mean(VALUES, mask, dim=0), torch.tensor([1.0, 2.0, 6.0]))


@pytest.mark.parametrize("mask", [BOOL_MASK, BOOL_MASK.float()], ids=["bool", "float"])
def test_masked_normalize(mask: torch.Tensor) -> None:
    torch.testing.assert_close(masked_normalize(VALUES, mask, 2.0), torch.tensor(4.5))  # 9 / 2
    # row sums 3 and 6, each / 2
    torch.testing.assert_close(masked_normalize(VALUES, mask, 2.0, dim=-1), torch.tensor([1.5, 3.0]))


def test_masked_mean_of_empty_row_is_nan() -> None:
    # the formula's 0 / 0: documented, and guarded in the train step instead
    result = masked_mean(VALUES, torch.tensor([[True, False, False], [False, False, False]]), dim=-1)
    assert result[0] == 1.0
    assert torch.isnan(result[1])


def test_masked_mean_gradient_only_on_masked_positions() -> None:
    values = VALUES.clone().requires_grad_()
    masked_mean(values, BOOL_MASK).backward()
    torch.testing.assert_close(values.grad, BOOL_MASK.float() / 3)
