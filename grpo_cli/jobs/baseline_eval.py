"""`job=baseline_eval`: the untrained policy on the held-out set (and task.eval_sets), loaded and sampled exactly as
training would (model.lora.*, model.quantization, rollout.*, eval.n_samples), with generations and rewards as
JSONL, its eval/* metrics as one metrics.jsonl line, and a summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from grpo_cli.models.runtime import timed
from grpo_cli.rollout.evaluation import prefixed, summarize_records, truncation_warning
from grpo_cli.rollout.worker import RolloutWorker
from grpo_cli.tasks import load_eval_sets, load_examples
from grpo_cli.tracking import write_jsonl
from grpo_cli.tracking.console import generation_progress, sample_metrics_line

if TYPE_CHECKING:
    from grpo_cli.config.schemas import GRPOConfig


def run(cfg: GRPOConfig, output_dir: Path, console: Console) -> dict[str, Any]:
    examples = load_examples(cfg.task, "eval")[: cfg.job.n_examples or None]
    # task.eval_sets: evaluated after the task's own set, their metrics under eval/<name>/...
    eval_sets = {name: rows[: cfg.job.n_examples or None] for name, rows in load_eval_sets(cfg.task).items()}
    worker = RolloutWorker(cfg)
    timings: dict[str, float] = {}
    set_results: dict[str, tuple[dict[str, float], list[dict[str, Any]]]] = {}
    total = len(examples) + sum(map(len, eval_sets.values()))
    try:
        with timed(timings, "time/eval_s"), generation_progress(console, total, "baseline eval") as advance:
            metrics, records, _version = worker.evaluate(examples, on_generated=advance)
            for name, set_examples in eval_sets.items():
                set_metrics, set_records, _version = worker.evaluate(set_examples, on_generated=advance)
                set_results[name] = (set_metrics, set_records)
                metrics.update(prefixed(set_metrics, name))
    finally:
        worker.close()
    metrics.update(timings)
    warning = truncation_warning(metrics, cfg.rollout.max_tokens, records, cfg.task)
    if warning is not None:
        console.print(f"warning: {warning}", highlight=False, markup=False)
    write_jsonl(output_dir / "baseline_eval.jsonl", records)
    for name, (_, set_records) in set_results.items():
        write_jsonl(output_dir / f"baseline_eval.{name}.jsonl", set_records)
    # One metrics.jsonl line at step 0, as a training run's first evaluation (job=report reads it).
    write_jsonl(output_dir / "metrics.jsonl", [{"step": 0, **metrics}])
    # n counts completions (n_prompts x n_samples); accuracy and the rates are means over them (= mean@n).
    summary = {
        **summarize_records(records),
        "n_prompts": len(examples),
        "n_samples": cfg.eval.n_samples,
        "metrics": metrics,
    }
    if set_results:
        summary["eval_sets"] = {name: summarize_records(rows) for name, (_, rows) in set_results.items()}
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    samples = f" x {cfg.eval.n_samples} samples" if cfg.eval.n_samples > 1 else ""
    console.print(
        f"baseline eval of {cfg.model.name} on {cfg.task.name}: {len(examples)} examples{samples} "
        f"in {metrics['time/eval_s']:.1f}s\n"
        f"  accuracy {summary['accuracy']:.3f}  format rate {summary['format_rate']:.3f}  "
        f"answer reward {summary['answer_reward']:.3f}  unparseable {summary['unparseable_rate']:.3f}\n"
        f"  format 1 & answer 1: {summary['counts']['format_1_answer_1']}   "
        f"format 1 & answer 0: {summary['counts']['format_1_answer_0']}   format 0: {summary['counts']['format_0']}",
        highlight=False,
    )
    if sampled := sample_metrics_line(metrics, "eval/"):
        console.print(f"  {sampled}", highlight=False)
    for name, (set_metrics, _) in set_results.items():
        console.print(
            f"  {name}: {len(set_results[name][1])} completions, reward {set_metrics['eval/reward']:.3f}  "
            + sample_metrics_line(set_metrics, "eval/"),
            highlight=False,
        )
    for name, rows in summary["examples"].items():
        for row in rows:
            console.print(
                f"  [{name}] {row['response'][:160]!r}  (truth: {row['ground_truth']})", highlight=False, markup=False
            )
    console.print(f"wrote {output_dir / 'baseline_eval.jsonl'} and {output_dir / 'summary.json'}", highlight=False)
    return summary
