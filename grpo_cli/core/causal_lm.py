"""The part of a transformers causal LM that core scores through, as a type.

A policy is a transformers PreTrainedModel (or a peft wrapper around one), but core takes any `nn.Module` and
imports no transformers; nn.Module's own typing knows none of these methods (its `__getattr__` says
`Tensor | Module`), so the functions that call them view the module through this protocol.
"""

from __future__ import annotations

import inspect
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


def cache_keyword(module: nn.Module) -> str:
    """The keyword `module`'s forward (a transformers model, or the decoder inside one) takes the KV cache by:
    `cache` where the forward declares it (transformers 5.24 renamed `past_key_values`, which it accepts with a
    FutureWarning until 5.40; the forward takes **kwargs, so the old name may then be dropped without a word and
    the cache never reach the attention), else `past_key_values` (every earlier release, down to the 4.57.1 floor).
    The one choice of the shared-prompt forward (core/prompt_sharing.py) and the decode loop
    (engines/hf_internals.py)."""
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"
