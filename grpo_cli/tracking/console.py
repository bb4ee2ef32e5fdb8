"""Console output: the shape report before a run, a progress bar over steps, a compact line per step."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

STEP_LINE_KEYS = (
    ("train/reward", "reward", "{:.3f}"),
    ("train/loss", "loss", "{:+.4f}"),
    ("train/grad_norm", "gnorm", "{:.3f}"),
    ("train/entropy", "ent", "{:.2f}"),
    ("train/kl", "kl", "{:.4f}"),
    ("train/clip_fraction", "clip", "{:.3f}"),
    ("train/frac_zero_std_groups", "flat", "{:.2f}"),
    ("train/response_length_mean", "len", "{:.1f}"),
    ("time/step_s", "s", "{:.1f}"),
)


def shape_table(rows: list[tuple[str, Any]], title: str) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, str(value))
    return table


def format_step_line(step: int, metrics: dict[str, Any]) -> str:
    parts = [f"step {step:>4}"]
    for key, label, fmt in STEP_LINE_KEYS:
        if key in metrics:
            parts.append(f"{label} {fmt.format(metrics[key])}")
    return "  ".join(parts)


def format_eval_line(step: int, metrics: dict[str, Any]) -> str:
    return (
        f"eval @ step {step}: reward {metrics['eval/reward']:.3f}  format {metrics['eval/format_reward']:.3f}  "
        f"answer {metrics['eval/answer_reward']:.3f}  len {metrics['eval/response_length_mean']:.1f}"
    )


class StepProgress:
    """A progress bar over GRPO steps that prints one metrics line per step above itself."""

    def __init__(self, total_steps: int, console: Console, enabled: bool = True) -> None:
        self.console = console
        self.enabled = enabled
        self.progress = Progress(
            TextColumn("[bold]GRPO"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,
        )
        self.task_id = self.progress.add_task("steps", total=total_steps)

    def __enter__(self) -> StepProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    def print(self, line: str) -> None:
        if self.enabled:
            self.progress.console.print(line, highlight=False, markup=False)

    def advance(self) -> None:
        self.progress.advance(self.task_id)
