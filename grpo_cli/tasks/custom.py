"""task=custom: a task made of config and the user's own code, with no change to the package (docs/custom-tasks.md).

    data      task.train_path / task.eval_path (.jsonl, .csv, .parquet, a dataset directory), task.dataset with
              task.split / task.eval_split (a `datasets` hub id or directory), or task.generator
              (`file.py:function` called with (n, seed)); any column names (task.rename_columns renames them)
    prompt    task.template over the row's columns ("Rewrite this review to be negative: {review}"),
              task.system_prompt, and the prompt styles of every task (task.prompt: chat, question_only, r1_zero)
    rewards   task.rewards.<name>=path/to/file.py:function or package.module:function, and/or a
              sequence-classification model (task.reward_model.*), summed with task.reward_weights (a name without
              a weight counts 1) and each logged as train/reward/<name> and eval/reward/<name>

How a reward function is called (task.reward_convention):
    trl         TRL's convention, the default, so a function written for TRL's GRPOTrainer runs unchanged:
                fn(prompts=[...], completions=[...], <each other column>=[...]) -> one float or None per sample,
                once per batch. Under task.prompt=chat prompts are the chat messages and each completion is
                [{"role": "assistant", "content": text}], as TRL passes them for a conversational dataset;
                otherwise both are text. A function without **kwargs gets only the columns it names.
    per_sample  fn(response, row) -> float or None, once per sample; row holds every column and "prompt".
None means "no reward from this function for this sample": the sample's reward is the weighted sum of the others
(TRL's nansum), and the function's logged mean leaves it out.

A reward that raises, returns the wrong number of values, NaN, a string, or runs past task.reward_timeout_s is
one line naming the function, the row and what it returned. The functions run in task.reward_workers worker
processes (tasks/reward_workers.py), so one blocked in C is killed at the limit and an exit or a crash is that
function's error; 0 calls them in this process, unprotected. task.on_reward_error decides what happens then:
stop (the default: the run stops with its checkpoints kept, and a save of the last update) or skip (that function
gives that sample no reward, counted in train/reward_errors and train/reward_timeouts).

The TaskSpec of a custom task is built from its config (`TaskSpec.from_config`), so the loop, evaluation,
pass@k / maj@n and check_reward treat it like a built-in task. No torch here (the reward model's module imports
it when one is configured).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import math
import numbers
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_cli.errors import UserFacingError
from grpo_cli.fields import any_value, choice, non_negative, path, positive
from grpo_cli.tasks.base import (
    PROMPT_STYLES,
    R1_ZERO_TEMPLATE,
    Example,
    Prompt,
    SanityCase,
    TaskDataError,
    TaskSpec,
)
from grpo_cli.tasks.reward_workers import InProcessCall, PendingCall, RewardWorkers, describe_error
from grpo_cli.tasks.rewards import SHAPING_COMPONENTS, Shaping, overlong_penalty, repetition_penalty
from grpo_cli.tasks.schema import TaskConfig
from grpo_cli.tasks.sources import check_json_values, dataset_rows, file_rows, generated_rows
from grpo_cli.tasks.timelimit import RewardTimeout
from grpo_cli.tasks.user_code import (
    UserCodeError,
    absolute_reference,
    check_signature,
    file_sha256,
    load_callable,
    resolve_file,
)

REWARD_CONVENTIONS = ("trl", "per_sample")
ON_REWARD_ERROR = ("stop", "skip")
# What the reward model reads: the response alone (a sentiment classifier), or the prompt text and the response
# (a preference reward model, as TRL feeds one).
REWARD_MODEL_INPUTS = ("response", "prompt_and_response")
# TRL passes these itself; a column with one of these names is not passed again.
TRL_ARGUMENTS = ("prompts", "completions")


@dataclass
class RewardModelConfig:
    """task.reward_model: a Hugging Face sequence-classification model as a reward (null path: none)."""

    # A local model directory or a hub id (read offline from the cache when HF_HUB_OFFLINE=1).
    path: str | None = any_value(None)
    # The label whose probability (softmax over the labels) is the reward, e.g. NEGATIVE; null: the raw score of
    # a one-logit head (a reward model).
    label: str | None = any_value(None)
    # The name it is weighted and logged under: task.reward_weights.<name>, train/reward/<name>.
    name: str = any_value("reward_model")
    # What it reads: the response alone, or the prompt text followed by the response.
    input: str = choice("response", REWARD_MODEL_INPUTS)
    # Responses per forward pass (on the policy's device, no grad, each truncated to the model's max length).
    batch_size: int = positive(32)
    # auto: bfloat16 on a CUDA GPU that has it, float32 otherwise.
    dtype: str = choice("auto", ("auto", "float32", "bfloat16"))


@dataclass
class CustomTaskConfig(TaskConfig):
    """task=custom: data, prompt and rewards from the config and the user's own code (docs/custom-tasks.md)."""

    # Local data, one file or folder per split: .jsonl, .csv, .parquet, or a `datasets` directory. Relative paths
    # start where grpo-run was run (made absolute before the run starts). First of: path, generator, dataset.
    train_path: str | None = any_value(None)
    eval_path: str | None = any_value(None)
    # A `datasets` hub id or local dataset directory, read at task.split (training) and task.eval_split.
    dataset: str | None = any_value(None)
    dataset_config: str | None = any_value(None)
    split: str = any_value("train")
    eval_split: str = any_value("test")
    # Your generator, path/to/file.py:function or package.module:function, called as fn(n, seed) -> list of dicts:
    # (task.n_train, task.data_seed) for training and (task.n_eval, task.data_seed + 1) for evaluation.
    generator: str | None = any_value(None)
    # Columns renamed before anything reads them: {"Ground Truth Answer": references}.
    rename_columns: dict[str, str] = any_value(factory=dict)
    # The prompt, a Python format string over the row's columns: "Rewrite this review to be negative: {review}".
    template: str = any_value("{prompt}")
    # Sent before the prompt: a system message under task.prompt=chat, the first paragraph otherwise.
    system_prompt: str | None = any_value(None)
    # Your reward functions by name: path/to/file.py:function or package.module:function (+task.rewards.<name>=...
    # adds one on the command line).
    rewards: dict[str, str] = any_value(factory=dict)
    # trl: fn(prompts=, completions=, **columns) -> list of float|None per batch (TRL's GRPOTrainer convention);
    # per_sample: fn(response, row) -> float|None per sample.
    reward_convention: str = choice("trl", REWARD_CONVENTIONS)
    # Weight of each reward by name (task.rewards' names, task.reward_model.name, and the shaping terms overlong
    # and repetition); a reward without a weight counts 1, a shaping term 0.
    reward_weights: dict[str, float] = any_value(factory=dict)  # type: ignore[assignment]
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    # What a reward that raises, hangs, returns NaN, a string or the wrong count does to the run: stop (one line
    # naming it; checkpoints kept) or skip (no reward from it for that sample, counted in train/reward_errors).
    on_reward_error: str = choice("stop", ON_REWARD_ERROR)
    # Worker processes that run the reward functions (task.rewards), each call killed at task.reward_timeout_s;
    # calls of several functions, or of per_sample rows, run in parallel across them. 0: in this process, where
    # a call blocked in C outlives the limit and sys.exit ends the run (the reward model always runs here).
    reward_workers: int = non_negative(1, hint="0: call the functions in this process, unprotected")
    # The reward logged as answer_reward, whose value >= 1 marks an answer correct (eval/pass@k, maj@n); null:
    # the weighted total.
    answer_from: str | None = any_value(None)
    # The reward logged as format_reward; null: the weighted total.
    format_from: str | None = any_value(None)
    # job=check_reward's cases: a JSONL file, {"response": ..., "expected": ..., <the row's columns>} per line.
    cases_path: str | None = path(None, "file")
    # Where relative paths and package.module references are found; null: the directory grpo-run was started from
    # (written into the run's config, so every rank, actor and sweep job finds the same files).
    base_dir: str | None = path(None, "dir")


