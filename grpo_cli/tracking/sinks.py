"""The metrics-sink interface the trainer logs through, and the fan-out that feeds every backend at once.

metrics.jsonl is always written (it is what `job=report` reads, offline); W&B is added with `logger=wandb`,
TensorBoard with `logger=tensorboard`.
The trainer sees one sink and never knows which backends sit behind it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rich.console import Console

from grpo_cli.tracking.jsonl import JsonlMetricsSink

if TYPE_CHECKING:
    from grpo_cli.config.schemas import GRPOConfig


class MetricsSink(Protocol):
    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Record one set of scalar metrics at a GRPO step (train and eval lines may share a step)."""
        ...

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        """Record sample completions (prompt, response, ground_truth, rewards, ...) produced at a step."""
        ...

    def log_episodes(self, rows: list[dict[str, Any]], step: int) -> None:
        """Record a training step's episode transcripts (multi-turn tasks; rollout.episode_rollout.transcript)."""
        ...

    def close(self) -> None:
        """Flush and release the backend; safe to call once at the end of a run, also after an error."""
        ...


class FanOutSink:
    """Forwards every call to each sink in order; close() closes them all even when one of them fails."""

    def __init__(self, sinks: Sequence[MetricsSink]) -> None:
        self.sinks = list(sinks)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        for sink in self.sinks:
            sink.log_samples(rows, step)

    def log_episodes(self, rows: list[dict[str, Any]], step: int) -> None:
        for sink in self.sinks:
            sink.log_episodes(rows, step)

    def close(self) -> None:
        _close_all(self.sinks)


def _close_all(sinks: list[MetricsSink]) -> None:
    # Recursion instead of a loop so that every close() runs inside the previous one's `finally`: a failing
    # JSONL close must not leave a W&B run open in a multirun process (docs/dependencies.md, "Known pitfalls").
    if not sinks:
        return
    try:
        sinks[0].close()
    finally:
        _close_all(sinks[1:])


def _backend_sink(cfg: GRPOConfig, output_dir: Path, console: Console) -> MetricsSink | None:
    """The sink of `logger.backend` beside metrics.jsonl (none: no other)."""
    # Imported here so that a run never pays for importing a backend it does not use (wandb, torch's TensorBoard).
    if cfg.logger.backend == "wandb":
        from grpo_cli.tracking.wandb_sink import WandbSink

        return WandbSink.start(cfg, output_dir, console)
    if cfg.logger.backend == "tensorboard":
        from grpo_cli.tracking.tensorboard_sink import TensorBoardSink

        return TensorBoardSink.start(cfg, output_dir, console)
    return None


def build_metrics_sink(cfg: GRPOConfig, output_dir: Path, console: Console) -> MetricsSink:
    """metrics.jsonl (+ eval/step_*.jsonl) in the run directory, plus W&B or TensorBoard per `logger.backend`."""
    sinks: list[MetricsSink] = [JsonlMetricsSink(output_dir / "metrics.jsonl")]
    try:
        backend = _backend_sink(cfg, output_dir, console)
    except BaseException:
        sinks[0].close()
        raise
    if backend is not None:
        sinks.append(backend)
    return FanOutSink(sinks)
