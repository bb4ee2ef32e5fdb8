"""The part of a transformers causal LM that core scores through, as a type.

A policy is a transformers PreTrainedModel (or a peft wrapper around one), but core takes any `nn.Module` and
imports no transformers; nn.Module's own typing knows none of these methods (its `__getattr__` says
`Tensor | Module`), so the functions that call them view the module through this protocol.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

from torch import nn


class CausalLM(Protocol):
    # A transformers PretrainedConfig; Any because its fields differ by architecture (read with getattr).
    config: Any

    def get_output_embeddings(self) -> nn.Module: ...

    def get_decoder(self) -> nn.Module: ...


def as_causal_lm(model: nn.Module) -> CausalLM:
    """`model` seen as the causal LM it is (no check, no copy: the same object)."""
    return cast(CausalLM, model)
