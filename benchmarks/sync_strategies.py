"""The sync strategies side by side, one arm after another with the same seed, steps and global batch
(docs/results/2026-12-06-async.md, docs/sync.md): on_policy, one_behind, async at k=1, async at k=2 with partial
rollouts (kv recompute, keep), and the same on_policy / async arms with a learner that only sleeps for the
measured training time (sync.simulated_update_s), which isolates what the generator gains by not waiting where two
shared cores add no compute. Then job=report over them all (its plots: reward per step and per second).

    python benchmarks/sync_strategies.py --out outputs/sync_bench [--steps 8] [--sleep 6.0]

Every arm is a plain `grpo-run` (Ray for all but on_policy); the table printed at the end reads their
metrics.jsonl: mean step time, learner waiting, generator idle / paced, wasted decode row-steps, staleness, the
share of samples of several versions, sampler KL, the last held-out reward and the wall time of the run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# The task and sizes every arm shares: SmolLM2-135M on lipogram, whose completions range from a few words to the
# token limit (heavy-tailed lengths, measured in the results), 4 prompts x 4 completions per step; the reward is the
# share of words without an e (the answer component alone), which a 135M model moves in a few steps.
COMMON = [
    "task=lipogram",
    "task.reward_weights.correctness=0",
    "task.reward_weights.answer=1",
    "train.rollout_batch_size=16",
    "train.train_batch_size=16",
    "train.group_size=4",
    "train.gradient_accumulation_steps=4",
    "rollout.max_tokens=96",
    "loss=grpo_clip",
    "model.mixed_precision=no",
    "task.n_eval=16",
    "seed=0",
    "logger=none",
]

ARMS = {
    "on_policy": ["sync=on_policy"],
    "one_behind": ["sync=one_behind"],
    "async_k1": ["sync=async", "sync.max_staleness=1"],
    "async_k2_recompute": ["sync=async", "sync.max_staleness=2", "sync.partial_rollouts=true"],
    "async_k2_keep": [
        "sync=async",
        "sync.max_staleness=2",
        "sync.partial_rollouts=true",
        "sync.kv_after_update=keep",
    ],
}
SLEEP_ARMS = ("on_policy", "async_k2_recompute")


def grpo_run(args: list[str], cwd: Path) -> float:
    exe = str(Path(sys.executable).parent / "grpo-run")
    started = time.perf_counter()
    result = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"grpo-run {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return time.perf_counter() - started


def rows_of(run_dir: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "time/step_s" in r], [r for r in rows if "eval/reward" in r]


def mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else float("nan")


def summary(name: str, run_dir: Path, wall_s: float) -> dict[str, float | str]:
    train, evals = rows_of(run_dir)
    return {
        "arm": name,
        "step_s": mean(train, "time/step_s"),
        "learner_wait_s": mean(train, "time/waiting_s"),
        "gen_idle_s": mean(train, "time/generator_idle_s"),
        "gen_paced_s": mean(train, "time/generator_paced_s"),
        "wasted_rows": mean(train, "sync/wasted_row_frac"),
        "lag": mean(train, "sync/lag"),
        "token_lag": mean(train, "sync/staleness_token_mean"),
        "partial": mean(train, "sync/partial_frac"),
        "sampler_kl": mean(train, "train/sampler_kl"),
        "len_mean": mean(train, "train/response_length_mean"),
        "len_max": max((r["train/response_length_max"] for r in train), default=float("nan")),
        "truncated": mean(train, "train/truncated_frac"),
        "eval_reward_last": evals[-1]["eval/reward"] if evals else float("nan"),
        "run_s": wall_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--sleep",
        type=float,
        default=None,
        help="seconds the sleeping learner sleeps per step (default: on_policy's measured mean time/training_s)",
    )
    parser.add_argument("--arms", nargs="*", default=[*ARMS, *(f"{a}_sleep" for a in SLEEP_ARMS)])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shared = [*COMMON, f"train.steps={args.steps}", f"train.eval_every={args.steps // 2}"]
    results = []
    for arm in args.arms:
        base = arm.removesuffix("_sleep")
        overrides = [*shared, *ARMS[base]]
        if arm.endswith("_sleep"):
            sleep = args.sleep
            if sleep is None:  # the real learner's own training time, from the on_policy arm of this session
                sleep = mean(rows_of(args.out / "on_policy")[0], "time/training_s")
            overrides.append(f"sync.simulated_update_s={sleep:.2f}")
        run_dir = args.out / arm
        wall = grpo_run([*overrides, f"hydra.run.dir={run_dir}"], cwd=args.out)
        results.append(summary(arm, run_dir, wall))
        print(json.dumps(results[-1]), flush=True)
    (args.out / "summary.json").write_text(json.dumps(results, indent=1))
    grpo_run(["job=report", f"report.runs={args.out}", f"report.out={args.out / 'report'}"], cwd=args.out)
    keys = list(results[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in results:
        print("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()) + " |")


if __name__ == "__main__":
    main()