class RewardFunctionError(UserFacingError):
    """A user's reward function failed on a row at run time (task.on_reward_error=stop)."""


# ------------------------------------------------------------------------------------------ prompts and rows


def template_columns(template: str) -> list[str]:
    """The column names a format template reads ("{review} {label!r}" -> ["review", "label"])."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise UserFacingError(f"task.template={template!r} is not a format string ({e}): write {{column}}") from None
    columns = []
    for name in fields:
        if not name or name.isdigit():
            raise UserFacingError(f"task.template={template!r}: name a column in each {{}}, e.g. {{question}}")
        columns.append(name.split(".")[0].split("[")[0])
    return list(dict.fromkeys(columns))


def render_prompt(task_cfg: Any, row: dict[str, Any]) -> Prompt:
    """The prompt of one row: the template over its columns, in the prompt style, after the system prompt."""
    text = task_cfg.template.format_map(row)
    system = task_cfg.system_prompt
    if task_cfg.prompt == "chat":
        return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    if task_cfg.prompt == "r1_zero":
        text = R1_ZERO_TEMPLATE.format(question=text)
    return f"{system}\n\n{text}" if system else text


def renamed(task_cfg: Any, row: dict[str, Any]) -> dict[str, Any]:
    mapping = dict(task_cfg.rename_columns or {})
    return {mapping.get(key, key): value for key, value in row.items()}


def check_template(task_cfg: Any, rows: list[dict[str, Any]], where: str) -> None:
    """Every column the template reads is in every row (one line naming the first row that lacks one)."""
    needed = template_columns(task_cfg.template)
    for index, row in enumerate(rows):
        missing = [c for c in needed if c not in row]
        if missing:
            raise TaskDataError(
                f"task.template reads column {missing[0]!r}, which {where} row {index} lacks (its columns: "
                f"{', '.join(map(str, row)) or 'none'}): fix task.template, or rename with "
                f"task.rename_columns.<old>={missing[0]}"
            )


def truth_of(row: dict[str, Any], prompt: Prompt) -> dict[str, Any]:
    """A custom task's ground truth: the row's columns and the prompt the model was given (what a reward reads)."""
    return {**row, "prompt": prompt}


def split_rows(task_cfg: Any, split: str) -> tuple[list[dict[str, Any]], str]:
    """(rows, where they came from) of one split, first of: a path, the generator, the dataset."""
    train = split == "train"
    key_path = "task.train_path" if train else "task.eval_path"
    local = task_cfg.train_path if train else task_cfg.eval_path
    n = task_cfg.n_train if train else task_cfg.n_eval
    if local:
        return file_rows(key_path, local, n), f"{key_path}={local}"
    if task_cfg.generator:
        seed = task_cfg.data_seed if train else task_cfg.data_seed + 1
        rows = generated_rows("task.generator", task_cfg.generator, base_dir_of(task_cfg), n, seed)
        return rows, f"task.generator={task_cfg.generator} (n={n}, seed={seed})"
    if task_cfg.dataset:
        which = task_cfg.split if train else task_cfg.eval_split
        rows = dataset_rows("task.dataset", task_cfg.dataset, task_cfg.dataset_config, which, n)
        return rows, f"task.dataset={task_cfg.dataset} split {which!r}"
    raise TaskDataError(
        f"task=custom has no {'training' if train else 'held-out'} data: give {key_path}=<file>, "
        "task.generator=<file.py:function> or task.dataset=<hub id or directory>"
    )


def build_examples(task_cfg: Any, rewards: list[NamedReward], split: str) -> list[Example]:
    """The examples of one split: rows renamed, checked against the template and the reward signatures."""
    rows, where = split_rows(task_cfg, split)
    rows = [renamed(task_cfg, row) for row in rows]
    check_template(task_cfg, rows, where)
    check_json_values(where, rows)
    for reward in rewards:
        reward.check_columns(rows[0], where)
    examples = []
    for row in rows:
        prompt = render_prompt(task_cfg, row)
        examples.append(Example(prompt, truth_of(row, prompt)))
    return examples


# ------------------------------------------------------------------------------------------------ rewards


def _row_text(truth: Any, limit: int = 160) -> str:
    columns = {k: v for k, v in truth.items() if k != "prompt"} if isinstance(truth, dict) else truth
    text = json.dumps(columns, default=repr, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _value_problem(value: Any) -> str | None:
    """Why `value` is not a reward (None: it is one, or None itself)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return f"returned {value!r} ({type(value).__name__}), not a number"
    if not math.isfinite(float(value)):
        return f"returned {value!r}"
    return None


