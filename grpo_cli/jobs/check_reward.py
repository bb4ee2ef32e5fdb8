"""`job=check_reward`: score a task's hand-made good and bad responses before spending compute on a model.

Every task ships sanity cases (a ground truth, a response, the reward a careful reader expects, and why). This
job scores them with the reward the run would use for `task.prompt` and prints one table row per case; any
disagreement is an error (exit code 2). No model, no tokenizer, no data set is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from grpo_cli.errors import UserFacingError
from grpo_cli.tasks import SanityCase, make_reward_fn, reward_weights, task_for
from grpo_cli.tasks.rewards import (
    DEFAULT_WEIGHTS,
    SHAPING_CASE_BUFFER,
    SHAPING_CASE_MAX_TOKENS,
    SHAPING_CASE_NGRAM,
    SHAPING_CASES,
    SHAPING_COMPONENTS,
    Shaping,
    TimeLimitedReward,
    shaping_case_value,
    uses_n_tokens,
)


def _show(value: Any) -> str:
    # Escaped: "[1,2)" in a ground truth or a response is math, not rich markup.
    return escape(value if isinstance(value, str) else json.dumps(value))


def _columns(truth: Any) -> Any:
    """task=custom's ground truth without the prompt it carries (the table shows the row's own columns)."""
    return {k: v for k, v in truth.items() if k != "prompt"} if isinstance(truth, dict) else truth


def score_case(reward_fn: Any, case: SanityCase) -> tuple[float | None, str, dict[str, float]]:
    """(reward, note, {component: value}): the reward of the case's response, or None and the error a crash raised.
    A reward with the overlong term scores the case as a short completion (0 tokens: no overlong penalty)."""
    try:
        kwargs = {"n_tokens": 0} if uses_n_tokens(reward_fn) else {}
        result = reward_fn(case.response, case.ground_truth, **kwargs)
    except Exception as e:  # noqa: BLE001 - a crashing reward is exactly what this job is here to show
        return None, f"{type(e).__name__}: {e}", {}
    parts = {key.removeprefix("reward/"): float(v) for key, v in result.items() if key.startswith("reward/")}
    return float(result["reward"]), "", parts


def run(cfg: Any, output_dir: Path, console: Console) -> dict[str, Any]:
    """Print the sanity-case table of `cfg.task`; raise UserFacingError when any case disagrees."""
    task = task_for(cfg.task)
    cases = task.cases_for(cfg.task.prompt)
    if not cases and task.from_config is not None:
        raise UserFacingError(
            f'task={task.name} checks your own cases: give task.cases_path=cases.jsonl, one {{"response": ..., '
            '"expected": ..., <the columns your template reads>}} per line'
        )
    if not cases:
        raise UserFacingError(f"task={task.name} ships no sanity cases for prompt={cfg.task.prompt}")
    # The cases pin down the task's own rule (the correctness component); a custom weighting is shown beside it.
    # task=custom's cases are of its whole weighted reward, each named reward shown beside it.
    if task.from_config is not None:
        own_reward, weighted = make_reward_fn(cfg.task, cfg.rollout.max_tokens), None
    else:
        own_reward = TimeLimitedReward(task.reward_for(cfg.task.prompt), cfg.task.reward_timeout_s or None)
        weighted = (
            make_reward_fn(cfg.task, cfg.rollout.max_tokens) if reward_weights(cfg.task) != DEFAULT_WEIGHTS else None
        )

    table = Table(title=f"reward sanity cases: task={task.name} prompt={cfg.task.prompt}", title_justify="left")
    for name in ("#", "ground truth", "response", "expected", "got", "", "why"):
        table.add_column(name, overflow="fold")
    if weighted is not None:
        table.add_column("weighted total", justify="right")
    show_parts = task.from_config is not None
    if show_parts:
        table.add_column("each reward", overflow="fold")
    disagreements = []
    for index, case in enumerate(cases, start=1):
        got, error, parts = score_case(own_reward, case)
        ok = got is not None and abs(got - case.expected_reward) < 1e-9
        if not ok:
            disagreements.append(index)
        row = [
            str(index),
            _show(_columns(case.ground_truth) if show_parts else case.ground_truth),
            escape(repr(case.response)),
            f"{case.expected_reward:g}",
            "error" if got is None else f"{got:g}",
            "[green]ok[/]" if ok else "[bold red]DIFFERS[/]",
            escape(case.why + (f" ({error})" if error else "")),
        ]
        if weighted is not None:
            total, _, _ = score_case(weighted, case)
            row.append("error" if total is None else f"{total:.3g}")
        if show_parts:
            row.append(escape(" ".join(f"{name}={value:.3g}" for name, value in parts.items())))
        table.add_row(*row)
    console.print(table)
    shaping_disagree = check_shaping_terms(cfg, console)
    if disagreements:
        raise UserFacingError(
            f"{len(disagreements)} of {len(cases)} reward sanity cases of task={task.name} disagree "
            f"(rows {', '.join(map(str, disagreements))}): the reward does not do what the task's cases expect"
        )
    if shaping_disagree:
        raise UserFacingError(
            f"{len(shaping_disagree)} shaping-term sanity cases disagree (rows {', '.join(map(str, shaping_disagree))})"
        )
    console.print(f"all {len(cases)} cases agree with task={task.name}'s reward rule", highlight=False)
    return {"n": len(cases), "n_disagree": 0}


def check_shaping_terms(cfg: Any, console: Console) -> list[int]:
    """The sanity cases of the shaping terms the run weights (task.reward_weights.overlong / repetition), in a
    second table, then what this run's settings make of them. Returns the rows that disagree."""
    weighted = [term for term in SHAPING_COMPONENTS if reward_weights(cfg.task).get(term)]
    if not weighted:
        return []
    table = Table(
        title=f"shaping-term sanity cases (max_tokens {SHAPING_CASE_MAX_TOKENS}, overlong buffer "
        f"{SHAPING_CASE_BUFFER}, {SHAPING_CASE_NGRAM}-grams)",
        title_justify="left",
    )
    for name in ("#", "term", "response", "expected", "got", "", "why"):
        table.add_column(name, overflow="fold")
    disagreements = []
    cases = [case for case in SHAPING_CASES if case.term in weighted]
    for index, case in enumerate(cases, start=1):
        got = shaping_case_value(case)
        ok = abs(got - case.expected) < 1e-9
        if not ok:
            disagreements.append(index)
        row = [str(index), case.term, escape(repr(case.response)), f"{case.expected:.3g}", f"{got:.3g}"]
        table.add_row(*row, "[green]ok[/]" if ok else "[bold red]DIFFERS[/]", escape(case.why))
    console.print(table)
    settings = Shaping(cfg.rollout.max_tokens, cfg.task.overlong_buffer, cfg.task.repetition_ngram)
    if "overlong" in weighted:
        start = cfg.rollout.max_tokens - settings.buffer()
        console.print(
            f"this run: overlong is 0 up to {start} tokens, then falls to -1 at rollout.max_tokens="
            f"{cfg.rollout.max_tokens} (x weight {reward_weights(cfg.task)['overlong']:g})",
            highlight=False,
        )
    if "repetition" in weighted:
        console.print(
            f"this run: repetition counts {settings.repetition_ngram}-grams "
            f"(x weight {reward_weights(cfg.task)['repetition']:g})",
            highlight=False,
        )
    return disagreements
