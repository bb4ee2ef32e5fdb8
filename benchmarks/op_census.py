"""Which tensor operations one training step dispatches, compared between two commits: a check of whether a change
altered the step's computation, that no machine's speed or load can blur.

    python benchmarks/op_census.py BEFORE AFTER [grpo-run overrides ...]
    python benchmarks/op_census.py cc5e353 204b523 model.mixed_precision=bf16      # issue #52's bisect question

Each commit is checked out in a temporary worktree and runs `grpo-run` (the default keyword run on the embedded
SmolLM2 unless overridden, 2 steps, the KL penalty off) in a process of its own; its second step runs under a
TorchDispatchMode that counts every aten call by (operator, shapes, strides, dtypes). Wall-clock comparisons of
two commits need a quiet machine and alternation (their noise is ±30% here); this census needs neither: equal
censuses mean the two steps ran the same kernels on the same tensors, so a timing gap between them is not in the
computation (look at the process instead: threads, memory, other processes). Prints the census sizes and every
key whose count differs, largest difference first. Compute-heavy keys (matmuls, attention) are marked.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# Operators whose cost dominates a step: a difference in one of these is a difference in the step's time.
HEAVY = ("mm", "bmm", "addmm", "linear", "attention", "softmax", "embedding", "convolution")
DEFAULT_OVERRIDES = ("kl.beta=0", "optim.lr=1e-5", "train.eval_every=0", "train.eval_examples=2", "seed=0")


def census(run: Callable[[], Any]) -> collections.Counter[str]:
    """Every aten call `run()` dispatches, counted by operator and its tensor arguments' shapes, strides, dtypes."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    counts: collections.Counter[str] = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            flat, _ = tree_flatten((args, kwargs or {}))
            tensors = tuple(
                (tuple(t.shape), t.stride(), str(t.dtype).removeprefix("torch."))
                for t in flat
                if isinstance(t, torch.Tensor)
            )
            counts[f"{func} {tensors}"] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        run()
    return counts


def census_difference(before: Mapping[str, int], after: Mapping[str, int]) -> list[tuple[str, int, int]]:
    """(key, count before, count after) of every key whose counts differ, the largest difference first."""
    keys = set(before) | set(after)
    rows = [(key, before.get(key, 0), after.get(key, 0)) for key in keys if before.get(key, 0) != after.get(key, 0)]
    return sorted(rows, key=lambda row: (-abs(row[2] - row[1]), row[0]))


def _inner(out: str, overrides: list[str]) -> None:
    """In the commit's own worktree (PYTHONPATH): the run, with its second step counted into `out`."""
    import grpo_cli.drivers.local as local

    step = local.InProcessExecutor.step

    def counted_step(self, number):  # type: ignore[no-untyped-def]
        if number != 2:
            return step(self, number)
        result: list[Any] = []
        counts = census(lambda: result.append(step(self, number)))
        Path(out).write_text(json.dumps(counts))
        return result[0]

    local.InProcessExecutor.step = counted_step  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as run_dir:
        sys.argv = ["grpo-run", "train.steps=2", *DEFAULT_OVERRIDES, *overrides, f"hydra.run.dir={run_dir}"]
        from grpo_cli.cli import main

        main()


def _count_at(revision: str, overrides: list[str], scratch: Path) -> dict[str, int]:
    worktree, out = scratch / f"tree-{revision}", scratch / f"census-{revision}.json"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(worktree), revision], check=True)
    try:
        env = {**os.environ, "PYTHONPATH": str(worktree), "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
        command = [sys.executable, str(Path(__file__).resolve()), "--inner", str(out), *overrides]
        done = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            raise SystemExit(f"op_census: the run at {revision} failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)], check=False)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--inner":
        _inner(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("overrides", nargs="*", help="grpo-run overrides for both runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        before = _count_at(args.before, args.overrides, Path(scratch))
        after = _count_at(args.after, args.overrides, Path(scratch))
    rows = census_difference(before, after)
    heavy = [row for row in rows if any(f"aten.{name}" in row[0] for name in HEAVY)]
    print(f"step 2 at {args.before}: {sum(before.values())} aten calls, {len(before)} distinct")
    print(f"step 2 at {args.after}: {sum(after.values())} aten calls, {len(after)} distinct")
    print(f"{len(rows)} keys differ, {len(heavy)} of them compute-heavy ({', '.join(HEAVY)})")
    for key, count_before, count_after in rows[:60]:
        mark = "*" if (key, count_before, count_after) in heavy else " "
        print(f"{mark} {count_before:>6} -> {count_after:<6} {key[:200]}")


if __name__ == "__main__":
    main()
