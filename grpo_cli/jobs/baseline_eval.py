"""`job=baseline_eval`: the untrained policy on the held-out set, loaded and sampled exactly as training would
(model.lora.*, model.quantization, rollout.*), with generations and rewards as JSONL and a summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console

from grpo_cli.rollout.evaluation import summarize_records
from grpo_cli.rollout.worker import RolloutWorker
from grpo_cli.runtime import timed
from grpo_cli.tasks import load_examples
from grpo_cli.tracking import write_jsonl
from grpo_cli.tracking.console import generation_progress


def run(cfg: Any, output_dir: Path, console: Console) -> dict[str, Any]:
    examples = load_examples(cfg.task, "eval")[: cfg.job.n_examples or None]
    worker = RolloutWorker(cfg)
    timings: dict[str, float] = {}
    try:
        with timed(timings, "time/eval_s"), generation_progress(console, len(examples), "baseline eval") as advance:
            metrics, records, _version = worker.evaluate(examples, on_generated=advance)
    finally:
        worker.close()
    metrics.update(timings)
    write_jsonl(output_dir / "baseline_eval.jsonl", records)
    summary = {**summarize_records(records), "metrics": metrics}
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(
        f"baseline eval of {cfg.model.name} on {cfg.task.name}: {summary['n']} examples "
        f"in {metrics['time/eval_s']:.1f}s\n"
        f"  accuracy {summary['accuracy']:.3f}  format rate {summary['format_rate']:.3f}  "
        f"answer reward {summary['answer_reward']:.3f}  unparseable {summary['unparseable_rate']:.3f}\n"
        f"  format 1 & answer 1: {summary['counts']['format_1_answer_1']}   "
        f"format 1 & answer 0: {summary['counts']['format_1_answer_0']}   format 0: {summary['counts']['format_0']}",
        highlight=False,
    )
    for name, rows in summary["examples"].items():
        for row in rows:
            console.print(
                f"  [{name}] {row['response'][:160]!r}  (truth: {row['ground_truth']})", highlight=False, markup=False
            )
    console.print(f"wrote {output_dir / 'baseline_eval.jsonl'} and {output_dir / 'summary.json'}", highlight=False)
    return summary
