"""Where metrics go: metrics.jsonl in the run directory (always), W&B (logger=wandb) and the console; plus
run_info.json and the offline report (job=report). Only this package imports wandb, and only on demand."""

from grpo_cli.tracking.jsonl import (
    JsonlMetricsSink,
    baseline_eval_reward,
    read_metrics,
    truncate_metrics,
    write_jsonl,
)
from grpo_cli.tracking.sinks import FanOutSink, MetricsSink, build_metrics_sink

__all__ = [
    "FanOutSink",
    "JsonlMetricsSink",
    "MetricsSink",
    "baseline_eval_reward",
    "build_metrics_sink",
    "read_metrics",
    "truncate_metrics",
    "write_jsonl",
]
