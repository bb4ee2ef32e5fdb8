"""`job=report`: compare runs offline, from nothing but their run directories (config.yaml + metrics.jsonl).

Writes report.md (results, an across-seeds summary, the time breakdown, and only the hyperparameters that
differ between runs), report.json (the same numbers, unrounded) and one PNG per metric that some run logged.
Runs whose configs differ only by `seed` form a group, drawn as a mean line with a min-max band.

Plots use matplotlib's object API (Figure + its Agg canvas), never pyplot: no display backend is needed and
no global figure state survives from one job of a multirun to the next.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypedDict, TypeGuard

import yaml
from rich.console import Console

from grpo_cli.errors import UserFacingError
from grpo_cli.tracking.plots import PLOTS, TIMED_PLOTS, plot_file_name, plot_metric

# (metric, file name, axis label); a plot is skipped when no run logged its metric.
# Eval metrics beyond eval/reward that get a results column (their last value) and a plot when some run logs
# them: mean@n, pass@k and maj@n (eval.n_samples > 1), and each task.eval_sets set's reward and the same three.
EXTRA_EVAL_METRIC = re.compile(r"eval/(?:([A-Za-z0-9_-]+)/)?(reward|mean@\d+|pass@\d+|maj@\d+)")


def extra_eval_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The EXTRA_EVAL_METRIC keys in these metric lines: the main set first, then each set in order of first
    appearance; within a set reward, mean@n, pass@k by k, maj@n."""
    sets: dict[str, list[tuple[int, int, str]]] = {}
    order = {"reward": 0, "mean": 1, "pass": 2, "maj": 3}
    for row in rows:
        for key in row:
            match = EXTRA_EVAL_METRIC.fullmatch(key)
            if match is None or key == "eval/reward":
                continue
            name, _, k = match.group(2).partition("@")
            sets.setdefault(match.group(1) or "", []).append((order[name], int(k or 0), key))
    main = sets.pop("", [])
    return [key for group in (main, *sets.values()) for *_, key in sorted(set(group))]


# Mean seconds per training step; eval time is per evaluation. With one_behind and replay_buffer the
# generator's phases (generation, scoring, old log-probs) run while the learner trains, so the phases add up
# to more than the step; `waiting` is the learner idle, waiting for a rollout batch.
STEP_TIME_KEYS = (
    "time/step_s",
    "time/generation_s",
    "time/scoring_s",
    "time/old_log_probs_s",
    "time/ref_log_probs_s",
    "time/training_s",
    "time/sync_s",
    "time/waiting_s",
    # sync=async's generators: idle (nothing handed out), paced by the staleness bound, applying updates, and
    # prefilling running rows again after one.
    "time/generator_idle_s",
    "time/generator_paced_s",
    "time/update_pause_s",
    "time/recompute_s",
)
# Per-step means that are not seconds: the share of generator time hidden behind training, the policy lag, and
# sync=async's token staleness, share of samples of several versions, decode row-steps spent on ended rows and
# tokens whose off-policy weight sync.behaviour_weight_cap zeroed.
STEP_RATIO_KEYS = (
    ("time/overlap_frac", "overlap"),
    ("sync/lag", "lag"),
    ("sync/staleness_token_mean", "token lag"),
    ("sync/partial_frac", "partial"),
    ("sync/wasted_row_frac", "wasted rows"),
    ("train/behaviour_capped_frac", "capped"),
)