@dataclass
class NamedReward:
    """One of the user's rewards: a function under its convention, or the reward model."""

    name: str
    key: str  # the config key that names it, for error lines: task.rewards.fmt=rewards.py:format_reward
    fn: Callable[..., Any]
    convention: str  # trl | per_sample | model
    accepts_any_keyword: bool = True
    parameters: tuple[str, ...] = ()
    # Picklable, returns fn: how a worker process loads the function itself (None: it runs in this process).
    loader: Callable[[], Callable[..., Any]] | None = None

    def check_columns(self, row: dict[str, Any], where: str) -> None:
        """A TRL function's required parameters are columns of the data (TRL passes each column by its name)."""
        if self.convention != "trl":
            return
        columns = {k: [] for k in row if k not in TRL_ARGUMENTS}
        kwargs = {"prompts": [], "completions": [], **columns}
        if not self.accepts_any_keyword:
            kwargs = {k: v for k, v in kwargs.items() if k in self.parameters}
        _bind_or_fail(self, kwargs, where)

    def trl_kwargs(self, prompts: list[Any], completions: list[Any], truths: list[Any]) -> dict[str, Any]:
        columns = [k for k in (truths[0] if truths and isinstance(truths[0], dict) else {}) if k != "prompt"]
        kwargs: dict[str, Any] = {"prompts": prompts, "completions": completions}
        for column in columns:
            if column not in TRL_ARGUMENTS:
                kwargs[column] = [t.get(column) for t in truths]
        if not self.accepts_any_keyword:
            kwargs = {k: v for k, v in kwargs.items() if k in self.parameters}
        return kwargs


