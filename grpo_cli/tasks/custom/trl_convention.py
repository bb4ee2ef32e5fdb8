"""TRL's calling convention for a reward function (GRPOTrainer._calculate_rewards, TRL 1.16): the user's function
loaded and its signature bound against TRL's arguments, each call's arguments (trl: once per batch; per_sample:
fn(response, row)), what a function may return, and what it logs through log_extra and log_metric."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_cli.tasks.base import GroundTruth, Row
from grpo_cli.tasks.trainer_state import TrainerState
from grpo_cli.usercode.user_code import (
    RewardSpec,
    UserCodeError,
    check_signature,
    is_file_reference,
    keyword_names,
    load_reward_spec,
    spec_text,
)

# TRL 1.16 passes these itself (GRPOTrainer._calculate_rewards); a column with one of these names is not passed.
# `environments` only with task.environment_factory (episodes/config.py checks that; episodes/adapters/trl.py
# passes it).
TRL_ARGUMENTS = (
    "prompts",
    "completions",
    "completion_ids",
    "trainer_state",
    "log_extra",
    "log_metric",
    "environments",
)
# Columns TRL never passes as columns: the prompt is `prompts`, and these two are its own.
NOT_COLUMNS = ("prompt", "completion", "completion_ids")


def value_problem(value: Any) -> str | None:
    """Why `value` is not a reward (None: it is one, or None itself)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"returned {value!r} ({type(value).__name__}), not a number"
    if not math.isfinite(float(value)):
        return f"returned {value!r}"
    return None


def _plain(value: Any) -> Any:
    """A value logged with log_extra, as JSON (the eval file) and W&B can hold it: numbers, text, booleans, None,
    and lists and dicts of them as they are; a 0-d tensor or numpy scalar as its number; anything else as str."""
    if hasattr(value, "item") and not isinstance(value, str) and getattr(value, "ndim", 0) == 0:
        with contextlib.suppress(TypeError, ValueError):
            value = value.item()
    if value is None or isinstance(value, str | bool | int | float):
        return value
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


# The logging callables a call gets: log_extra(column, values), log_metric(name, value).
Loggers = tuple[Callable[[str, Any], None], Callable[[str, Any], None]]


@dataclass
class RewardLog:
    """What reward functions logged on a batch through TRL's log_extra and log_metric: extra columns, one value per
    sample (None where none was logged), shown in the eval file and the W&B samples table; metric values,
    averaged per step into <train|eval>/<name>. Misuse (a wrong count, a value that is no number) is kept in
    `problems` and reported after the call: raising inside the user's code could be caught by it."""

    n: int
    extra: dict[str, list[Any]] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def loggers(self, rows: Sequence[int]) -> Loggers:
        """log_extra(column, values) and log_metric(name, value) for one call on the batch's samples `rows`
        (values: one per sample of the call, in order)."""

        def log_extra(column: str, values: Any) -> None:
            if hasattr(values, "tolist") and not isinstance(values, str):
                values = values.tolist()
            if not isinstance(column, str) or not column:
                self.problems.append(f"called log_extra({column!r}, ...): name the column with a string")
            elif not isinstance(values, list | tuple) or len(values) != len(rows):
                got = f"{len(values)} values" if isinstance(values, list | tuple) else f"a {type(values).__name__}"
                self.problems.append(
                    f"called log_extra({column!r}, ...) with {got} for {len(rows)} completions (one value each)"
                )
            else:
                slot = self.extra.setdefault(column, [None] * self.n)
                for row, value in zip(rows, values, strict=True):
                    slot[row] = _plain(value)

        def log_metric(name: str, value: Any) -> None:
            if hasattr(value, "item") and not isinstance(value, str):
                with contextlib.suppress(TypeError, ValueError):
                    value = value.item()
            if not isinstance(name, str) or not name:
                self.problems.append(f"called log_metric({name!r}, ...): name the metric with a string")
            elif value is None or value_problem(value) is not None:
                self.problems.append(f"called log_metric({name!r}, {value!r}): give a finite number")
            else:
                self.metrics.setdefault(name, []).append(float(value))

        return log_extra, log_metric

    def merge(self, other: RewardLog) -> None:
        """Keep what a call that succeeded logged (a call that raised and is retried row by row logs again)."""
        for column, values in other.extra.items():
            slot = self.extra.setdefault(column, [None] * self.n)
            for row, value in enumerate(values):
                if value is not None:
                    slot[row] = value
        for name, values in other.metrics.items():
            self.metrics.setdefault(name, []).extend(values)