def mean_step_breakdown(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean over the given metrics.jsonl train lines of each STEP_TIME_KEYS / STEP_RATIO_KEYS metric they log."""
    means = {}
    for key in (*STEP_TIME_KEYS, *(k for k, _ in STEP_RATIO_KEYS)):
        values = [float(row[key]) for row in rows if _is_number(row.get(key))]
        if values:
            means[key] = sum(values) / len(values)
    return means


# Config keys that never make two runs different experiments (paths, logging, the report itself).
IGNORED_KEY_PREFIXES = ("output_dir", "logger.", "report.", "verbose", "job.")
SEED_KEYS = ("seed",)
# Shown once above the results table when every run shares them.
HEADLINE_KEYS = (
    "model.name",
    "task.name",
    "loss.type",
    "normalization.advantage",
    "normalization.length",
    "sync.strategy",
    "train.steps",
    "train.rollout_batch_size",
    "train.group_size",
    "optim.lr",
    "seed",
)


@dataclass
class RunData:
    """One run directory as read from disk: its flattened config and its train and eval metric lines."""

    path: Path
    name: str
    config: dict[str, Any]
    rows: list[dict[str, Any]]  # every metrics.jsonl line, train and eval
    train: list[dict[str, Any]]
    evals: list[dict[str, Any]]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric, skipping lines without it and non-finite values."""
        # Train and eval lines never share a key, so one pass over all lines finds either kind.
        points = [(row["step"], row[key]) for row in self.rows if _is_number(row.get(key))]
        return [s for s, _ in points], [float(v) for _, v in points]

    def timed_series(self, key: str) -> tuple[list[float], list[float]]:
        """(training seconds, values) of one metric: each line's x is the sum of time/step_s up to its step
        (evaluations left out: strategies evaluate differently, and an evaluation trains nothing)."""
        clock, points = 0.0, []
        for row in self.rows:
            if _is_number(row.get("time/step_s")):
                clock += float(row["time/step_s"])
            if _is_number(row.get(key)):
                points.append((clock, float(row[key])))
        return [t for t, _ in points], [v for _, v in points]


@dataclass
class RunSummary:
    name: str
    path: str
    hyperparameters: dict[str, Any]
    steps: int
    # The eval reward of the untrained policy (the evaluation at step 0; None if the run did not log one).
    initial_eval_reward: float | None
    final_eval_reward: float | None
    best_eval_reward: float | None
    best_eval_step: int | None
    wall_time_s: float
    time_means_s: dict[str, float] = field(default_factory=dict)
    # The last value of each extra_eval_keys metric the run logged (pass@k, maj@n, eval sets).
    final_eval: dict[str, float] = field(default_factory=dict)


def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _natural_key(path: Path) -> list[int | str]:
    # Multirun job directories start with the job number: 2_... sorts before 10_...
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


# report.runs: one directory, or a list of them (a YAML list of strings).
RunPaths = str | Path | Iterable[str | Path] | None


def resolve_run_dirs(runs: RunPaths) -> list[Path]:
    """Run directories from report.runs: each entry is a run directory or a directory holding runs below it
    (a multirun directory). Raises UserFacingError naming the first path that is missing or holds no run."""
    entries = [runs] if isinstance(runs, str | Path) else list(runs or [])
    if not entries:
        raise UserFacingError(
            "report.runs is empty: give a multirun directory (report.runs=outputs/multirun/<time>) "
            "or run directories (report.runs=[outputs/train/<time>,outputs/train/<time>])"
        )
    found: list[Path] = []
    for entry in entries:
        path = Path(str(entry)).expanduser()
        if not path.is_dir():
            raise UserFacingError(f"report.runs: {path} does not exist or is not a directory")
        if (path / "metrics.jsonl").exists():
            found.append(path)
            continue
        below = sorted((p.parent for p in path.rglob("metrics.jsonl")), key=_natural_key)
        if not below:
            raise UserFacingError(
                f"report.runs: {path} holds no metrics.jsonl: give training run directories or a multirun directory"
            )
        found.extend(below)
    return list(dict.fromkeys(p.resolve() for p in found))


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1e-5}} -> {"optim.lr": 1e-5}; lists stay values."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def read_metric_lines(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl lines; a torn last line (a run killed mid-write) is dropped, any other bad line is an error."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines, start=1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise UserFacingError(f"{path}:{number}: not valid JSON: the metrics file is damaged") from None
    return rows


OBJECTIVES = ("final_eval_reward", "best_eval_reward")


def eval_rewards(rows: list[dict[str, Any]]) -> list[float]:
    return [float(row["eval/reward"]) for row in rows if _is_number(row.get("eval/reward"))]


def objective_of(which: str, rewards: list[float]) -> float | None:
    if not rewards:
        return None
    return max(rewards) if which == "best_eval_reward" else rewards[-1]


def run_objective(which: str, run_dir: Path, summary: dict[str, Any] | None = None) -> float | None:
    """What a run returns to a Hydra sweeper (`job.objective`): the eval reward of its last evaluation, or the
    highest, from metrics.jsonl (job=train); else the summary's eval reward (job=baseline_eval); None for a job
    that evaluates nothing."""
    if which not in OBJECTIVES:
        raise UserFacingError(f"job.objective={which}: use one of {', '.join(OBJECTIVES)}")
    path = Path(run_dir) / "metrics.jsonl"
    rewards = eval_rewards(read_metric_lines(path)) if path.exists() else []
    if not rewards:
        value = ((summary or {}).get("metrics") or {}).get("eval/reward")
        return float(value) if _is_number(value) else None
    return objective_of(which, rewards)