def _bind_or_fail(reward: NamedReward, kwargs: dict[str, Any], where: str) -> None:
    try:
        inspect.signature(reward.fn).bind(**kwargs)
    except (TypeError, ValueError) as e:
        columns = ", ".join(k for k in kwargs if k not in TRL_ARGUMENTS) or "none"
        raise UserCodeError(
            f"{reward.key}: {getattr(reward.fn, '__name__', 'it')}{inspect.signature(reward.fn)} cannot take TRL's "
            f"arguments (prompts=, completions= and the columns of {where}: {columns}): {e}"
        ) from None


def _user_reward(name: str, reference: str, convention: str, base_dir: Path) -> NamedReward:
    key = f"task.rewards.{name}"
    fn = load_callable(key, reference, base_dir)
    loader = functools.partial(load_callable, key, reference, base_dir)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return NamedReward(name, f"{key}={reference}", fn, convention, loader=loader)
    any_keyword = any(p.kind is p.VAR_KEYWORD for p in params)
    names = tuple(p.name for p in params)
    reward = NamedReward(name, f"{key}={reference}", fn, convention, any_keyword, names, loader)
    if convention == "per_sample":
        check_signature(key, reference, fn, "response", {})
    elif not any_keyword and "completions" not in names:
        raise UserCodeError(
            f"{key}={reference}: {fn.__name__}{inspect.signature(fn)} takes no completions= argument, which TRL's "
            "convention passes: add completions (and **kwargs), or set task.reward_convention=per_sample for "
            "fn(response, row)"
        )
    return reward


@dataclass
class BatchScores:
    rewards: list[dict[str, float]]
    n_errors: int
    n_timeouts: int


