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
from grpo_cli.tasks import SanityCase, get_task, make_reward_fn, reward_weights
from grpo_cli.tasks.rewards import DEFAULT_WEIGHTS, TimeLimitedReward


def _show(value: Any) -> str:
    # Escaped: "[1,2)" in a ground truth or a response is math, not rich markup.
    return escape(value if isinstance(value, str) else json.dumps(value))


def score_case(reward_fn: Any, case: SanityCase) -> tuple[float | None, str]:
    """(reward, note): the reward of the case's response, or None and the error a crash raised."""
    try:
        return float(reward_fn(case.response, case.ground_truth)["reward"]), ""
    except Exception as e:  # noqa: BLE001 - a crashing reward is exactly what this job is here to show
        return None, f"{type(e).__name__}: {e}"


def run(cfg: Any, output_dir: Path, console: Console) -> dict[str, Any]:
    """Print the sanity-case table of `cfg.task`; raise UserFacingError when any case disagrees."""
    task = get_task(cfg.task.name)
    cases = task.cases_for(cfg.task.prompt)
    if not cases:
        raise UserFacingError(f"task={task.name} ships no sanity cases for prompt={cfg.task.prompt}")
    # The cases pin down the task's own rule (the correctness component); a custom weighting is shown beside it.
    own_reward = TimeLimitedReward(task.reward_for(cfg.task.prompt), cfg.task.reward_timeout_s or None)
    weighted = make_reward_fn(cfg.task) if reward_weights(cfg.task) != DEFAULT_WEIGHTS else None

    table = Table(title=f"reward sanity cases: task={task.name} prompt={cfg.task.prompt}", title_justify="left")
    for name in ("#", "ground truth", "response", "expected", "got", "", "why"):
        table.add_column(name, overflow="fold")
    if weighted is not None:
        table.add_column("weighted total", justify="right")
    disagreements = []
    for index, case in enumerate(cases, start=1):
        got, error = score_case(own_reward, case)
        ok = got is not None and abs(got - case.expected_reward) < 1e-9
        if not ok:
            disagreements.append(index)
        row = [
            str(index),
            _show(case.ground_truth),
            escape(repr(case.response)),
            f"{case.expected_reward:g}",
            "error" if got is None else f"{got:g}",
            "[green]ok[/]" if ok else "[bold red]DIFFERS[/]",
            escape(case.why + (f" ({error})" if error else "")),
        ]
        if weighted is not None:
            total, _ = score_case(weighted, case)
            row.append("error" if total is None else f"{total:.3g}")
        table.add_row(*row)
    console.print(table)
    if disagreements:
        raise UserFacingError(
            f"{len(disagreements)} of {len(cases)} reward sanity cases of task={task.name} disagree "
            f"(rows {', '.join(map(str, disagreements))}): the reward does not do what the task's cases expect"
        )
    console.print(f"all {len(cases)} cases agree with task={task.name}'s reward rule", highlight=False)
    return {"n": len(cases), "n_disagree": 0}
