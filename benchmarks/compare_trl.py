"""grpo-cli against TRL's GRPOTrainer, back to back in one command, at the TRL setting; prints the ratio.

    pip install -r benchmarks/requirements.txt        # TRL 1.16 (a benchmark dependency, not a package one)
    python benchmarks/compare_trl.py                   # 6 steps each, one round
    python benchmarks/compare_trl.py --steps 6 --rounds 2 --out compare.json

Each side runs in a fresh process, so its figure includes its own start-up costs inside the steps (warm-up,
compilation, caches): grpo-cli as `grpo-run job=benchmark job.engines=[hf] job.warmup_steps=0` at the setting
below, TRL as benchmarks/trl_keyword_baseline.py with --warmup 0 (same model, prompts, reward, batch, length,
learning rate, no KL; TRL's other defaults). The figure of each is the median seconds per step over all its steps;
the ratio is grpo-cli's over TRL's. With --rounds > 1 the two alternate (grpo-cli, TRL, grpo-cli, TRL, ...) so
that a machine whose speed drifts biases neither, and the ratio is that of the medians over all rounds' steps.
The load average before and after each run is printed beside it: compare only runs taken on a quiet machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The setting of the comparison (issue #17): what TRL's script runs, said as grpo-run overrides.
TRL_SETTING = [
    "model=smollm2_135m",
    "task=keyword",
    "train.rollout_batch_size=16",
    "train.group_size=4",
    "train.train_batch_size=16",
    "train.gradient_accumulation_steps=1",
    "rollout.max_tokens=48",
    "optim.lr=1e-5",
    "kl.beta=0",
]


def cpu_name() -> str:
    """The CPU model as lscpu names it (platform.processor() is empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def run_grpo_cli(steps: int, workdir: Path, extra: list[str]) -> list[float]:
    """Seconds of every step of one fresh `grpo-run job=benchmark` process (rollout=hf)."""
    run_dir = workdir / "grpo-cli"
    exe = shutil.which("grpo-run")
    command = [exe] if exe else [sys.executable, "-m", "grpo_cli.cli"]
    command += [
        "job=benchmark",
        "job.engines=[hf]",
        "job.warmup_steps=0",
        f"job.steps={steps}",
        *TRL_SETTING,
        *extra,
        f"hydra.run.dir={run_dir}",
    ]
    subprocess.run(command, check=True)
    report = json.loads((run_dir / "benchmark.json").read_text())
    return [row["time/step_s"] for row in report["engines"]["hf"]["steps"]]


def run_trl(steps: int, workdir: Path) -> list[float]:
    """Seconds of every step of one fresh TRL GRPOTrainer process."""
    out = workdir / "trl.json"
    script = HERE / "trl_keyword_baseline.py"
    subprocess.run([sys.executable, str(script), "--steps", str(steps), "--warmup", "0", "--out", str(out)], check=True)
    return json.loads(out.read_text())["steps"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per run (each side, each round)")
    parser.add_argument("--rounds", type=int, default=1, help="grpo-cli/TRL pairs, alternating")
    parser.add_argument("--out", default="compare_trl.json")
    parser.add_argument("overrides", nargs="*", help="extra grpo-run overrides for the grpo-cli side")
    args = parser.parse_args()

    started = datetime.datetime.now().astimezone()
    rows, ours, theirs = [], [], []
    with tempfile.TemporaryDirectory(prefix="grpo-cli-vs-trl-") as tmp:
        for round_index in range(args.rounds):
            for side in ("grpo-cli", "TRL"):
                workdir = Path(tmp) / f"round{round_index}"
                workdir.mkdir(exist_ok=True)
                load_before = load_average()
                steps = (
                    run_grpo_cli(args.steps, workdir, args.overrides)
                    if side == "grpo-cli"
                    else run_trl(args.steps, workdir)
                )
                rows.append(
                    {
                        "round": round_index + 1,
                        "side": side,
                        "steps": steps,
                        "median_s": statistics.median(steps),
                        "load_before": load_before,
                        "load_after": load_average(),
                    }
                )
                (ours if side == "grpo-cli" else theirs).extend(steps)
                print(f"{side} round {round_index + 1}: median {rows[-1]['median_s']:.2f}s per step", flush=True)

    ratio = statistics.median(ours) / statistics.median(theirs)
    result = {
        "date": started.isoformat(timespec="seconds"),
        "machine": f"{cpu_name()}, {os.cpu_count()} logical CPUs, {platform.platform()}",
        "setting": TRL_SETTING + args.overrides,
        "runs": rows,
        "grpo_cli_median_s": statistics.median(ours),
        "trl_median_s": statistics.median(theirs),
        "ratio": ratio,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{result['date']} on {result['machine']}")
    print(f"{'run':<16}{'median s/step':>14}{'min':>8}{'max':>8}{'load before/after':>20}")
    for row in rows:
        name = f"{row['side']} #{row['round']}"
        load = f"{row['load_before']:.1f} / {row['load_after']:.1f}"
        print(f"{name:<16}{row['median_s']:>14.2f}{min(row['steps']):>8.2f}{max(row['steps']):>8.2f}{load:>20}")
    print(
        f"grpo-cli {result['grpo_cli_median_s']:.2f}s vs TRL {result['trl_median_s']:.2f}s per step (medians): "
        f"ratio {ratio:.2f} ({1 / ratio:.1f}x faster); wrote {args.out}"
    )


if __name__ == "__main__":
    main()
