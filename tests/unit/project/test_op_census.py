"""benchmarks/op_census.py: the census sees what a computation dispatches, down to strides and dtypes."""

from __future__ import annotations

import importlib.util

import torch

from tests.conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "op_census.py"


def _module():
    spec = importlib.util.spec_from_file_location("op_census", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_census_tells_a_transposed_or_recast_matmul_from_the_same_one():
    census = _module().census
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    plain = census(lambda: a @ b)
    assert plain == census(lambda: a @ b)  # the same computation: the same census
    transposed = census(lambda: a @ b.t().contiguous().t())  # same shapes, other strides
    assert transposed != plain
    with torch.autocast("cpu", dtype=torch.bfloat16):
        recast = census(lambda: a @ b)  # the same call under bf16 autocast: casts and a bf16 matmul
    assert any("bfloat16" in key and "aten.mm" in key for key in recast)
    assert not any("bfloat16" in key for key in plain)


def test_the_difference_lists_changed_counts_largest_first():
    difference = _module().census_difference
    assert difference({"a": 1, "b": 2}, {"a": 1, "b": 2}) == []
    assert difference({"a": 1, "b": 2}, {"a": 4, "c": 1}) == [("a", 1, 4), ("b", 2, 0), ("c", 0, 1)]
