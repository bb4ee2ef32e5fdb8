"""grpo-cli against TRL's GRPOTrainer, back to back in one command, at the TRL setting; prints the ratio.

    pip install -r benchmarks/requirements.txt        # TRL 1.16 (a benchmark dependency, not a package one)
    python benchmarks/compare_trl.py                   # 6 steps each, one round
    python benchmarks/compare_trl.py --steps 6 --rounds 2 --out compare.json
    python benchmarks/compare_trl.py --precision bf16            # both sides under bf16 autocast
    python benchmarks/compare_trl.py --arm after= --arm before=train.skip_zero_weight_rows=false   # two grpo-cli arms

Each side runs in a fresh process, so its figure includes its own start-up costs inside the steps (warm-up,
compilation, caches): grpo-cli as `grpo-run job=benchmark job.engines=[hf] job.warmup_steps=0` at the setting
below, TRL as benchmarks/trl_keyword_baseline.py with --warmup 0 (same model, prompts, reward, batch, length,
learning rate, no KL; TRL's other defaults). The figure of each is the median seconds per step over all its steps;
the ratio is grpo-cli's over TRL's. With --rounds > 1 the two alternate (grpo-cli, TRL, grpo-cli, TRL, ...) so
that a machine whose speed drifts biases neither, and the ratio is that of the medians over all rounds' steps.
With --arm NAME=OVERRIDE,OVERRIDE... (repeated) grpo-cli runs once per arm in every round (a change before and after,
side by side in one run: arms, then TRL, alternating), each arm with its own ratio. Each arm's share of flat groups
over its measured steps (train/frac_zero_std_groups: groups whose completions all got one reward) is printed with it.
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


def run_grpo_cli(
    steps: int, workdir: Path, extra: list[str], env: dict[str, str] | None = None
) -> list[dict[str, float]]:
    """The metrics of every step of one fresh `grpo-run job=benchmark` process (rollout=hf), in the environment
    `env` (None: this one), whose PATH picks the `grpo-run` (another install's)."""
    run_dir = workdir / "grpo-cli"
    exe = shutil.which("grpo-run", path=(env or os.environ).get("PATH"))
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
    subprocess.run(command, check=True, env=env)
    report = json.loads((run_dir / "benchmark.json").read_text())
    return list(report["engines"]["hf"]["steps"])


def run_trl(steps: int, workdir: Path, bf16: bool) -> list[float]:
    """Seconds of every step of one fresh TRL GRPOTrainer process."""
    out = workdir / "trl.json"
    script = HERE / "trl_keyword_baseline.py"
    command = [sys.executable, str(script), "--steps", str(steps), "--warmup", "0", "--out", str(out)]
    subprocess.run(command + (["--bf16"] if bf16 else []), check=True)
    return json.loads(out.read_text())["steps"]


# The precision of both sides: grpo-run's overrides (job=benchmark measures job.precisions), and TRL's bf16 flag.
PRECISIONS = {
    "fp32": (["model.mixed_precision=no", "job.precisions=[no]"], False),
    "bf16": (["model.mixed_precision=bf16", "job.precisions=[bf16]"], True),
}


def parse_arm(text: str) -> tuple[str, list[str]]:
    """`NAME=OVERRIDE,OVERRIDE...` (the overrides may be empty: `after=`) -> (name, overrides)."""
    name, sep, overrides = text.partition("=")
    if not sep or not name:
        raise SystemExit(
            f"--arm {text!r}: write NAME=OVERRIDE,OVERRIDE... (e.g. before=train.skip_zero_weight_rows=false)"
        )
    return name, [o for o in overrides.split(",") if o]


def parse_arm_env(texts: list[str], arms: dict[str, list[str]]) -> dict[str, dict[str, str]]:
    """`NAME=VAR=VALUE` each -> {arm: this environment with VAR set}; `$VAR` in VALUE expands from this one
    (PATH=/venv/bin:$PATH runs another install's grpo-run; PYTHONPATH=/checkout another commit's code)."""
    envs: dict[str, dict[str, str]] = {}
    for text in texts:
        name, _, assignment = text.partition("=")
        variable, sep, value = assignment.partition("=")
        if name not in arms or not sep or not variable:
            raise SystemExit(f"--arm-env {text!r}: write NAME=VAR=VALUE for an arm given by --arm (NAME=...)")
        envs.setdefault(name, dict(os.environ))[variable] = os.path.expandvars(value)
    return envs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per run (each side, each round)")
    parser.add_argument("--rounds", type=int, default=1, help="grpo-cli/TRL pairs, alternating")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32", help="both sides' precision")
    parser.add_argument(
        "--arm", action="append", default=[], help="NAME=OVERRIDE,...: one grpo-cli run per arm and round"
    )
    parser.add_argument(
        "--arm-env",
        action="append",
        default=[],
        help="NAME=VAR=VALUE: that arm's runs with VAR set (PATH=/venv/bin:$PATH: another install's grpo-run)",
    )
    parser.add_argument("--out", default="compare_trl.json")
    parser.add_argument("overrides", nargs="*", help="extra grpo-run overrides for every grpo-cli arm")
    args = parser.parse_args()
    precision_override, trl_bf16 = PRECISIONS[args.precision]
    arms = dict(parse_arm(a) for a in args.arm) or {"grpo-cli": []}
    envs = parse_arm_env(args.arm_env, arms)

    started = datetime.datetime.now().astimezone()
    rows: list[dict] = []
    seconds: dict[str, list[float]] = {name: [] for name in [*arms, "TRL"]}
    flat: dict[str, list[float]] = {name: [] for name in arms}
    padding: dict[str, list[float]] = {name: [] for name in arms}
    with tempfile.TemporaryDirectory(prefix="grpo-cli-vs-trl-") as tmp:
        for round_index in range(args.rounds):
            for side in [*arms, "TRL"]:
                workdir = Path(tmp) / f"round{round_index}-{side}"
                workdir.mkdir(exist_ok=True)
                load_before = load_average()
                if side == "TRL":
                    steps = run_trl(args.steps, workdir, trl_bf16)
                else:
                    overrides = [*precision_override, *args.overrides, *arms[side]]
                    metrics = run_grpo_cli(args.steps, workdir, overrides, envs.get(side))
                    steps = [m["time/step_s"] for m in metrics]
                    flat[side] += [m.get("train/frac_zero_std_groups", float("nan")) for m in metrics]
                    padding[side] += [m.get("perf/padding_frac", float("nan")) for m in metrics]
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
                seconds[side].extend(steps)
                print(f"{side} round {round_index + 1}: median {rows[-1]['median_s']:.2f}s per step", flush=True)

    trl_median = statistics.median(seconds["TRL"])
    result = {
        "date": started.isoformat(timespec="seconds"),
        "machine": f"{cpu_name()}, {os.cpu_count()} logical CPUs, {platform.platform()}",
        "precision": args.precision,
        "setting": TRL_SETTING + [*precision_override, *args.overrides],
        "arms": {
            name: {
                "overrides": overrides,
                "median_s": statistics.median(seconds[name]),
                "ratio": statistics.median(seconds[name]) / trl_median,
                "flat_group_share": statistics.fmean(flat[name]) if flat[name] else None,
                "padding_frac": statistics.fmean(padding[name]) if padding[name] else None,
                "env": {k: v for k, v in envs.get(name, {}).items() if os.environ.get(k) != v},
            }
            for name, overrides in arms.items()
        },
        "runs": rows,
        "trl_median_s": trl_median,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{result['date']} on {result['machine']}, {args.precision}")
    print(f"{'run':<20}{'median s/step':>14}{'min':>8}{'max':>8}{'load before/after':>20}")
    for row in rows:
        name = f"{row['side']} #{row['round']}"
        load = f"{row['load_before']:.1f} / {row['load_after']:.1f}"
        print(f"{name:<20}{row['median_s']:>14.2f}{min(row['steps']):>8.2f}{max(row['steps']):>8.2f}{load:>20}")
    for name, arm in result["arms"].items():
        print(
            f"{name}: {arm['median_s']:.2f}s vs TRL {trl_median:.2f}s per step (medians): ratio {arm['ratio']:.2f} "
            f"({1 / arm['ratio']:.1f}x faster); flat groups {arm['flat_group_share']:.2f} of its steps' groups, "
            f"padding {arm['padding_frac']:.2f} of the positions its forwards computed"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