@dataclass
class CustomReward:
    """The reward of a custom task: every named reward on a batch, combined with the weights (None: no reward from
    that function for that sample). The scorer calls `score_batch` (rollout/scoring.py); calling it on one
    response (check_reward) scores a batch of one."""

    rewards: list[NamedReward]
    weights: dict[str, float]
    time_limit_s: float | None
    on_error: str
    conversational: bool
    answer_from: str | None = None
    format_from: str | None = None
    shaping: Shaping = Shaping()
    model_factory: Callable[[str | None], Any] | None = None
    device: str | None = None
    workers: int = 0  # task.reward_workers (0: the functions run in this process)
    _model: Any = field(default=None, repr=False)
    _pool: RewardWorkers | None = field(default=None, repr=False)

    @property
    def uses_n_tokens(self) -> bool:
        return self.weights.get("overlong", 0.0) != 0.0

    def for_run(self, max_tokens: int | None, device: str | None) -> CustomReward:
        """This reward with the run's generation limit (the overlong term) and the device of its reward model."""
        return dataclasses.replace(
            self, shaping=dataclasses.replace(self.shaping, max_tokens=max_tokens), device=device
        )

    def __call__(self, response: str, ground_truth: Any, n_tokens: int | None = None) -> dict[str, float]:
        return self.score_batch([response], [ground_truth], [n_tokens]).rewards[0]

    def close(self) -> None:
        """Stop the worker processes (a later call starts new ones)."""
        if self._pool is not None:
            self._pool.close()

    # --- one batch --------------------------------------------------------------------------------------
    def score_batch(
        self, responses: Sequence[str], truths: Sequence[Any], n_tokens: Sequence[int | None] | None = None
    ) -> BatchScores:
        n = len(responses)
        lengths = list(n_tokens) if n_tokens is not None else [None] * n
        counts = {"errors": 0, "timeouts": 0}
        values: dict[str, list[float | None]] = {}
        # Every function's calls first, then their results: with workers, the calls run in parallel.
        calls = {reward.name: self._start_batch(reward, list(responses), list(truths)) for reward in self.rewards}
        for reward in self.rewards:
            values[reward.name] = self._values(reward, list(responses), list(truths), counts, calls[reward.name])
        if self.weights.get("overlong"):
            if self.shaping.max_tokens is None or any(length is None for length in lengths):
                raise ValueError("the overlong reward term needs rollout.max_tokens and each completion's token count")
            buffer = self.shaping.buffer()
            values["overlong"] = [overlong_penalty(k, self.shaping.max_tokens, buffer) for k in lengths]
        if self.weights.get("repetition"):
            values["repetition"] = [repetition_penalty(r, self.shaping.repetition_ngram) for r in responses]
        out = []
        for i in range(n):
            sample = {name: column[i] for name, column in values.items()}
            total = sum(self.weights.get(name, 0.0) * v for name, v in sample.items() if v is not None)
            answer = total if self.answer_from is None else (sample.get(self.answer_from) or 0.0)
            fmt = total if self.format_from is None else (sample.get(self.format_from) or 0.0)
            result = {"reward": total, "format_reward": fmt, "answer_reward": answer, "correctness": answer}
            result.update({f"reward/{name}": v for name, v in sample.items() if v is not None})
            out.append(result)
        return BatchScores(out, counts["errors"], counts["timeouts"])

    def _start_batch(self, reward: NamedReward, responses: list[str], truths: list[Any]) -> Any:
        """The calls of one function on the batch, started: one per row (per_sample) or one (trl)."""
        if reward.convention == "model":
            return None
        if reward.convention == "per_sample":
            return [self._start(reward, (r, t), {}) for r, t in zip(responses, truths, strict=True)]
        return self._start(reward, (), self._trl_arguments(reward, responses, truths))

    def _values(
        self, reward: NamedReward, responses: list[str], truths: list[Any], counts: dict[str, int], calls: Any
    ) -> list[float | None]:
        if reward.convention == "model":
            return self._model_values(reward, responses, truths)
        if reward.convention == "per_sample":
            return [self._one(reward, r, t, counts, c) for r, t, c in zip(responses, truths, calls, strict=True)]
        return self._trl_batch(reward, responses, truths, counts, calls)

    def _fail(self, reward: NamedReward, what: str, truth: Any, where: str = "on row") -> None:
        """Stop: one line naming the function, the row and what it did."""
        raise RewardFunctionError(
            f"reward {reward.key} {what} {where} {_row_text(truth)}: fix it, or set task.on_reward_error=skip to "
            "give such samples no reward from it"
        )

    def _start(
        self, reward: NamedReward, args: tuple[Any, ...], kwargs: dict[str, Any], callbacks: dict | None = None
    ) -> PendingCall | InProcessCall:
        """One call of a user's function, started: in a worker process, or (task.reward_workers=0) in this one when
        its result is read. `callbacks` (log_extra, log_metric) among the arguments reach the caller's."""
        if not self.workers or reward.loader is None:
            return InProcessCall(reward.fn, args, kwargs, self.time_limit_s)
        if self._pool is None:
            self._pool = RewardWorkers(self.workers, self.time_limit_s)
        return self._pool.submit(reward.loader, args, kwargs, callbacks, label=reward.key)

    def _one(
        self, reward: NamedReward, response: str, truth: Any, counts: dict[str, int], call: Any = None
    ) -> float | None:
        """per_sample: fn(response, row)."""
        try:
            value = (call or self._start(reward, (response, truth), {})).result()
        except RewardTimeout:
            if self.on_error == "stop":
                self._fail(reward, f"ran past task.reward_timeout_s={self.time_limit_s:g}s", truth)
            counts["timeouts"] += 1
            return None
        except Exception as e:  # noqa: BLE001 - the user's code: stop with one line, or skip the sample
            if self.on_error == "stop":
                self._fail(reward, describe_error(e), truth)
            counts["errors"] += 1
            return None
        return self._checked(reward, value, truth, counts)

    def _checked(self, reward: NamedReward, value: Any, truth: Any, counts: dict[str, int]) -> float | None:
        if hasattr(value, "item") and not isinstance(value, str):  # a 0-d tensor or numpy scalar
            # An array of several values keeps its type, and _value_problem names it.
            with contextlib.suppress(TypeError, ValueError):
                value = value.item()
        problem = _value_problem(value)
        if problem is None:
            return None if value is None else float(value)
        if self.on_error == "stop":
            self._fail(reward, problem, truth)
        counts["errors"] += 1
        return None

    def _trl_arguments(self, reward: NamedReward, responses: list[str], truths: list[Any]) -> dict[str, Any]:
        prompts = [t.get("prompt") if isinstance(t, dict) else None for t in truths]
        completions: list[Any] = (
            [[{"role": "assistant", "content": r}] for r in responses] if self.conversational else list(responses)
        )
        return reward.trl_kwargs(prompts, completions, truths)

    def _trl_batch(
        self, reward: NamedReward, responses: list[str], truths: list[Any], counts: dict[str, int], call: Any = None
    ) -> list[float | None]:
        n = len(responses)
        try:
            out = (call or self._start(reward, (), self._trl_arguments(reward, responses, truths))).result()
        except RewardTimeout:
            if self.on_error == "stop":
                self._fail(
                    reward, f"ran past task.reward_timeout_s={self.time_limit_s:g}s on a batch of {n}", truths[0]
                )
            counts["timeouts"] += n
            return [None] * n
        except Exception as e:  # noqa: BLE001 - find the row(s) it fails on, one sample at a time
            error = describe_error(e)
            if n == 1:
                if self.on_error == "stop":
                    self._fail(reward, error, truths[0])
                counts["errors"] += 1
                return [None]
            # Alone, each row either scores (skip keeps it) or fails (stop names that row; skip drops it).
            singles = [self._trl_batch(reward, [r], [t], counts)[0] for r, t in zip(responses, truths, strict=True)]
            if self.on_error == "stop":  # every row scored alone: the batch itself is what fails
                self._fail(reward, error, truths[0], where=f"on a batch of {n} rows, though each alone scores; first")
            return singles
        if hasattr(out, "tolist") and not isinstance(out, list):  # a tensor or numpy array
            out = out.tolist()
        if not isinstance(out, list | tuple) or len(out) != n:
            got = f"{len(out)} values" if isinstance(out, list | tuple) else f"{type(out).__name__} {out!r:.60}"
            if self.on_error == "stop":
                self._fail(reward, f"returned {got} for {n} completions (one float or None each)", truths[0])
            counts["errors"] += n
            return [None] * n
        return [self._checked(reward, v, t, counts) for v, t in zip(out, truths, strict=True)]

    def _model_values(self, reward: NamedReward, responses: list[str], truths: list[Any]) -> list[float | None]:
        if self._model is None:
            self._model = reward.fn(self.device)  # the scorer, loaded on first use on this run's device
        return [float(v) for v in self._model(responses, truths)]


