"""model.mixed_precision: bf16 autocast with fp32 master weights where bf16 is fast, fp32 elsewhere."""

from __future__ import annotations

import pytest
import torch

from grpo_cli.models.runtime import autocast_factory, has_fast_bf16

CPU = torch.device("cpu")


def autocast_dtype_inside(factory) -> torch.dtype | None:
    with factory():
        return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


def test_no_and_bf16_are_honoured_as_asked():
    assert autocast_dtype_inside(autocast_factory(CPU, "no")) is None
    assert autocast_dtype_inside(autocast_factory(CPU, "bf16")) == torch.bfloat16


@pytest.mark.parametrize("fast", [True, False])
def test_auto_follows_the_hardware(monkeypatch, fast):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: fast)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert has_fast_bf16(CPU) is fast
    assert autocast_dtype_inside(autocast_factory(CPU, "auto")) == (torch.bfloat16 if fast else None)


def test_bf16_autocast_computes_in_bf16_and_keeps_fp32_master_weights():
    layer = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    with autocast_factory(CPU, "bf16")():
        out = layer(torch.randn(4, 8))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    optimizer.step()
    assert layer.weight.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32
    assert all(state.dtype == torch.float32 for s in optimizer.state.values() for state in s.values() if state.dim())
