"""Wall time to a held-out reward: grpo-run arms started together, one core each, each stopped once its
evaluation at a given step is written; prints the held-out reward at step 0 and at that step, when each was
written, and the arm's training-step seconds, flat-group share and skipped-row share
(docs/results/2026-12-07-compare-trl.md: the default run with and without skipping zero-weight rows).

    python benchmarks/time_to_reward.py --arm on= --arm off=train.skip_zero_weight_rows=false [--until-step 10]

Each arm is a plain `grpo-run` (the defaults plus its overrides and those given after the options) with one torch
thread pinned to its own core (taskset), so two arms on a two-core machine neither share a core nor wait for each
other; more arms than cores share them round-robin.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    """The complete lines of a run's metrics.jsonl so far (the last may be half written)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def eval_row(rows: list[dict], step: int) -> dict | None:
    return next((r for r in rows if r.get("step") == step and "eval/reward" in r), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", action="append", required=True, help="NAME=OVERRIDE,...: one grpo-run per arm")
    parser.add_argument("--until-step", type=int, default=10, help="stop each arm once this step's eval is written")
    parser.add_argument("--out", default="time_to_reward.json")
    parser.add_argument("overrides", nargs="*", help="grpo-run overrides for every arm")
    args = parser.parse_args()
    arms = {}
    for text in args.arm:
        name, sep, overrides = text.partition("=")
        if not sep or not name:
            raise SystemExit(
                f"--arm {text!r}: write NAME=OVERRIDE,OVERRIDE... (e.g. off=train.skip_zero_weight_rows=false)"
            )
        arms[name] = [o for o in overrides.split(",") if o]
    exe = shutil.which("grpo-run")
    command = [exe] if exe else [sys.executable, "-m", "grpo_cli.cli"]
    cores = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

    with tempfile.TemporaryDirectory(prefix="grpo-cli-time-to-reward-") as tmp:
        runs = {}
        started = time.monotonic()
        for index, (name, overrides) in enumerate(arms.items()):
            run_dir = Path(tmp) / name
            argv = ["taskset", "-c", str(cores[index % len(cores)]), *command, *args.overrides, *overrides]
            log = open(Path(tmp) / f"{name}.log", "w")  # noqa: SIM115 - closed with the run below
            process = subprocess.Popen(
                [*argv, f"hydra.run.dir={run_dir}"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            runs[name] = {"process": process, "log": log, "metrics": run_dir / "metrics.jsonl", "seen": {}}
        while any("done" not in run for run in runs.values()):
            time.sleep(1)
            for run in runs.values():
                if "done" in run:
                    continue
                rows = read_metrics(run["metrics"])
                for step in (0, args.until_step):
                    if step not in run["seen"] and eval_row(rows, step):
                        run["seen"][step] = time.monotonic() - started
                if args.until_step in run["seen"] or run["process"].poll() is not None:
                    os.killpg(run["process"].pid, signal.SIGTERM)
                    run["process"].wait()
                    run["log"].close()
                    run["done"] = rows
        result = {}
        for name, run in runs.items():
            rows = run["done"]
            if args.until_step not in run["seen"]:
                tail = (Path(tmp) / f"{name}.log").read_text()[-2000:]
                raise SystemExit(f"arm {name} ended before its evaluation at step {args.until_step}:\n{tail}")
            train = [r for r in rows if "time/step_s" in r and 0 < r["step"] <= args.until_step]
            result[name] = {
                "overrides": arms[name],
                "eval_reward_step0": eval_row(rows, 0)["eval/reward"],
                "eval_at_s_step0": run["seen"][0],
                "eval_reward": eval_row(rows, args.until_step)["eval/reward"],
                "eval_at_s": run["seen"][args.until_step],
                "train_steps_s": sum(r["time/step_s"] for r in train),
                "step_s": [round(r["time/step_s"], 2) for r in train],
                "flat_groups": [r.get("train/frac_zero_std_groups") for r in train],
                "rows_skipped": [r.get("perf/zero_weight_skipped_frac") for r in train],
            }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    n = args.until_step
    print(
        f"{'arm':<10}{'reward@0':>10}{'at s':>7}{f'reward@{n}':>11}{'at s':>7}{'train s':>9}{'flat':>7}{'skipped':>9}"
    )
    for name, arm in result.items():
        flat = [f for f in arm["flat_groups"] if f is not None]
        skipped = [s for s in arm["rows_skipped"] if s is not None]
        print(
            f"{name:<10}{arm['eval_reward_step0']:>10.3f}{arm['eval_at_s_step0']:>7.0f}{arm['eval_reward']:>11.3f}"
            f"{arm['eval_at_s']:>7.0f}{arm['train_steps_s']:>9.1f}"
            f"{sum(flat) / max(len(flat), 1):>7.3f}{sum(skipped) / max(len(skipped), 1):>9.3f}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