def load_run(path: Path, name: str) -> RunData:
    config_path = path / "config.yaml"
    config = flatten(yaml.safe_load(config_path.read_text()) or {}) if config_path.exists() else {}
    rows = read_metric_lines(path / "metrics.jsonl")
    # Train and eval lines share step numbers (an eval follows the step it measures): tell them apart by keys.
    evals = [row for row in rows if "eval/reward" in row]
    train = [row for row in rows if "eval/reward" not in row and any(k.startswith("train/") for k in row)]
    return RunData(path, name, config, rows, train, evals)


def common_root(paths: list[Path]) -> Path:
    """The deepest directory holding every run (a single run's parent)."""
    parts = [p.parts for p in paths]
    depth = 0
    while all(len(p) > depth + 1 and p[depth] == parts[0][depth] for p in parts):
        depth += 1
    return Path(*parts[0][:depth])


def run_names(paths: list[Path]) -> list[str]:
    """Short unique names: each path relative to common_root(), with a multirun job directory
    (`3_optim.lr@1e-05+seed@1`) cut to its job number, since its overrides are the table's columns."""
    root = common_root(paths)
    relative = [p.relative_to(root).parts for p in paths]
    names = ["/".join([*rel[:-1], re.sub(r"^(\d+)_.*", r"\1", rel[-1])]) for rel in relative]
    return names if len(set(names)) == len(names) else ["/".join(rel) for rel in relative]


def differing_keys(configs: list[dict[str, Any]]) -> list[str]:
    """Config keys whose values are not the same in every run (bookkeeping keys excluded); seed last."""
    keys = sorted({k for c in configs for k in c if not k.startswith(IGNORED_KEY_PREFIXES)})
    differing = [k for k in keys if len({json.dumps(c.get(k), sort_keys=True, default=str) for c in configs}) > 1]
    return sorted(differing, key=lambda k: (k in SEED_KEYS, k))


def summarize(run: RunData, keys: list[str]) -> RunSummary:
    steps, rewards = run.series("eval/reward")
    best = max(range(len(rewards)), key=lambda i: rewards[i]) if rewards else None  # first best on ties
    times = mean_step_breakdown(run.train)
    eval_times = run.series("time/eval_s")[1]
    if eval_times:
        times["time/eval_s"] = sum(eval_times) / len(eval_times)
    return RunSummary(
        name=run.name,
        path=str(run.path),
        hyperparameters={k: run.config.get(k) for k in keys},
        steps=max((row["step"] for row in run.train), default=0),
        initial_eval_reward=rewards[0] if steps and steps[0] == 0 else None,
        final_eval_reward=rewards[-1] if rewards else None,
        best_eval_reward=rewards[best] if best is not None else None,
        best_eval_step=steps[best] if best is not None else None,
        wall_time_s=sum(run.series("time/step_s")[1]) + sum(eval_times),
        time_means_s=times,
        final_eval={key: run.series(key)[1][-1] for key in extra_eval_keys(run.evals) if run.series(key)[1]},
    )


def seed_groups(runs: list[RunData], keys: list[str]) -> list[tuple[str, list[RunData]]]:
    """Runs grouped by every differing key except the seeds, in order of first appearance, with a label."""
    group_keys = [k for k in keys if k not in SEED_KEYS]
    groups: dict[str, list[RunData]] = {}
    for run in runs:
        groups.setdefault(hparams_label(run, group_keys, "all runs"), []).append(run)
    return list(groups.items())


def hparams_label(run: RunData, keys: list[str], fallback: str) -> str:
    """`optim.lr=1e-05, seed=1`: the run's values of the given keys."""
    return ", ".join(f"{k}={format_value(run.config.get(k))}" for k in keys) or fallback


def format_value(value: object) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if value is None:
        return "null"
    return str(value)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def results_table(summaries: list[RunSummary], keys: list[str]) -> str:
    # Final pass@k / maj@n / eval-set columns, when some run logged them (eval/math500/pass@4 -> math500 pass@4).
    extra = list(dict.fromkeys(key for s in summaries for key in s.final_eval))
    extra_header = [f"final {key.removeprefix('eval/').replace('/', ' ')}" for key in extra]
    header = ["run", *keys, "steps", "final eval reward", "best eval reward (step)", *extra_header, "wall time (s)"]
    rows = [
        [
            s.name,
            *(format_value(s.hyperparameters[k]) for k in keys),
            str(s.steps),
            _fmt(s.final_eval_reward, ".3f"),
            f"{_fmt(s.best_eval_reward, '.3f')} ({_fmt(s.best_eval_step, 'd')})",
            *(_fmt(s.final_eval.get(key), ".3f") for key in extra),
            f"{s.wall_time_s:.1f}",
        ]
        for s in summaries
    ]
    return markdown_table(header, rows)


