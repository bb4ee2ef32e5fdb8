"""Where one training step's time goes: its phases, and the top tensor operations inside each, by torch.profiler.

    python benchmarks/profile_step.py                          # the TRL setting (benchmarks/compare_trl.py), fp32
    python benchmarks/profile_step.py --precision bf16         # bf16 autocast (only where bf16 is fast)
    python benchmarks/profile_step.py --top 15 --warmup 2 model=tiny_random --out profile.json

Builds the trainer a run uses (`drivers.local.InProcessExecutor`, as `job=benchmark` does) at the setting of
`benchmarks/compare_trl.py` (SmolLM2-135M, keyword, 4 prompts x 4 completions, <= 48 new tokens, no KL) plus any
grpo-run overrides given, runs `--warmup` steps unprofiled (the first step pays one-off costs: the decode loop's
check, allocations), then one step under torch.profiler. It prints the step's own `time/*` metrics (what a run
logs, measured outside the profiler's overhead in the warm-up step before), then per phase (generation, scoring +
advantages, learn = old log-probs + forward/backward + optimizer, weight sync) its profiled seconds and its top
operations by self time, with each operation's share of the phase and of the step.

The profiler adds a few microseconds to every operation it records, so phases made of many small operations (the
eager decode loop: thousands per token) read slower under it than they run; compare shares within one profile, and
timings only from the unprofiled `time/*` figures or from A/B runs side by side.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # compare_trl; grpo_cli from this checkout
from compare_trl import TRL_SETTING  # noqa: E402 - the comparison's setting, declared once there

# What --precision means as model.mixed_precision.
PRECISIONS = {"fp32": "no", "bf16": "bf16"}
# The phases, in step order: the profiler range each is recorded under, and what it wraps.
PHASES = ("generation", "scoring", "learn", "weight sync")


def compose_config(overrides: list[str], output_dir: str) -> Any:
    """The GRPOConfig a `grpo-run` with these overrides would run, composed as the CLI composes it."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from grpo_cli.config import register_configs
    from grpo_cli.episodes import config as _episode_check  # noqa: F401 - registers the multi-turn check, as the cli

    register_configs()
    with initialize_config_module(config_module="grpo_cli.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*overrides, f"output_dir={output_dir}"])
    return OmegaConf.to_object(cfg)


def _ranged(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    import torch

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(f"phase:{name}"):
            return fn(*args, **kwargs)

    return wrapped


@contextmanager
def phase_ranges(executor: Any) -> Iterator[None]:
    """Each phase of the executor's step in a profiler range of its own: the method patched on the object's class
    (some are frozen dataclasses), put back after."""
    worker, learner = executor.worker, executor.learner
    targets = [
        (type(worker.engine), "generate", "generation"),
        (type(worker.run), "score", "scoring"),
        (type(learner), "learn", "learn"),
        (type(worker), "sync_weights", "weight sync"),
    ]
    saved = [(cls, attribute, cls.__dict__.get(attribute)) for cls, attribute, _ in targets]
    for cls, attribute, name in targets:
        setattr(cls, attribute, _ranged(name, getattr(cls, attribute)))
    try:
        yield
    finally:
        for cls, attribute, method in saved:
            if method is None:
                delattr(cls, attribute)  # inherited: the base class's again
            else:
                setattr(cls, attribute, method)


def phase_tables(events: Any, step_us: float, top: int) -> dict[str, dict[str, Any]]:
    """Per phase range: its microseconds (less those of any phase inside it) and its operations' self time summed
    by name (those of a phase inside it left to that phase)."""
    tables: dict[str, dict[str, Any]] = {}
    for event in events:
        if not event.name.startswith("phase:"):
            continue
        name = event.name.removeprefix("phase:")
        table = tables.setdefault(
            name, {"us": 0.0, "calls": 0, "ops": collections.Counter(), "counts": collections.Counter()}
        )
        table["us"] += event.cpu_time_total
        table["calls"] += 1
        stack = list(event.cpu_children)
        while stack:
            child = stack.pop()
            if child.name.startswith("phase:"):  # a phase inside this one: its time and operations are its own
                table["us"] -= child.cpu_time_total
                continue
            stack.extend(child.cpu_children)
            table["ops"][child.name] += child.self_cpu_time_total
            table["counts"][child.name] += 1
    for table in tables.values():
        # Time inside the phase that no operation accounts for: Python, module calls, the profiler's own overhead.
        table["ops_s"] = sum(table["ops"].values()) / 1e6
        table["top"] = [
            {
                "op": op,
                "self_s": us / 1e6,
                "calls": table["counts"][op],
                "of_phase": us / max(table["us"], 1e-9),
                "of_step": us / max(step_us, 1e-9),
            }
            for op, us in table["ops"].most_common(top)
        ]
        del table["ops"], table["counts"]
    return tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32")
    parser.add_argument("--warmup", type=int, default=1, help="unprofiled steps first (default 1)")
    parser.add_argument("--top", type=int, default=12, help="operations listed per phase (default 12)")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads (default: torch's); 1 on a shared machine, where a second thread"
        " waits for the other processes at every parallel operation and inflates exactly the parallel ones",
    )
    parser.add_argument("--out", type=Path, help="also write the figures as JSON here")
    parser.add_argument("overrides", nargs="*", help="grpo-run overrides on top of the TRL setting")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from grpo_cli.drivers.local import InProcessExecutor
    from grpo_cli.drivers.prompts import PromptSampler
    from grpo_cli.tasks import load_examples

    steps = args.warmup + 1
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [
            *TRL_SETTING,
            f"model.mixed_precision={PRECISIONS[args.precision]}",
            f"train.steps={steps}",
            "train.eval_every=0",
            "logger.backend=none",
            *args.overrides,
        ]
        cfg = compose_config(overrides, run_dir)
        examples = load_examples(cfg.task, "train")
        executor = InProcessExecutor(cfg, Path(run_dir), PromptSampler(examples, seed=cfg.seed))
        try:
            warm: list[dict[str, float]] = []
            for step in range(1, args.warmup + 1):
                metrics, _ = executor.step(step)
                warm.append(metrics)
                shown = ", ".join(
                    f"{k[5:]} {v:.2f}" for k, v in metrics.items() if k.startswith("time/") and v >= 0.005
                )
                print(f"warm-up step {step}: {shown}", flush=True)
            with phase_ranges(executor), torch.profiler.profile(activities=_activities(torch)) as profile:
                started = time.perf_counter()
                metrics, _ = executor.step(steps)
                profiled_s = time.perf_counter() - started
        finally:
            executor.close()
    report = {
        "precision": args.precision,
        "overrides": overrides,
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg()[0],
        "warmup_time": {k: v for k, v in (warm[-1] if warm else {}).items() if k.startswith("time/")},
        "profiled_step_s": profiled_s,
        "profiled_time": {k: v for k, v in metrics.items() if k.startswith("time/")},
        "flat_groups": metrics.get("train/frac_zero_std_groups"),
        "phases": phase_tables(profile.events(), profiled_s * 1e6, args.top),
    }
    _print(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


def _activities(torch: Any) -> list[Any]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def _print(report: dict[str, Any]) -> None:
    print(
        f"\nprecision {report['precision']}, {report['threads']} torch threads,"
        f" load average {report['load_average']:.2f}, flat groups {report['flat_groups']}"
    )
    for label, times in (
        ("warm-up step (unprofiled)", report["warmup_time"]),
        ("profiled step", report["profiled_time"]),
    ):
        shown = ", ".join(f"{k.removeprefix('time/')} {v:.2f}" for k, v in times.items() if v >= 0.005)
        print(f"{label}: {shown}")
    step_s = report["profiled_step_s"]
    for name in PHASES:
        table = report["phases"].get(name)
        if table is None:
            continue
        seconds = table["us"] / 1e6
        print(
            f"\n{name}: {seconds:.2f} s profiled ({seconds / step_s:.0%} of the step), {table['calls']} call(s);"
            f" its operations' self time {table['ops_s']:.2f} s, the rest (Python, module calls, profiler) "
            f"{seconds - table['ops_s']:.2f} s"
        )
        print(f"  {'self s':>7} {'phase':>6} {'step':>6} {'calls':>7}  operation")
        for row in table["top"]:
            print(f"  {row['self_s']:7.3f} {row['of_phase']:6.1%} {row['of_step']:6.1%} {row['calls']:7d}  {row['op']}")


if __name__ == "__main__":
    main()
