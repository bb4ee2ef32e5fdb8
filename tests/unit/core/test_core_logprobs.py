import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from grpo_cli.core import compute_entropy, get_response_log_probs, get_response_log_probs_from_logits

LN2, LN3 = math.log(2.0), math.log(3.0)
# A bigram model over 3 tokens: the logits after token i are row i.
#   after 0: [0, 0, ln2]  -> probs [1/4, 1/4, 1/2]
#   after 1: [ln3, 0, 0]  -> probs [3/5, 1/5, 1/5]
#   after 2: [0, 0, 0]    -> probs [1/3, 1/3, 1/3]
BIGRAM_LOGITS = torch.tensor([[0.0, 0.0, LN2], [LN3, 0.0, 0.0], [0.0, 0.0, 0.0]])


class BigramModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(BIGRAM_LOGITS.clone())
        self.seen_attention_mask: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> SimpleNamespace:
        self.seen_attention_mask = attention_mask
        return SimpleNamespace(logits=self.table[input_ids])  # (B, T, V)


def test_entropy_uniform_is_log_vocab() -> None:
    entropy = compute_entropy(torch.zeros(2, 3, 5))
    torch.testing.assert_close(entropy, torch.full((2, 3), math.log(5.0)))


def test_entropy_one_hot_and_huge_logits_are_finite() -> None:
    logits = torch.tensor([[1e4, 0.0, 0.0], [1e4, 1e4, -1e4], [0.0, 0.0, float("-inf")]])
    entropy = compute_entropy(logits)
    # near one-hot -> 0; two equal huge logits -> ln 2; a -inf entry is simply absent -> ln 2
    assert torch.isfinite(entropy).all()
    torch.testing.assert_close(entropy, torch.tensor([0.0, LN2, LN2]))


def test_entropy_bfloat16_is_computed_in_float32() -> None:
    entropy = compute_entropy(BIGRAM_LOGITS.to(torch.bfloat16).unsqueeze(0))
    assert entropy.dtype == torch.float32
    # H([1/4, 1/4, 1/2]) = 1.5 ln 2; H([3/5, 1/5, 1/5]) = -(.6 ln .6 + .4 ln .2); H(uniform 3) = ln 3
    expected = torch.tensor([[1.5 * LN2, -(0.6 * math.log(0.6) + 0.4 * math.log(0.2)), LN3]])
    torch.testing.assert_close(entropy, expected, atol=1e-2, rtol=0)


def test_get_response_log_probs_exact_values() -> None:
    model = BigramModel()
    input_ids = torch.tensor([[0, 1, 2], [2, 0, 0]])
    labels = torch.tensor([[2, 0, 1], [0, 0, 2]])
    out = get_response_log_probs(model, input_ids, labels, return_token_entropy=True)
    # row 0: p(2|0)=1/2, p(0|1)=3/5, p(1|2)=1/3;  row 1: p(0|2)=1/3, p(0|0)=1/4, p(2|0)=1/2
    expected = torch.tensor([[1 / 2, 3 / 5, 1 / 3], [1 / 3, 1 / 4, 1 / 2]]).log()
    torch.testing.assert_close(out["log_probs"], expected)
    h0, h1, h2 = 1.5 * LN2, -(0.6 * math.log(0.6) + 0.4 * math.log(0.2)), LN3
    torch.testing.assert_close(out["token_entropy"], torch.tensor([[h0, h1, h2], [h2, h0, h0]]))
    assert not out["token_entropy"].requires_grad
    assert model.seen_attention_mask is None

    # log-probs carry the gradient back to the model: d/dz log softmax(z)[2] at z=[0,0,ln2] = onehot - p
    model.zero_grad()
    out = get_response_log_probs(model, input_ids[:1, :1], labels[:1, :1])
    out["log_probs"].sum().backward()
    torch.testing.assert_close(model.table.grad[0], torch.tensor([-0.25, -0.25, 0.5]))


def test_get_response_log_probs_without_entropy_and_with_attention_mask() -> None:
    model = BigramModel()
    mask = torch.ones(1, 2, dtype=torch.long)
    out = get_response_log_probs(model, torch.tensor([[1, 1]]), torch.tensor([[1, 2]]), attention_mask=mask)
    assert set(out) == {"log_probs"}
    assert model.seen_attention_mask is mask
    torch.testing.assert_close(out["log_probs"], torch.tensor([[1 / 5, 1 / 5]]).log())


def test_log_probs_from_bfloat16_logits_are_float32() -> None:
    logits = BIGRAM_LOGITS[torch.tensor([[0, 1]])].to(torch.bfloat16)  # (1, 2, 3)
    out = get_response_log_probs_from_logits(logits, torch.tensor([[2, 0]]))
    assert out["log_probs"].dtype == torch.float32
    torch.testing.assert_close(out["log_probs"], torch.tensor([[0.5, 0.6]]).log(), atol=1e-2, rtol=0)


def test_log_probs_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="labels have shape"):
        get_response_log_probs_from_logits(torch.zeros(1, 3, 4), torch.zeros(1, 2, dtype=torch.long))