# ------------------------------------------------------------------------------------------------ the task


def base_dir_of(task_cfg: Any) -> Path:
    """Where relative paths and modules are found: task.base_dir, else this process's working directory."""
    return Path(task_cfg.base_dir) if getattr(task_cfg, "base_dir", None) else Path.cwd()


def weights_of(task_cfg: Any, names: list[str]) -> dict[str, float]:
    """{name: weight} for every reward (1 unless given) and each weighted shaping term; one line for a weight
    naming nothing."""
    given = {str(k): v for k, v in dict(task_cfg.reward_weights or {}).items()}
    allowed = [*names, *SHAPING_COMPONENTS]
    for name, weight in given.items():
        if name not in allowed:
            raise UserFacingError(
                f"task.reward_weights.{name}={weight}: there is no reward named {name}: use "
                f"{', '.join(allowed)} (task.rewards.<name>, task.reward_model.name, the shaping terms)"
            )
        if not isinstance(weight, int | float) or isinstance(weight, bool) or not math.isfinite(weight):
            raise UserFacingError(f"task.reward_weights.{name}={weight} must be a finite number")
    weights = {name: float(given.get(name, 1.0)) for name in names}
    weights.update({term: float(given[term]) for term in SHAPING_COMPONENTS if given.get(term)})
    if not any(weights.values()):
        raise UserFacingError(f"every task.reward_weights is 0: give one of {', '.join(names)} a weight")
    return weights