def seeds_table(groups: list[tuple[str, list[RunData]]], summaries: dict[str, RunSummary]) -> str:
    """Per group of two runs or more: mean ± sample std over seeds of the final eval reward, the mean best, and
    whether the group learned: its mean final reward above its mean step-0 reward by more than the seeds' std of
    the final reward (a gain within the seed spread is not evidence of learning)."""
    rows = []
    for label, runs in groups:
        finals = [v for r in runs if (v := summaries[r.name].final_eval_reward) is not None]
        bests = [v for r in runs if (v := summaries[r.name].best_eval_reward) is not None]
        initials = [v for r in runs if (v := summaries[r.name].initial_eval_reward) is not None]
        if len(runs) < 2 or not finals:
            continue
        spread = statistics.stdev(finals) if len(finals) > 1 else 0.0
        gain, learned = "-", "-"
        if len(initials) == len(runs):  # every run has its step-0 evaluation
            difference = statistics.mean(finals) - statistics.mean(initials)
            gain, learned = f"{difference:+.3f}", "yes" if difference > spread else "no"
        rows.append(
            [
                label,
                str(len(runs)),
                f"{statistics.mean(finals):.3f} ± {spread:.3f}",
                f"{statistics.mean(bests):.3f}",
                gain,
                learned,
            ]
        )
    if not rows:
        return ""
    header = [
        "runs that differ only by seed",
        "seeds",
        "final eval reward (mean ± std)",
        "best eval reward (mean)",
        "final - step 0 (mean)",
        "learned (gain > std)",
    ]
    return markdown_table(header, rows)


def time_table(summaries: list[RunSummary]) -> str:
    """Mean seconds per step of each phase, and per evaluation; phases under 5 ms in every run are left out
    (old/reference log-probs are skipped entirely when the loss and KL settings do not need them). Then the
    mean overlap (share of generator time hidden behind training) and policy lag, for runs that log them."""
    keys = [k for k in (*STEP_TIME_KEYS, "time/eval_s") if any(s.time_means_s.get(k, 0.0) >= 0.005 for s in summaries)]
    ratios = [(k, label) for k, label in STEP_RATIO_KEYS if any(k in s.time_means_s for s in summaries)]
    header = ["run", *(k.removeprefix("time/").removesuffix("_s") for k in keys), *(label for _, label in ratios)]
    rows = [
        [s.name, *(_fmt(s.time_means_s.get(k), ".2f") for k in (*keys, *(k for k, _ in ratios)))] for s in summaries
    ]
    return markdown_table(header, rows)


SEARCH_RESULTS_FILE = "optimization_results.yaml"  # written by hydra/sweeper=optuna in the sweep directory


class Trial(TypedDict):
    """One Optuna trial of a search: its job number, run, searched parameters and objective."""

    trial: int | None
    run: str
    params: dict[str, Any]  # the searched keys' values, whatever YAML type each has
    objective: float | None
    objective_name: str


class Search(TypedDict):
    """One Optuna search (a sweep directory): its trials, best first, and the best the sweeper saved."""

    sweep_dir: str
    best_params: dict[str, Any] | None  # as optimization_results.yaml holds them
    best_value: float | None
    trials: list[Trial]


def searches(data: list[RunData]) -> list[Search]:
    """The Optuna searches among the runs (a sweep directory holding optimization_results.yaml): each trial's
    searched parameters and objective, best first, and the study's best as the sweeper saved it."""
    found: list[Search] = []
    for sweep_dir in dict.fromkeys(run.path.parent for run in data):
        results_path = sweep_dir / SEARCH_RESULTS_FILE
        if not results_path.is_file():
            continue
        results = yaml.safe_load(results_path.read_text()) or {}
        params = list((results.get("best_params") or {}).keys())
        trials: list[Trial] = []
        for run in (run for run in data if run.path.parent == sweep_dir):
            number = re.match(r"(\d+)_", run.path.name)
            which = run.config.get("job.objective") or OBJECTIVES[0]
            objective = objective_of(which, eval_rewards(run.rows))
            trials.append(
                {
                    "trial": int(number.group(1)) if number else None,
                    "run": run.name,
                    "params": {key: run.config.get(key) for key in params},
                    "objective": objective,
                    "objective_name": which,
                }
            )
        trials.sort(key=lambda t: (t["objective"] is None, -(t["objective"] or 0.0), t["trial"] or 0))
        found.append(
            {
                "sweep_dir": str(sweep_dir),
                "best_params": results.get("best_params"),
                "best_value": results.get("best_value"),
                "trials": trials,
            }
        )
    return found


