"""Where metrics go: metrics.jsonl in the run directory (always) and the console."""

from grpo_cli.tracking.jsonl import JsonlMetricsSink, read_metrics, write_jsonl

__all__ = ["JsonlMetricsSink", "read_metrics", "write_jsonl"]