def _reward_model(task_cfg: Any) -> NamedReward | None:
    rm = task_cfg.reward_model
    if not rm.path:
        if rm.label:
            raise UserFacingError(f"task.reward_model.label={rm.label} without task.reward_model.path: give the model")
        return None
    from grpo_cli.tasks.reward_model import RewardModelScorer, check_reward_model  # torch, only when configured

    local = rm.path.startswith((".", "/", "~")) or (base_dir_of(task_cfg) / rm.path).is_dir()
    model_path = str(resolve_file(rm.path, base_dir_of(task_cfg))) if local else rm.path
    check_reward_model(model_path, rm.label)

    def load(device: str | None) -> Any:
        return RewardModelScorer(model_path, rm.label, rm.batch_size, rm.dtype, device or "cpu", rm.input)

    return NamedReward(rm.name, f"task.reward_model.path={rm.path}", load, "model")


def read_cases(task_cfg: Any) -> tuple[SanityCase, ...]:
    """task.cases_path: {"response", "expected", <columns>} per line -> sanity cases (job=check_reward)."""
    if not task_cfg.cases_path:
        return ()
    rows = file_rows("task.cases_path", task_cfg.cases_path, None)
    cases = []
    for line, row in enumerate(rows, start=1):
        where = f"{task_cfg.cases_path}:{line}"
        if "response" not in row or "expected" not in row:
            raise TaskDataError(
                f'{where}: each case needs "response" and "expected" (and the columns the template reads)'
            )
        columns = renamed(task_cfg, {k: v for k, v in row.items() if k not in ("response", "expected", "why")})
        check_template(task_cfg, [columns], where)
        expected = row["expected"]
        if _value_problem(expected) is not None or expected is None:
            raise TaskDataError(f'{where}: "expected" must be a number, got {expected!r}')
        why = str(row.get("why", where))
        cases.append(
            SanityCase(truth_of(columns, render_prompt(task_cfg, columns)), str(row["response"]), float(expected), why)
        )
    return tuple(cases)