def search_section(search: Search) -> str:
    trials = search["trials"]
    names = sorted({t["objective_name"] for t in trials}) or [OBJECTIVES[0]]
    best = ", ".join(f"{k}={format_value(v)}" for k, v in (search["best_params"] or {}).items())
    header = ["trial", *(search["best_params"] or {}), f"objective ({', '.join(names)})"]
    rows = [
        [
            f"{t['trial']}" + (" (best)" if t["params"] == search["best_params"] else ""),
            *(format_value(v) for v in t["params"].values()),
            _fmt(t["objective"], ".3f"),
        ]
        for t in trials
    ]
    intro = (
        f"`hydra/sweeper=optuna` in `{search['sweep_dir']}`: {len(trials)} trial(s), highest objective first. "
        f"Best (its {SEARCH_RESULTS_FILE}): {_fmt(search['best_value'], '.3f')} with {best or '-'}."
    )
    return "\n\n".join([intro, markdown_table(header, rows)])


def shared_line(configs: list[dict[str, Any]], keys: list[str]) -> str:
    shared = [k for k in HEADLINE_KEYS if k not in keys and k in configs[0]]
    return ", ".join(f"`{k}={format_value(configs[0][k])}`" for k in shared)


def write_report(runs: RunPaths, out: Path, console: Console) -> dict[str, Any]:
    """Read the runs, write report.md, report.json and the plots into `out`; returns the report data."""
    paths = resolve_run_dirs(runs)
    data = [load_run(path, name) for path, name in zip(paths, run_names(paths), strict=True)]
    keys = differing_keys([run.config for run in data])
    summaries = [summarize(run, keys) for run in data]
    groups = seed_groups(data, keys)

    out.mkdir(parents=True, exist_ok=True)

    def label_of(run: RunData) -> str:
        return hparams_label(run, keys, run.name)

    extra_plots = [
        (key, plot_file_name(key), key) for key in extra_eval_keys([row for run in data for row in run.evals])
    ]
    plots = [
        (name, label)
        for key, name, label in (*PLOTS, *extra_plots)
        if plot_metric(groups, label_of, key, label, out / name)
    ]
    plots += [
        (name, label) for key, name, label in TIMED_PLOTS if plot_metric(groups, label_of, key, label, out / name, True)
    ]

    sections = [
        "# GRPO run report",
        f"{len(data)} run(s) under `{common_root(paths)}`, compared from their metrics.jsonl and config.yaml "
        "by `grpo-run job=report`.",
    ]
    if shared := shared_line([run.config for run in data], keys):
        sections.append(f"Shared by all runs: {shared}.")
    sections += [
        "## Results",
        results_table(summaries, keys),
        "Eval reward: on the held-out set (at `rollout.eval_temperature`, greedy by default), at step 0, every "
        "`train.eval_every` steps and at the end; best is the highest of those. Wall time: the sum of the step "
        "and eval times (model loading excluded). With `eval.n_samples` > 1 and `task.eval_sets`, the last "
        "evaluation's mean@n, pass@k and maj@n and each set's numbers follow (docs/evaluation.md).",
    ]
    if seeds := seeds_table(groups, {s.name: s for s in summaries}):
        sections += ["## Across seeds", seeds]
    studies = searches(data)
    for search in studies:
        sections += ["## Search (Optuna trials)", search_section(search)]
    sections += [
        "## Time per step (mean seconds; eval: per evaluation)",
        time_table(summaries),
        "With sync=one_behind, replay_buffer or async, generation, scoring and old log-probs run on the generator "
        "while the learner trains, so the phases add up to more than the step; waiting is the learner idle, "
        "waiting for a rollout batch; overlap is the share of the generator's time hidden behind training; lag "
        "is how many policy versions the learner had moved past the weights that sampled (its mean per step).",
    ]
    if plots:
        sections.append("## Plots")
        sections += [f"![{label}]({name})" for name, label in plots]
    (out / "report.md").write_text("\n\n".join(sections) + "\n")
    report = {
        "runs": [asdict(s) for s in summaries],
        "differing_keys": keys,
        "plots": [name for name, _ in plots],
        "searches": studies,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    console.print(results_table(summaries, keys), highlight=False, markup=False)
    for search in studies:
        console.print(search_section(search), highlight=False, markup=False)
    console.print(f"wrote {out / 'report.md'}, report.json and {len(plots)} plot(s)", highlight=False)
    return report
