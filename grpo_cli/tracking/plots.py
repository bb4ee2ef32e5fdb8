"""job=report's plots: a metric per step for every run (seeds of one setting as their mean and min-max band), and
against each run's training time (what a sync strategy buys is reward per second, not per step)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar


class RunData(Protocol):
    """What a plot reads of a run (tracking.report.RunData has it)."""

    def series(self, key: str) -> tuple[list[int], list[float]]: ...

    def timed_series(self, key: str) -> tuple[list[float], list[float]]: ...


Run = TypeVar("Run", bound=RunData)

PLOTS = (
    ("eval/reward", "eval_reward.png", "eval reward (held-out)"),
    ("train/reward", "train_reward.png", "train reward (rollouts)"),
    ("train/kl", "train_kl.png", "KL to the initial policy"),
    ("train/grad_norm", "train_grad_norm.png", "grad norm (before clipping)"),
    ("train/entropy", "train_entropy.png", "entropy (response tokens)"),
    ("train/clip_fraction", "train_clip_fraction.png", "clip fraction"),
)
# Plotted against the training time (the sum of the steps' time/step_s) too: what a sync strategy buys is reward per
# second, not per step.
TIMED_PLOTS = (("eval/reward", "eval_reward_by_time.png", "eval reward (held-out), by training time"),)


def plot_file_name(key: str) -> str:
    """eval/math500/pass@4 -> eval_math500_pass_at_4.png"""
    return key.replace("@", "_at_").replace("/", "_") + ".png"


def plot_metric(
    groups: list[tuple[str, list[Run]]],
    label_of: Callable[[Run], str],
    key: str,
    ylabel: str,
    path: Path,
    by_time: bool = False,
) -> bool:
    """One line per run; a group of seeds gets its mean as a thick line and its min-max as a band (`by_time`: the
    metric against each run's training time, one line per run, no band: the runs' clocks differ). A run's line is
    labelled `label_of(run)` (its differing hyperparameters). Returns False (and writes nothing) when no run has the
    metric."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    if not any(run.series(key)[0] for _, runs in groups for run in runs):
        return False
    fig = Figure(figsize=(7.5, 4.2), dpi=110)
    ax = fig.add_subplot()
    n_labels = 0
    for index, (label, runs) in enumerate(groups):
        color = f"C{index % 10}"
        if by_time:
            for run in runs:
                seconds, values = run.timed_series(key)
                ax.plot(seconds, values, color=color, marker="o", markersize=3, linewidth=1.2)
            ax.lines[-1].set_label(label if len(runs) > 1 else label_of(runs[0]))
            n_labels += 1
            continue
        if len(runs) == 1:
            steps, values = runs[0].series(key)
            label = label_of(runs[0])
            ax.plot(steps, values, color=color, marker="o", markersize=3, linewidth=1.5, label=label)
            n_labels += 1
            continue
        for run in runs:
            steps, values = run.series(key)
            ax.plot(steps, values, color=color, linewidth=0.8, alpha=0.35)
        common_steps, means, lows, highs = seed_band([run.series(key) for run in runs])
        if common_steps:
            ax.plot(
                common_steps, means, color=color, linewidth=2.2, label=f"{label} (mean, min-max of {len(runs)} seeds)"
            )
            ax.fill_between(common_steps, lows, highs, color=color, alpha=0.18, linewidth=0)
            n_labels += 1
    if by_time:
        ax.set_xlabel("training time (s, evaluations excluded)")
    else:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.set_title(key)
    ax.grid(alpha=0.3)
    labels = [str(line.get_label()) for line in ax.lines]
    longest = max((len(label) for label in labels if not label.startswith("_")), default=0)
    if n_labels > 8 or longest > 60:  # many runs or long labels: beside the axes instead of over the curves
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    elif n_labels:
        ax.legend(fontsize=8)
    fig.savefig(path, bbox_inches="tight")
    return True


def seed_band(
    series: list[tuple[list[int], list[float]]],
) -> tuple[list[int], list[float], list[float], list[float]]:
    """(steps every run has, mean, min, max) across runs at those steps."""
    by_run = [dict(zip(steps, values, strict=True)) for steps, values in series]
    common = sorted(set.intersection(*(set(d) for d in by_run))) if by_run else []
    means = [statistics.mean(d[s] for d in by_run) for s in common]
    lows = [min(d[s] for d in by_run) for s in common]
    highs = [max(d[s] for d in by_run) for s in common]
    return common, means, lows, highs
