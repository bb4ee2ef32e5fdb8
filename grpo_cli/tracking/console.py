"""Console output: the shape report before a run, progress bars over steps and over generation, a compact
line per step. Bars are drawn only on a terminal; piped output keeps just the lines."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
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


def shape_table(rows: list[tuple[str, object]], title: str) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, str(value))
    return table


# The end-of-run table of mean time per step: (metric, label, format).
STEP_TIME_ROWS = (
    ("time/generation_s", "generation (s)", "{:.2f}"),
    ("time/scoring_s", "scoring (s)", "{:.2f}"),
    ("time/old_log_probs_s", "old log-probs (s)", "{:.2f}"),
    ("time/ref_log_probs_s", "reference log-probs (s)", "{:.2f}"),
    ("time/training_s", "training (s)", "{:.2f}"),
    ("time/sync_s", "weight sync (s)", "{:.2f}"),
    ("time/waiting_s", "learner waiting for rollouts (s)", "{:.2f}"),
    ("time/step_s", "step, wall time (s)", "{:.2f}"),
    ("time/overlap_frac", "generation hidden behind training", "{:.0%}"),
    ("sync/lag", "policy lag (versions)", "{:.2f}"),
)


# Phases a run skips when its loss and KL settings do not need them: left out of the table when ~0.
OPTIONAL_PHASES = ("time/old_log_probs_s", "time/ref_log_probs_s")


def step_time_table(rows: list[dict[str, Any]], title: str) -> Table:
    """Mean of each time-breakdown metric over the given train lines of metrics.jsonl."""
    from grpo_cli.tracking.report import mean_step_breakdown

    means = mean_step_breakdown(rows)
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("phase")
    table.add_column("mean", justify="right")
    for key, label, fmt in STEP_TIME_ROWS:
        if key in means and not (key in OPTIONAL_PHASES and means[key] < 0.005):
            table.add_row(label, fmt.format(means[key]))
    return table


def format_step_line(step: int, metrics: dict[str, Any]) -> str:
    parts = [f"step {step:>4}"]
    for key, label, fmt in STEP_LINE_KEYS:
        if key in metrics:
            parts.append(f"{label} {fmt.format(metrics[key])}")
    return "  ".join(parts)


def sample_metrics_line(metrics: dict[str, Any], prefix: str) -> str:
    """ "mean@4 0.500  pass@1 0.500  pass@4 0.750  maj@4 0.500" of one eval set (eval.n_samples > 1), else ""."""
    names = [key[len(prefix) :] for key in metrics if re.fullmatch(re.escape(prefix) + r"(mean|pass|maj)@\d+", key)]
    return "  ".join(f"{name} {metrics[prefix + name]:.3f}" for name in names)


def format_eval_line(step: int, metrics: dict[str, Any]) -> str:
    """The main eval set's rewards (and its mean@n / pass@k / maj@n), then each task.eval_sets set's."""
    line = (
        f"eval @ step {step}: reward {metrics['eval/reward']:.3f}  format {metrics['eval/format_reward']:.3f}  "
        f"answer {metrics['eval/answer_reward']:.3f}  len {metrics['eval/response_length_mean']:.1f}"
    )
    if sampled := sample_metrics_line(metrics, "eval/"):
        line += f"  {sampled}"
    # Each extra set logs eval/<name>/truncated_frac (a reward component's eval/reward/<name> does not).
    for key in metrics:
        if found := re.fullmatch(r"eval/([A-Za-z0-9_-]+)/truncated_frac", key):
            name = found.group(1)
            line += f"  | {name}: reward {metrics[f'eval/{name}/reward']:.3f}"
            if sampled := sample_metrics_line(metrics, f"eval/{name}/"):
                line += f"  {sampled}"
    return line


class StepProgress:
    """A progress bar over GRPO steps that prints one metrics line per step above itself."""

    def __init__(self, total_steps: int, console: Console, enabled: bool = True) -> None:
        self.console = console
        self.enabled = enabled
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,
        )
        self.task_id = self.progress.add_task("GRPO", total=total_steps)

    def __enter__(self) -> StepProgress:
        self.progress.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.progress.__exit__(exc_type, exc, traceback)

    def print(self, line: str) -> None:
        if self.enabled:
            self.progress.console.print(line, highlight=False, markup=False)

    def advance(self, steps: int = 1) -> None:
        self.progress.advance(self.task_id, steps)


@contextmanager
def generation_progress(
    console: Console, total: int, description: str = "eval", within: StepProgress | None = None
) -> Iterator[Callable[[int], None]]:
    """A transient bar over generated completions; yields advance(n).

    Inside a running StepProgress the bar is a second row of that display, because rich shows one live
    display at a time.
    """
    if within is not None:
        task_id = within.progress.add_task(description, total=total)
        try:
            yield lambda n: within.progress.advance(task_id, n)
        finally:
            within.progress.remove_task(task_id)
        return
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
    with progress:
        task_id = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task_id, n)