def build_custom_task(task_cfg: Any) -> TaskSpec:
    """This run's TaskSpec: the user's rewards imported and checked, the data read on build (preflight), all before
    any model loads."""
    base_dir = base_dir_of(task_cfg)
    names = [str(name) for name in (task_cfg.rewards or {})]
    rewards = [_user_reward(name, str(task_cfg.rewards[name]), task_cfg.reward_convention, base_dir) for name in names]
    model = _reward_model(task_cfg)
    if model is not None:
        if model.name in names:
            raise UserFacingError(f"task.reward_model.name={model.name} is also in task.rewards: give it another name")
        rewards.append(model)
    if not rewards:
        raise UserFacingError(
            "task=custom has no reward: give task.rewards.<name>=path/to/file.py:function (+task.rewards.<name>= on "
            "the command line) or task.reward_model.path=<classifier>"
        )
    all_names = [r.name for r in rewards]
    for key in ("answer_from", "format_from"):
        chosen = getattr(task_cfg, key)
        if chosen is not None and chosen not in all_names:
            raise UserFacingError(f"task.{key}={chosen}: there is no reward named {chosen}: use {', '.join(all_names)}")
    template_columns(task_cfg.template)
    reward = CustomReward(
        rewards,
        weights_of(task_cfg, all_names),
        task_cfg.reward_timeout_s or None,
        task_cfg.on_reward_error,
        conversational=task_cfg.prompt == "chat",
        answer_from=task_cfg.answer_from,
        format_from=task_cfg.format_from,
        shaping=Shaping(None, task_cfg.overlong_buffer, task_cfg.repetition_ngram),
        workers=task_cfg.reward_workers,
    )

    def build(split: str, n: int | None = None, seed: int = 0, prompt_style: str = "chat", **_: Any) -> list[Example]:
        del n, seed, prompt_style  # read from task_cfg itself, like every other source of this task
        return build_examples(task_cfg, rewards, split)

    return dataclasses.replace(CUSTOM_TASK, reward_fn=reward, build=build, sanity_cases=read_cases(task_cfg))


def absolutize_paths(task_cfg: Any, base_dir: Path) -> None:
    """Make task=custom's relative paths absolute against `base_dir` (the directory grpo-run was started from) and
    record it as task.base_dir, in place, before the config is saved and sent to ranks, actors and sweep jobs."""
    if not getattr(task_cfg, "base_dir", None):
        task_cfg.base_dir = str(base_dir)
    base = Path(task_cfg.base_dir)
    for key in ("train_path", "eval_path", "cases_path"):
        value = getattr(task_cfg, key)
        if value and not Path(str(value)).expanduser().is_absolute():
            setattr(task_cfg, key, str((base / str(value)).resolve()))
    if (
        task_cfg.dataset
        and Path(base / str(task_cfg.dataset)).is_dir()
        and not Path(str(task_cfg.dataset)).is_absolute()
    ):
        task_cfg.dataset = str((base / str(task_cfg.dataset)).resolve())
    if task_cfg.generator:
        task_cfg.generator = absolute_reference(str(task_cfg.generator), base)
    for name in list(task_cfg.rewards or {}):
        task_cfg.rewards[name] = absolute_reference(str(task_cfg.rewards[name]), base)
    rm_path = task_cfg.reward_model.path
    if rm_path and (str(rm_path).startswith((".", "~")) or (base / str(rm_path)).is_dir()):
        task_cfg.reward_model.path = str(resolve_file(str(rm_path), base))


def code_hashes(task_cfg: Any) -> dict[str, dict[str, str]]:
    """run_info.json's record of the user's code: {config key: {"file", "sha256"}} of every reward function's and
    the generator's file, so a rerun can tell they changed."""
    base_dir = base_dir_of(task_cfg)
    references = {f"task.rewards.{name}": ref for name, ref in (task_cfg.rewards or {}).items()}
    if task_cfg.generator:
        references["task.generator"] = task_cfg.generator
    out = {}
    for key, reference in references.items():
        found = file_sha256(str(reference), base_dir)
        if found is not None:
            out[key] = {"file": found[0], "sha256": found[1]}
    return out


def _not_configured(*_: Any, **__: Any) -> Any:
    raise RuntimeError("task=custom is built from its config: use grpo_cli.tasks.task_for(task_cfg)")


CUSTOM_TASK = TaskSpec(
    name="custom",
    reward_fn=_not_configured,
    build=_not_configured,
    prompt_styles=PROMPT_STYLES,
    schema=CustomTaskConfig,
    from_config=build_custom_task,
)
