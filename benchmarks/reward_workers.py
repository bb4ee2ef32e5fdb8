"""What task.reward_workers costs a step: 0 (in this process), 1 and 2 worker processes, side by side.

    python benchmarks/reward_workers.py                              # both parts, 3 rounds
    python benchmarks/reward_workers.py --rounds 5 --steps 6 --out reward_workers.json

Part 1, scoring alone, in this process: examples/medcalc_trl's task=medcalc_trl_shaped (seed 003's two
TRL-convention functions and the folder's tag_credit) on batches of 16 completions (train.rollout_batch_size's
default), and a CPU-bound per_sample function (`busy_reward`, a pure-Python loop of about 5 ms a row) on the same
batches. Each round scores `--batches` batches under each setting in turn (0, 1, 2, then again), so a machine
whose load drifts biases none. Reported per setting: the first batch (it starts the workers and loads the
functions: paid once per run) and the median of the other batches (what every step pays).

Part 2, training steps: `grpo-run --config-dir examples/medcalc_trl/conf task=medcalc_trl_shaped
model=tiny_random` for `--steps` steps with each setting, alternating, each a fresh process; the median over
steps 2.. of `time/step_s` and `time/scoring_s` from its metrics.jsonl (the workers start at the step-0
evaluation). The tiny model's steps are short, so the scoring's share is as large as it gets.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "medcalc_trl"
SETTINGS = (0, 1, 2)
COMPLETIONS = (
    "<think>BMI = 80 / 1.75^2 = 26.1</think> <answer>26.1</answer>",
    "<think>weight over height squared</think><answer>30</answer>",
    "The answer is 26.",
    "<think>MAP = (2 * 80 + 120) / 3</think>",
)


def busy_reward(response: str, row: dict) -> float:
    """A per_sample reward that keeps a core busy for about 5 ms (a stand-in for a parser or a checker)."""
    total = sum(i * i for i in range(40_000))
    return float(total % 7 == len(response) % 7)


def task_config(rewards: dict[str, str] | None, convention: str, workers: int):
    from omegaconf import OmegaConf

    from grpo_cli.tasks.custom import CustomTaskConfig, absolutize_paths

    merged = OmegaConf.structured(CustomTaskConfig(name="custom"))
    for name in ("medcalc_trl", "medcalc_trl_shaped"):
        yaml = OmegaConf.load(EXAMPLE / "conf" / "task" / f"{name}.yaml")
        yaml.pop("defaults")
        merged = OmegaConf.merge(merged, yaml)
    cfg = OmegaConf.to_object(merged)
    if rewards is not None:
        cfg.rewards, cfg.reward_weights, cfg.format_from, cfg.answer_from = rewards, {}, None, None
    cfg.reward_convention, cfg.reward_workers = convention, workers
    absolutize_paths(cfg, EXAMPLE)
    return cfg


def scoring(rounds: int, batches: int) -> dict:
    from grpo_cli.rollout.rewards import score_responses
    from grpo_cli.tasks import load_examples, make_reward_fn

    kinds = {
        "trl: medcalc_trl_shaped's 3 functions": (None, "trl"),
        "per_sample: busy_reward (~5 ms a row)": ({"busy": f"{Path(__file__).resolve()}:busy_reward"}, "per_sample"),
    }
    out = {}
    for kind, (rewards, convention) in kinds.items():
        truths = [e.ground_truth for e in load_examples(task_config(rewards, convention, 0), "train")]
        truths = [truths[i % len(truths)] for i in range(16)]
        responses = [COMPLETIONS[i % len(COMPLETIONS)] for i in range(16)]
        first = {w: [] for w in SETTINGS}
        rest = {w: [] for w in SETTINGS}
        values = {}
        for _ in range(rounds):
            for workers in SETTINGS:
                reward = make_reward_fn(task_config(rewards, convention, workers))
                try:
                    for batch in range(batches):
                        started = time.perf_counter()
                        scores = score_responses(reward, responses, truths)
                        (first if batch == 0 else rest)[workers].append(time.perf_counter() - started)
                        values.setdefault(workers, [r["reward"] for r in scores.rewards])
                finally:
                    reward.close()
        assert values[0] == values[1] == values[2], values  # the same rewards whichever way they ran
        out[kind] = {
            w: {"first_batch_s": statistics.median(first[w]), "batch_ms": 1000 * statistics.median(rest[w])}
            for w in SETTINGS
        }
    return out


def training(rounds: int, steps: int) -> dict:
    exe = Path(sys.executable).parent / "grpo-run"
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "grpo_cli.cli"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}
    rows = {w: [] for w in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(rounds):
            for workers in SETTINGS:
                run_dir = Path(tmp) / f"w{workers}_r{index}"
                args = [
                    "--config-dir",
                    "conf",
                    "task=medcalc_trl_shaped",
                    "model=tiny_random",
                    f"task.reward_workers={workers}",
                    f"train.steps={steps}",
                    "train.eval_every=0",
                    "task.n_eval=8",
                    "train.checkpoint_every=0",
                    "rollout.max_tokens=32",
                    f"output_dir={run_dir}",
                ]
                result = subprocess.run([*command, *args], cwd=EXAMPLE, env=env, capture_output=True, text=True)
                if result.returncode != 0:
                    raise SystemExit(f"grpo-run failed ({workers} workers): {result.stderr[-2000:]}")
                metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                rows[workers] += [m for m in metrics if "time/step_s" in m and m.get("step", 0) >= 2]
    out = {}
    for w in SETTINGS:
        step_s = [m["time/step_s"] for m in rows[w]]
        scoring_ms = [1000 * m["time/scoring_s"] for m in rows[w]]
        out[w] = {
            "step_s": statistics.median(step_s),
            "step_s_range": [min(step_s), max(step_s)],
            "scoring_ms": statistics.median(scoring_ms),
            "scoring_ms_range": [min(scoring_ms), max(scoring_ms)],
            "steps": len(rows[w]),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=6, help="batches per setting per round in part 1")
    parser.add_argument("--steps", type=int, default=6, help="steps per run in part 2")
    parser.add_argument("--parts", nargs="+", default=["scoring", "training"], choices=["scoring", "training"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "load_average_before": os.getloadavg(),
    }
    if "scoring" in args.parts:
        report["scoring"] = scoring(args.rounds, args.batches)
    if "training" in args.parts:
        report["training"] = training(args.rounds, args.steps)
    report["load_average_after"] = os.getloadavg()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