@dataclass
class NamedReward:
    """One of the user's rewards: a function under its convention, or the reward model."""

    name: str
    key: str  # the config key that names it, for error lines: task.rewards.fmt=rewards.py:format_reward
    fn: Callable[..., Any]
    convention: str  # trl | per_sample | model
    accepts_any_keyword: bool = True
    parameters: tuple[str, ...] = ()
    # What `fn` was loaded from (user_code.load_reward_spec(key, spec, base_dir)), so that another process can load
    # the same function; None for the reward model.
    spec: RewardSpec | None = None
    base_dir: str | None = None
    # Picklable, returns fn: how a worker process loads the function itself, from `spec` (a factory is
    # instantiated once per worker); None: it runs in this process (the reward model).
    loader: Callable[[], Callable[..., Any]] | None = None

    def accepted(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments the function takes (all of them with **kwargs, else those it names)."""
        if self.accepts_any_keyword:
            return kwargs
        return {k: v for k, v in kwargs.items() if k in self.parameters}

    def check_columns(self, row: Row, where: str) -> None:
        """A TRL function's required parameters are columns of the data (TRL passes each column by its name)."""
        if self.convention != "trl":
            return
        columns: dict[str, list[Any]] = {k: [] for k in row if k not in NOT_COLUMNS and k not in TRL_ARGUMENTS}
        _bind_or_fail(self, self.accepted({**dict.fromkeys(TRL_ARGUMENTS), **columns}), where)

    def trl_kwargs(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[Any]] | None,
        trainer_state: TrainerState,
        truths: list[GroundTruth],
    ) -> dict[str, Any]:
        """The keyword arguments of one call under TRL 1.16's convention (GRPOTrainer._calculate_rewards), except
        log_extra and log_metric, which `call_arguments` adds: picklable data only, so that a worker process can
        be sent them."""
        kwargs: dict[str, Any] = {
            "prompts": prompts,
            "completions": completions,
            "completion_ids": completion_ids,
            "trainer_state": trainer_state,
        }
        first = truths[0] if truths and isinstance(truths[0], dict) else {}
        for column in first:
            if column not in NOT_COLUMNS and column not in TRL_ARGUMENTS:
                kwargs[column] = [t.get(column) for t in truths]
        return self.accepted(kwargs)

    def per_sample_row(
        self, truth: GroundTruth, completion_ids: list[Any] | None, trainer_state: TrainerState
    ) -> dict[str, Any]:
        """per_sample: the row a call gets (every column, "prompt", this sample's completion_ids, trainer_state),
        except log_extra and log_metric, which `call_arguments` adds. Picklable."""
        columns = truth if isinstance(truth, dict) else {"ground_truth": truth}
        return {**columns, "completion_ids": completion_ids, "trainer_state": trainer_state}

    def call_arguments(
        self, payload: dict[str, Any] | tuple[str, dict[str, Any]], loggers: Loggers
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """(args, kwargs) of one call: the payload (`trl_kwargs`, or (response, `per_sample_row`)) with the
        logging callables added, the one place they are: a worker process passes recorders here and the parent
        replays what they recorded into its own loggers. per_sample's log_extra takes one value (this sample's)."""
        log_extra, log_metric = loggers
        if self.convention == "per_sample":
            assert isinstance(payload, tuple)  # per_sample_payload's (response, row)
            response, row = payload

            def log_one(column: str, value: Any) -> None:
                log_extra(column, [value])

            return (response, {**row, "log_extra": log_one, "log_metric": log_metric}), {}
        assert isinstance(payload, dict)
        return (), {**payload, **self.accepted({"log_extra": log_extra, "log_metric": log_metric})}

    def logging_callbacks(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Callable[..., Any]]:
        """The logging callables `call_arguments` put among (args, kwargs), by name: what a worker process gets
        as recorders, whose calls the pool replays on these (reward_workers.RewardWorkers.submit)."""
        where = args[1] if self.convention == "per_sample" else kwargs
        return {name: where[name] for name in ("log_extra", "log_metric") if name in where}


def _bind_or_fail(reward: NamedReward, kwargs: dict[str, Any], where: str) -> None:
    try:
        inspect.signature(reward.fn).bind(**kwargs)
    except (TypeError, ValueError) as e:
        columns = ", ".join(k for k in kwargs if k not in TRL_ARGUMENTS) or "none"
        raise UserCodeError(
            f"{reward.key}: {getattr(reward.fn, '__name__', 'it')}{inspect.signature(reward.fn)} cannot take TRL's "
            f"arguments ({', '.join(f'{a}=' for a in TRL_ARGUMENTS)} and the columns of {where}: {columns}): {e}"
        ) from None


def user_reward(name: str, spec: RewardSpec, convention: str, base_dir: Path) -> NamedReward:
    key = f"task.rewards.{name}"
    shown = f"{key}={spec_text(spec)}"
    fn = load_reward_spec(key, spec, base_dir)
    # A worker process loads the same spec itself: plain data (reward_specs), so the partial pickles.
    loader = functools.partial(load_reward_spec, key, spec, base_dir)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return NamedReward(name, shown, fn, convention, spec=spec, base_dir=str(base_dir), loader=loader)
    named = keyword_names(fn)
    any_keyword, names = named is None, tuple(p.name for p in params)
    reward = NamedReward(name, shown, fn, convention, any_keyword, names, spec, str(base_dir), loader)
    fn_name = getattr(fn, "__name__", type(fn).__name__)
    if convention == "per_sample":
        check_signature(key, spec_text(spec), fn, "response", {})
    elif not any_keyword and not {"completions", "completion_ids"} & set(names):
        required = [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        target = spec if isinstance(spec, str) else str(spec.get("_target_"))
        as_node = (
            f"if {fn_name} makes the reward function (a factory), give it as a node with its arguments: "
            f"{key}={{_target_: {target.replace(':', '.') if not is_file_reference(target) else target}"
            + "".join(f", {p}: ..." for p in required)
            + "}; otherwise "
        )
        raise UserCodeError(
            f"{shown}: {fn_name}{inspect.signature(fn)} takes no completions= argument, which TRL's convention "
            f"passes: {as_node}add completions (and **kwargs), or set task.reward_convention=per_sample for "
            "fn(response, row)"
        )
    return reward
