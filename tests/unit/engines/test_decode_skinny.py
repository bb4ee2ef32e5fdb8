"""The decode steps' linear layers on few rows (engines/hf_internals.py `skinny_linears`, issue #59 item 3).

- inside the decode scope every plain nn.Linear of the model computes F.linear's product (by W @ x^T), the model's
  logits equal its plain forward's within fp32 rounding, LoRA adapters included, and nothing is left patched after;
- no TorchFunctionMode is active while the steps run: the SkinnyLinear mode this replaced made every torch call
  of a decode step (thousands per token) pass through Python, which the profile of a step measured
  (docs/results/2026-12-06-step-profile.md);
- with autograd on, or on more than SKINNY_ROWS rows, the layers run F.linear itself.
"""

from __future__ import annotations

import torch

from grpo_cli.engines import hf_internals
from grpo_cli.engines.hf_internals import SKINNY_ROWS, decode_scope, skinny_linears
from tests.unit.engines.test_decode import tiny_lm, with_lora


def _linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def test_decode_scope_runs_the_linear_layers_skinny_and_no_torch_function_mode(monkeypatch):
    torch.manual_seed(0)
    model = with_lora(tiny_lm())
    ids = torch.randint(3, 128, (4, 1))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    mm_shapes = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: mm_shapes.append(tuple(a.shape)) or mm(a, b))
    modes_inside = []
    config = hf_internals.base_model(model).config
    with torch.no_grad(), decode_scope(config, grouped_attention=False, skinny=model):
        modes_inside.append(torch._C._len_torch_function_stack())
        logits = model(input_ids=ids).logits
    assert modes_inside == [0]  # nothing intercepts the step's other torch calls
    # Every plain linear layer (base layers, LoRA A and B, the head) ran W @ x^T once: (out, in) first.
    assert sorted(mm_shapes) == sorted(tuple(m.weight.shape) for m in _linears(model))
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert all("forward" not in m.__dict__ for m in _linears(model))  # undone on exit


def test_skinny_linears_keep_f_linear_with_autograd_or_many_rows(monkeypatch):
    torch.manual_seed(0)
    layer = torch.nn.Linear(40, 300)
    few, many = torch.randn(4, 1, 40), torch.randn(SKINNY_ROWS + 1, 40)
    calls = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: calls.append(tuple(a.shape)) or mm(a, b))
    with skinny_linears(layer):
        with torch.no_grad():
            out_few, out_many = layer(few), layer(many)
        out_grad = layer(few)  # a training forward: F.linear, differentiable
    assert calls == [(300, 40)]  # the few rows without autograd only
    assert out_few.shape == (4, 1, 300) and out_few.is_contiguous()
    reference = torch.nn.functional.linear(few, layer.weight, layer.bias).detach()
    torch.testing.assert_close(out_few, reference, rtol=1e-6, atol=1e-6)
    assert torch.equal(out_many, torch.nn.functional.linear(many, layer.weight, layer.bias).detach())
    assert out_grad.requires_grad and torch.equal(out_grad.detach(), reference)
