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
    ("time/generator_idle_s", "generator idle (s)", "{:.2f}"),
    ("time/generator_paced_s", "generator paced by the bound (s)", "{:.2f}"),
    ("time/update_pause_s", "generator applying updates (s)", "{:.2f}"),
    ("time/recompute_s", "generator recomputing after updates (s)", "{:.2f}"),
    ("time/overlap_frac", "generation hidden behind training", "{:.0%}"),
    ("sync/lag", "policy lag (versions)", "{:.2f}"),
    ("sync/staleness_token_mean", "token lag (versions)", "{:.2f}"),
    ("sync/partial_frac", "samples of several versions", "{:.0%}"),
    ("sync/wasted_row_frac", "decode row-steps on ended rows", "{:.0%}"),
    ("train/behaviour_capped_frac", "tokens over sync.behaviour_weight_cap", "{:.2%}"),
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


# --- what a run costs: its size before it starts, the time left after its first step -----------------------------

# A run whose time left exceeds this on the machine it runs on gets one line naming smaller and GPU-sized settings.
LONG_RUN_S = 30 * 60
# The held-out set the long-run hint suggests on a CPU (task.n_eval), where evaluations dominate.
EVAL_ROWS_ON_CPU = 32


def format_duration(seconds: float) -> str:
    """A duration as a progress bar shows one: '45s', '12m05s', '3h10m'."""
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def counted(n: int, word: str) -> str:
    """'1 step', '2 steps', '0 steps': a count and its noun, singular for one."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def evaluation_steps(steps: int, eval_every: int, start_step: int = 0) -> list[int]:
    """The steps after which a run evaluates (as TrainingLoop.run schedules them): step 0 when the run is new, every
    eval_every-th step, and the last step."""
    due = {step for step in range(start_step + 1, steps + 1) if eval_every and step % eval_every == 0}
    due.add(steps)
    if start_step == 0:
        due.add(0)
    return sorted(due)


def run_size_line(
    *,
    steps: int,
    prompts_per_step: int,
    completions_per_step: int,
    max_new_tokens: int,
    eval_rows: int,
    samples_per_eval_row: int,
    eval_at: list[int],
) -> str:
    """What a run will generate, said before it starts: its steps, prompts, completions and new tokens at most, and
    its evaluations' rows."""
    completions = steps * completions_per_step
    eval_completions = len(eval_at) * eval_rows * samples_per_eval_row
    shown = ", ".join(map(str, eval_at)) if len(eval_at) <= 6 else f"{eval_at[0]}, {eval_at[1]}, ..., {eval_at[-1]}"
    at = f" (at {'step' if len(eval_at) == 1 else 'steps'} {shown})" if eval_at else ""
    per_row = f" x {samples_per_eval_row} samples" if samples_per_eval_row > 1 else ""
    per_step = completions_per_step // prompts_per_step
    return (
        f"size: {counted(steps, 'step')} x {counted(prompts_per_step, 'prompt')} x {counted(per_step, 'completion')} "
        f"= {completions:,} completion{'' if completions == 1 else 's'} "
        f"(at most {completions * max_new_tokens:,} new tokens); "
        f"{counted(len(eval_at), 'evaluation')}{at} x {counted(eval_rows, 'row')}{per_row} = {eval_completions:,} "
        f"completion{'' if eval_completions == 1 else 's'} (at most {eval_completions * max_new_tokens:,} new tokens)"
    )


class RunClock:
    """The time a run has left: the mean measured seconds of a step and of an evaluation, times how many of each
    are still to come. Evaluations count: on a CPU one over a large held-out set can outlast every step."""

    def __init__(self, steps: int, eval_at: list[int]) -> None:
        self.steps = steps
        self.eval_at = eval_at
        self.step_seconds: list[float] = []
        self.eval_seconds: list[float] = []

    def step_done(self, seconds: float) -> None:
        self.step_seconds.append(seconds)

    def eval_done(self, seconds: float) -> None:
        self.eval_seconds.append(seconds)

    @property
    def step_s(self) -> float | None:
        return sum(self.step_seconds) / len(self.step_seconds) if self.step_seconds else None

    @property
    def eval_s(self) -> float | None:
        return sum(self.eval_seconds) / len(self.eval_seconds) if self.eval_seconds else None

    def evaluations_left(self, step: int) -> int:
        """Evaluations still to run once step `step` is done, its own evaluation (if due) included."""
        return sum(1 for due in self.eval_at if due >= step and due > 0)

    def remaining_s(self, step: int) -> float | None:
        """Seconds left after step `step` (None before a step is measured, or while evaluations are to come and
        none was measured)."""
        if self.step_s is None:
            return None
        evaluations = self.evaluations_left(step)
        if evaluations and self.eval_s is None:
            return None
        return (self.steps - step) * self.step_s + evaluations * (self.eval_s or 0.0)

    def eta_text(self, step: int) -> str:
        """'eta 12m05s' for the step line; 'eta 12m05s + evaluations' while no evaluation has been timed."""
        left = self.remaining_s(step)
        if left is not None:
            return f"eta {format_duration(left)}"
        if self.step_s is None:
            return ""
        return f"eta {format_duration((self.steps - step) * self.step_s)} + evaluations"


def long_run_hint(
    clock: RunClock,
    step: int,
    *,
    eval_rows: int,
    max_new_tokens: int,
    on_cpu: bool,
    gpu_experiment: str | None,
    task: str,
) -> str | None:
    """One line when the time left is long for this machine (over LONG_RUN_S): where it goes, and the settings of a
    run sized for a CPU and of one sized for a GPU. None when the run is short or not yet measured."""
    left = clock.remaining_s(step)
    if left is None or left <= LONG_RUN_S or clock.step_s is None:
        return None
    evaluations = clock.evaluations_left(step)
    parts = [f"{counted(clock.steps - step, 'step')} at ~{format_duration(clock.step_s)} each"]
    if evaluations and clock.eval_s is not None:
        each = format_duration(clock.eval_s)
        parts.append(f"{counted(evaluations, 'evaluation')} of {counted(eval_rows, 'row')} at ~{each} each")
    # Only settings that change something: a held-out set already of 32 rows or fewer, or evaluations already at
    # the start and the end only, are not suggested again.
    fewer_evals = [f"task.n_eval={EVAL_ROWS_ON_CPU}"] if eval_rows > EVAL_ROWS_ON_CPU else []
    if any(0 < due < clock.steps for due in clock.eval_at):
        fewer_evals.append("train.eval_every=0 (evaluate at the start and the end only)")
    evals_dominate = evaluations and clock.eval_s is not None
    if evals_dominate and evaluations * (clock.eval_s or 0.0) >= (clock.steps - step) * clock.step_s and fewer_evals:
        smaller = " ".join(fewer_evals)
    else:  # the steps dominate: as many as fit in about LONG_RUN_S at the measured pace
        smaller = f"train.steps={max(1, int(LONG_RUN_S * 0.8 / clock.step_s))}"
        smaller += " rollout.max_tokens=256" if max_new_tokens > 256 else ""
    where = (
        f"CPU-sized: {smaller}, or debug=smoke to check the pipeline in seconds; GPU-sized: "
        + (
            f"experiment={gpu_experiment} on a GPU (docs/experiments.md)"
            if gpu_experiment
            else f"task={task} as it is, on a GPU (model.device=auto picks CUDA)"
        )
        if on_cpu
        else f"smaller: {smaller}"
    )
    return f"this run needs about {format_duration(left)} more here ({' and '.join(parts)}); {where}"
