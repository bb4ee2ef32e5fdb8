"""task=custom: a task made of config and the user's own code, with no change to the package (docs/custom-tasks.md).

    data      task.train_path / task.eval_path (.jsonl, .csv, .parquet, a dataset directory), task.dataset with
              task.split / task.eval_split (a `datasets` hub id or directory), or task.generator
              (`file.py:function` called with (n, seed)); any column names (task.rename_columns renames them)
    prompt    conversational data (TRL's format: a `prompt` column holding [{"role", "content"}, ...]) is the
              conversation itself, rendered with the model's chat template; text data goes through
              task.template over the row's columns ("Rewrite this review to be negative: {review}"),
              task.system_prompt, and the prompt styles of every task (task.prompt: chat, question_only, r1_zero)
    rewards   task.rewards.<name>=path/to/file.py:function or package.module:function, or a node
              {_target_: factory, <arguments>} (user_code.load_reward_spec), and/or a sequence-classification
              model (task.reward_model.*), summed with task.reward_weights (a name without a weight counts 1)
              and each logged as train/reward/<name> and eval/reward/<name>

How a reward function is called (task.reward_convention):
    trl         TRL 1.16's convention, the default, so a function written for TRL's GRPOTrainer runs unchanged:
                fn(prompts=, completions=, completion_ids=, trainer_state=, log_extra=, log_metric=,
                <each other column>=) -> one float or None per sample, once per batch. prompts are the
                conversations of conversational data and the prompt texts otherwise; completions follow TRL's
                rule (task.completion_format=auto): [{"role": "assistant", "content": text}] each when the data
                is conversational, the text otherwise. completion_ids are the sampled token ids. A function
                without **kwargs gets only the arguments it names.
    per_sample  fn(response, row) -> float or None, once per sample; row holds every column, "prompt" and the
                same extras (completion_ids: this sample's, trainer_state, log_extra(column, value),
                log_metric(name, value)).
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
import logging
import math
import numbers
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, cast

from grpo_cli.config.fields import any_value, choice, path, positive
from grpo_cli.errors import UserFacingError
from grpo_cli.tasks.base import (
    PROMPT_STYLES,
    R1_ZERO_TEMPLATE,
    Example,
    GroundTruth,
    Prompt,
    Row,
    SanityCase,
    TaskDataError,
    TaskSpec,
)
from grpo_cli.tasks.multiturn_config import ENV_COMPONENT, env_weight, environment_spec
from grpo_cli.tasks.reward_workers import InProcessCall, PendingCall, RewardWorkers, describe_error
from grpo_cli.tasks.rewards import SHAPING_COMPONENTS, Shaping, overlong_penalty, repetition_penalty
from grpo_cli.tasks.schema import TaskConfig
from grpo_cli.tasks.sources import check_json_values, dataset_rows, file_rows, generated_rows
from grpo_cli.tasks.timelimit import RewardTimeout
from grpo_cli.tasks.user_code import (
    RewardSpec,
    UserCodeError,
    absolute_reference,
    check_signature,
    file_sha256,
    is_file_reference,
    load_reward_spec,
    named_specs,
    resolve_file,
    spec_reference,
    spec_text,
    with_absolute_reference,
)

REWARD_CONVENTIONS = ("trl", "per_sample")
# What completions= holds: auto is TRL's rule (messages exactly when the data is conversational).
COMPLETION_FORMATS = ("auto", "text", "messages")
# Roles a conversational prompt's messages may have.
MESSAGE_ROLES = ("system", "user", "assistant", "tool")
# What the reward model reads: the response alone (a sentiment classifier), or the prompt text and the response
# (a preference reward model, as TRL feeds one).
REWARD_MODEL_INPUTS = ("response", "prompt_and_response")
# TRL 1.16 passes these itself (GRPOTrainer._calculate_rewards); a column with one of these names is not passed.
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
# Columns TRL never passes as columns: the prompt is `prompts`, and these two are its own.
NOT_COLUMNS = ("prompt", "completion", "completion_ids")


@dataclass
class RewardModelConfig:
    """task.reward_model: a Hugging Face sequence-classification model as a reward (null path: none)."""

    path: str | None = any_value(
        None, help="A local model directory or a hub id (read offline from the cache when HF_HUB_OFFLINE=1)."
    )
    label: str | None = any_value(
        None,
        help="The label whose probability (softmax over the labels) is the reward, e.g. NEGATIVE; null: the raw "
        "score of a one-logit head (a reward model).",
    )
    name: str = any_value(
        "reward_model",
        help="The name it is weighted and logged under: task.reward_weights.<name>, train/reward/<name>.",
    )
    input: str = choice(
        "response",
        REWARD_MODEL_INPUTS,
        help="What it reads: the response alone, or the prompt text followed by the response.",
    )
    batch_size: int = positive(
        32,
        help="Responses per forward pass (on the policy's device, no grad, each truncated to the model's max length).",
    )
    dtype: str = choice(
        "auto", ("auto", "float32", "bfloat16"), help="auto: bfloat16 on a CUDA GPU that has it, float32 otherwise."
    )


@dataclass
class CustomTaskConfig(TaskConfig):
    """task=custom: data, prompt and rewards from the config and the user's own code (docs/custom-tasks.md)."""

    # Dicts of the user's own names, open to new keys on the command line without + (config/registry.py).
    OPEN_KEYS: ClassVar[tuple[str, ...]] = ("rewards", "reward_weights", "tools")

    train_path: str | None = any_value(
        None,
        help="Local data, one file or folder per split: .jsonl, .csv, .parquet, or a `datasets` directory. Relative "
        "paths start where grpo-run was run (made absolute before the run starts). First of: path, generator, "
        "dataset.",
    )
    eval_path: str | None = any_value(
        None,
        help="Local held-out data, as task.train_path. Each split takes the first of: its path, task.generator, "
        "task.dataset.",
    )
    dataset: str | None = any_value(
        None, help="A `datasets` hub id or local dataset directory, read at task.split (training) and task.eval_split."
    )
    dataset_config: str | None = any_value(None, help="task.dataset's configuration (subset) name; null: its default.")
    split: str = any_value("train", help="task.dataset's split of training rows.")
    eval_split: str = any_value("test", help="task.dataset's split of held-out rows.")
    generator: str | None = any_value(
        None,
        help="Your generator, path/to/file.py:function or package.module:function, called as fn(n, seed) -> list of "
        "dicts: (task.n_train, task.data_seed) for training and (task.n_eval, task.data_seed + 1) for evaluation.",
    )
    rename_columns: dict[str, str] = any_value(
        factory=dict, help='Columns renamed before anything reads them: {"Ground Truth Answer": references}.'
    )
    template: str = any_value(
        "{prompt}",
        help="Text data's prompt, a Python format string over the row's columns: \"Rewrite this review to be "
        'negative: {review}". Conversational data (a `prompt` column of {role, content} messages) is its own '
        "prompt.",
    )
    system_prompt: str | None = any_value(
        None,
        help="Text data: sent before the prompt, a system message under task.prompt=chat, the first paragraph "
        "otherwise.",
    )
    rewards: dict[str, Any] = any_value(
        factory=dict,
        help="Your reward functions by name: path/to/file.py:function, package.module:function, or a node Hydra "
        "instantiates once per process ({_target_: trl.rewards.get_soft_overlong_punishment, max_completion_len: "
        "48, soft_punish_cache: 8}; _partial_: true binds arguments to a function). task.rewards.<name>=... adds "
        "one on the command line (no + needed: this node is open, as is reward_weights).",
    )
    reward_convention: str = choice(
        "trl",
        REWARD_CONVENTIONS,
        help="trl: fn(prompts=, completions=, completion_ids=, trainer_state=, log_extra=, log_metric=, **columns) "
        "-> list of float|None per batch (TRL 1.16's GRPOTrainer convention); per_sample: fn(response, row) -> "
        "float|None.",
    )
    completion_format: str = choice(
        "auto",
        COMPLETION_FORMATS,
        help='What a trl-convention function gets as completions=: auto is TRL\'s rule ([{"role": "assistant", '
        '"content": text}] each when the data is conversational, the text otherwise), text or messages force one.',
    )
    # The user's reward names instead of the built-in tasks' fixed RewardWeightsConfig: a narrower field than
    # TaskConfig.reward_weights declares, which mypy reports as an incompatible override (it is one on purpose).
    reward_weights: dict[str, float] = any_value(
        factory=dict,
        help="Weight of each reward by name (task.rewards' names, task.reward_model.name, the shaping terms "
        "overlong and repetition, and env with task.environment); a reward without a weight counts 1, a shaping "
        "term 0.",
    )  # type: ignore[assignment]
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    answer_from: str | None = any_value(
        None,
        help="The reward logged as answer_reward, whose value >= 1 marks an answer correct (eval/mean@n, pass@k, "
        "maj@n): a name of task.rewards, or env (the environment's summed step rewards). null: env when the "
        "environment's reward is the only weighted one (shaping terms aside), else the weighted total.",
    )
    format_from: str | None = any_value(None, help="The reward logged as format_reward; null: the weighted total.")
    cases_path: str | None = path(
        None,
        "file",
        help='job=check_reward\'s cases: a JSONL file, {"response": ..., "expected": ..., <the row\'s columns>} '
        'per line; with task.tools or task.environment, {"turns": [<the model\'s turns>], "expected": ...} runs them '
        "for real between the turns.",
    )
    base_dir: str | None = path(
        None,
        "dir",
        help="Where relative paths and package.module references are found; null: the directory grpo-run was "
        "started from (written into the run's config, so every rank, actor and sweep job finds the same files).",
    )


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


def render_prompt(task_cfg: CustomTaskConfig, row: Row) -> Prompt:
    """The prompt of one text row as the model is given it: under task.prompt=chat a system message (when set)
    and the template over the row's columns as the user message; otherwise `prompt_text`."""
    if task_cfg.prompt == "chat":
        system = task_cfg.system_prompt
        user = {"role": "user", "content": task_cfg.template.format_map(row)}
        return ([{"role": "system", "content": system}] if system else []) + [user]
    return prompt_text(task_cfg, row)


def prompt_text(task_cfg: CustomTaskConfig, row: Row) -> str:
    """The prompt of one text row as text, what TRL passes as prompts= for a standard dataset: the system prompt
    (when set) as the first paragraph, then the template over the row's columns (wrapped in the R1 template under
    r1_zero). Under question_only and r1_zero it is exactly what the model is fed; under chat, the text of its
    messages."""
    text = task_cfg.template.format_map(row)
    if task_cfg.prompt == "r1_zero":
        text = R1_ZERO_TEMPLATE.format(question=text)
    system = task_cfg.system_prompt
    return f"{system}\n\n{text}" if system else text


def is_conversation(value: Any) -> bool:
    """TRL's test for conversational data (trl.data_utils.is_conversational): a list whose first item is a dict
    with a "role"."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def _message_problem(messages: list[Any]) -> str | None:
    """Why a conversation cannot be rendered (None: it can): each message {"role": one of MESSAGE_ROLES,
    "content": text}."""
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role not in MESSAGE_ROLES or not isinstance(content, str):
            shown = json.dumps(message, default=repr, ensure_ascii=False)
            shown = shown if len(shown) <= 100 else shown[:97] + "..."
            return (
                f'message {index} is {shown}: each message is {{"role": {" | ".join(MESSAGE_ROLES)}, "content": text}}'
            )
    return None


def is_conversational_data(task_cfg: CustomTaskConfig, rows: list[Row], where: str) -> bool:
    """Whether the rows are conversational (TRL's format: a `prompt` column of {role, content} messages), checked:
    every row of one kind, every message renderable, and neither task.template nor task.system_prompt nor a text
    prompt style set for a conversation (one line naming the row or the key)."""
    kinds = [is_conversation(row.get("prompt")) for row in rows]
    if not any(kinds):
        for index, row in enumerate(rows):
            value = row.get("prompt")
            if isinstance(value, list) and (not value or isinstance(value[0], dict)):
                raise TaskDataError(
                    f"{where} row {index}: column 'prompt' is a list of {len(value)} items but not chat messages "
                    f"({_message_problem(value) or 'it is empty'}): give text, or a conversation "
                    '[{"role": "user", "content": ...}]'
                )
        return False
    if not all(kinds):
        other = kinds.index(False)
        raise TaskDataError(
            f"{where}: row {kinds.index(True)}'s prompt is a conversation and row {other}'s is "
            f"{type(rows[other].get('prompt')).__name__}: give every row the same kind of prompt"
        )
    for index, row in enumerate(rows):
        problem = _message_problem(row["prompt"])
        if problem is not None:
            raise TaskDataError(f"{where} row {index}: prompt {problem}")
    default = CustomTaskConfig()
    if task_cfg.template != default.template:
        raise UserFacingError(
            f"task.template={task_cfg.template!r} applies to text prompts, but {where} holds conversations "
            "(a prompt column of chat messages, rendered with the model's chat template as they are): drop "
            "task.template, or put the text into the messages"
        )
    if task_cfg.system_prompt:
        raise UserFacingError(
            f"task.system_prompt applies to text prompts, but {where} holds conversations (rendered as they are): "
            'drop task.system_prompt, or start each conversation with {"role": "system", "content": ...}'
        )
    if task_cfg.prompt != "chat":
        raise UserFacingError(
            f"task.prompt={task_cfg.prompt} is a text prompt style, but {where} holds conversations, which the "
            "model's chat template renders: use task.prompt=chat (the default)"
        )
    return True


def renamed(task_cfg: CustomTaskConfig, row: Row) -> dict[str, Any]:
    mapping = dict(task_cfg.rename_columns or {})
    return {mapping.get(key, key): value for key, value in row.items()}


def check_template(task_cfg: CustomTaskConfig, rows: list[Row], where: str) -> None:
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


def truth_of(row: Row, prompt: Prompt) -> dict[str, Any]:
    """A custom task's ground truth: the row's columns and the prompt as TRL passes it (what a reward reads)."""
    return {**row, "prompt": prompt}


def examples_of(task_cfg: CustomTaskConfig, rows: list[Row], where: str) -> list[Example]:
    """Renamed rows as examples: a conversation is the model's prompt and TRL's prompts= alike; a text row's
    template is checked, rendered in the prompt style for the model, and as text for prompts=."""
    if is_conversational_data(task_cfg, rows, where):
        return [Example([dict(m) for m in row["prompt"]], truth_of(row, row["prompt"])) for row in rows]
    check_template(task_cfg, rows, where)
    return [Example(render_prompt(task_cfg, row), truth_of(row, prompt_text(task_cfg, row))) for row in rows]


def split_rows(task_cfg: CustomTaskConfig, split: str) -> tuple[list[dict[str, Any]], str]:
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


def build_examples(task_cfg: CustomTaskConfig, rewards: list[NamedReward], split: str) -> list[Example]:
    """The examples of one split: rows renamed, checked against the template (text data) or as conversations, and
    against the reward signatures."""
    rows, where = split_rows(task_cfg, split)
    rows = [renamed(task_cfg, row) for row in rows]
    examples = examples_of(task_cfg, rows, where)
    check_json_values(where, rows)
    for reward in rewards:
        reward.check_columns(rows[0], where)
    return examples


# ------------------------------------------------------------------------------------------------ rewards


def _row_text(truth: GroundTruth, limit: int = 160) -> str:
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


@dataclass(frozen=True)
class TrainerState:
    """What a reward function gets as trainer_state= (TRL passes transformers' TrainerState): how far the run is,
    for rewards that change over training. Plain data, so it pickles to a worker process."""

    # Updates made before the weights that sampled these completions (TRL's state.global_step while it scores).
    global_step: int = 0
    # train.steps.
    max_steps: int = 0
    # Passes over the training prompts drawn so far, fractional (TRL's state.epoch).
    epoch: float = 0.0


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
            elif value is None or _value_problem(value) is not None:
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


def _user_reward(name: str, spec: RewardSpec, convention: str, base_dir: Path) -> NamedReward:
    key = f"task.rewards.{name}"
    shown = f"{key}={spec_text(spec)}"
    fn = load_reward_spec(key, spec, base_dir)
    # A worker process loads the same spec itself: plain data (reward_specs), so the partial pickles.
    loader = functools.partial(load_reward_spec, key, spec, base_dir)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return NamedReward(name, shown, fn, convention, spec=spec, base_dir=str(base_dir), loader=loader)
    any_keyword = any(p.kind is p.VAR_KEYWORD for p in params)
    names = tuple(p.name for p in params)
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


@dataclass
class BatchScores:
    rewards: list[dict[str, float]]
    n_errors: int
    n_timeouts: int
    # log_extra's columns (one value per sample, None where none was logged) and log_metric's values.
    extra: dict[str, list[Any]] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=dict)
    # The samples whose correctness cannot be derived (task.answer_from's reward gave None), with the reason.
    no_correctness: dict[int, str] = field(default_factory=dict)


logger = logging.getLogger(__name__)
_WARNED_NONE: set[str] = set()  # the functions warned about (once each per process)


def warn_if_no_reward(key: str, values: Sequence[float | None]) -> None:
    """One warning line, once per function, when it returned None for every completion of a batch: no sample got a
    reward from it (TRL's convention for rows it does not apply to, and TRL warns too; a function that forgot its
    `return` reads the same)."""
    if values and all(v is None for v in values) and key not in _WARNED_NONE:
        _WARNED_NONE.add(key)
        logger.warning(
            "reward %s returned None for all %d completions of a batch, so none got a reward from it (None: the "
            "function does not apply to that row): if it should score them, check that it returns a number",
            key,
            len(values),
        )


@dataclass
class CustomReward:
    """The reward of a custom task: every named reward on a batch, combined with the weights (None: no reward from
    that function for that sample). The scorer calls `score_batch` (rollout/scoring.py); calling it on one
    response (check_reward) scores a batch of one."""

    rewards: list[NamedReward]
    weights: dict[str, float]
    time_limit_s: float | None
    on_error: str
    completion_format: str = "auto"
    answer_from: str | None = None
    format_from: str | None = None
    shaping: Shaping = Shaping()
    model_factory: Callable[[str | None], Any] | None = None
    device: str | None = None
    workers: int = 0  # task.reward_workers (0: the functions run in this process)
    # task.reward_weights.env when the task has an environment (its summed step rewards are the component `env`,
    # given to score_batch as env_rewards); None: no environment.
    env_weight: float | None = None
    _model: Any = field(default=None, repr=False)
    _pool: RewardWorkers | None = field(default=None, repr=False)

    @property
    def uses_n_tokens(self) -> bool:
        return self.weights.get("overlong", 0.0) != 0.0

    @property
    def answer_source(self) -> str | None:
        """The reward whose value marks a sample correct (answer_reward, correctness): task.answer_from, else `env`
        when the environment's reward is the only weighted component, else None (the weighted total)."""
        if self.answer_from is not None:
            return self.answer_from
        if self.env_weight and not any(w for name, w in self.weights.items() if name not in SHAPING_COMPONENTS):
            return ENV_COMPONENT
        return None

    def for_run(self, max_tokens: int | None, device: str | None) -> CustomReward:
        """This reward with the run's generation limit (the overlong term) and the device of its reward model."""
        return dataclasses.replace(
            self, shaping=dataclasses.replace(self.shaping, max_tokens=max_tokens), device=device
        )

    def __call__(
        self,
        response: str,
        ground_truth: GroundTruth,
        n_tokens: int | None = None,
        completion_ids: list[int] | None = None,
        trainer_state: TrainerState | None = None,
    ) -> dict[str, float]:
        ids = None if completion_ids is None else [completion_ids]
        return self.score_batch([response], [ground_truth], [n_tokens], ids, trainer_state).rewards[0]

    def close(self) -> None:
        """Stop the worker processes (a later call starts new ones)."""
        if self._pool is not None:
            self._pool.close()

    # --- one batch --------------------------------------------------------------------------------------
    def score_batch(
        self,
        responses: Sequence[str],
        truths: Sequence[GroundTruth],
        n_tokens: Sequence[int | None] | None = None,
        completion_ids: Sequence[list[Any]] | None = None,
        trainer_state: TrainerState | None = None,
        completions: Sequence[Any] | None = None,
        prompts: Sequence[Any] | None = None,
        env_rewards: Sequence[float | None] | None = None,
    ) -> BatchScores:
        """Every reward on the batch. `completion_ids` are the sampled token ids of each completion (what TRL's
        completion_ids= holds; their lengths stand in for `n_tokens` when it is not given). `completions`, when
        given, is what the functions get as the completions instead of the responses (a multi-turn episode's
        messages after the prompt, rollout/multiturn.py: trl's completions= and per_sample's response; its
        completion_ids are then the model's sampled ids per turn, and `responses` its last turn's text, which the
        repetition term reads). `prompts`, when given, is trl's prompts= instead of the rows' prompts (an episode's
        opening messages, what its environment's reset gave the model). `env_rewards` (a task with an environment:
        each episode's summed step rewards, None where it gave none) are the component `env`, weighted by
        `env_weight`.

        Each sample's answer_reward and correctness are `answer_source`'s value (the weighted total, env included,
        when it is None); a sample where that reward gave None has no correctness, said in `no_correctness`."""
        n = len(responses)
        ids = [list(c) for c in completion_ids] if completion_ids is not None else None
        if n_tokens is not None:
            lengths = list(n_tokens)
        else:
            lengths = [len(c) for c in ids] if ids is not None else [None] * n
        given = list(completions) if completions is not None else None
        batch = _Batch(list(responses), list(truths), ids, trainer_state or TrainerState(), RewardLog(n), given)
        batch.prompts = list(prompts) if prompts is not None else None
        counts = {"errors": 0, "timeouts": 0}
        values: dict[str, list[float | None]] = {}
        # Every function's calls first, then their results: with workers, the calls run in parallel.
        calls = {reward.name: self._start_batch(reward, batch) for reward in self.rewards}
        for reward in self.rewards:
            failed = counts["errors"] + counts["timeouts"]
            values[reward.name] = self._values(reward, batch, counts, calls[reward.name])
            if n > 1 and counts["errors"] + counts["timeouts"] == failed:
                warn_if_no_reward(reward.key, values[reward.name])
        if self.weights.get("overlong"):
            known = [length for length in lengths if length is not None]
            if self.shaping.max_tokens is None or len(known) != len(lengths):
                raise ValueError("the overlong reward term needs rollout.max_tokens and each completion's token count")
            window = self.shaping.overlong_window()
            values["overlong"] = [overlong_penalty(k, *window) for k in known]
        if self.weights.get("repetition"):
            values["repetition"] = [repetition_penalty(r, self.shaping.repetition_ngram) for r in responses]
        weights = dict(self.weights)
        if self.env_weight is not None and env_rewards is not None:
            values[ENV_COMPONENT] = list(env_rewards)
            weights[ENV_COMPONENT] = self.env_weight
        source, out, no_correctness = self.answer_source, [], {}
        for i in range(n):
            sample = {name: column[i] for name, column in values.items()}
            total = sum(weights.get(name, 0.0) * v for name, v in sample.items() if v is not None)
            answer = total if source is None else sample.get(source)
            fmt = total if self.format_from is None else (sample.get(self.format_from) or 0.0)
            result = {"reward": total, "format_reward": fmt, "answer_reward": answer or 0.0}
            if answer is None:  # never a silent 0: this sample's correctness is unknown
                no_correctness[i] = _no_answer(source)
            else:
                result["correctness"] = answer
            result.update({f"reward/{name}": v for name, v in sample.items() if v is not None})
            out.append(result)
        return BatchScores(
            out, counts["errors"], counts["timeouts"], batch.log.extra, batch.log.metrics, no_correctness
        )

    def completions_of(self, responses: list[str], prompts: list[Any]) -> list[Any]:
        """completions= of a TRL-convention call: TRL's rule under task.completion_format=auto (messages exactly
        when the prompts are conversations: GRPOTrainer checks the batch's first prompt), or the forced format."""
        as_messages = self.completion_format == "messages" or (
            self.completion_format == "auto" and bool(prompts) and is_conversation(prompts[0])
        )
        return [[{"role": "assistant", "content": r}] for r in responses] if as_messages else list(responses)

    def _start_batch(self, reward: NamedReward, batch: _Batch) -> Any:
        """The calls of one function on the batch, started: one per row (per_sample) or one (trl)."""
        rows = list(range(len(batch.responses)))
        if reward.convention == "model":
            return None
        if reward.convention == "per_sample":
            return [self._start(reward, self._per_sample_payload(reward, batch, i), batch, [i]) for i in rows]
        return self._start(reward, self._trl_payload(reward, batch, rows), batch, rows)

    def _values(self, reward: NamedReward, batch: _Batch, counts: dict[str, int], calls: Any) -> list[float | None]:
        if reward.convention == "model":
            return self._model_values(reward, batch.responses, batch.truths)
        if reward.convention == "per_sample":
            return [self._one(reward, batch, i, counts, c) for i, c in enumerate(calls)]
        return self._trl_batch(reward, batch, list(range(len(batch.responses))), counts, calls)

    def _fail(self, reward: NamedReward, what: str, truth: GroundTruth, where: str = "on row") -> None:
        """Stop: one line naming the function, the row and what it did."""
        raise RewardFunctionError(
            f"reward {reward.key} {what} {where} {_row_text(truth)}: fix it, or set task.on_reward_error=skip to "
            "give such samples no reward from it"
        )

    def _start(self, reward: NamedReward, payload: Any, batch: _Batch, rows: list[int]) -> _StartedCall:
        """One call of a user's function on the batch's samples `rows`, started: in a worker process, or
        (task.reward_workers=0) in this one when its result is read. Its log_extra and log_metric log into a
        RewardLog of its own: a worker's recorded calls are replayed into it when the result is read."""
        call_log = RewardLog(batch.log.n)
        args, kwargs = reward.call_arguments(payload, call_log.loggers(rows))
        if not self.workers or reward.loader is None:
            call: PendingCall | InProcessCall = InProcessCall(reward.fn, args, kwargs, self.time_limit_s)
        else:
            if self._pool is None:
                self._pool = RewardWorkers(self.workers, self.time_limit_s)
            callbacks = reward.logging_callbacks(args, kwargs)
            call = self._pool.submit(reward.loader, args, kwargs, callbacks, label=reward.key)
        return _StartedCall(call, call_log)

    def _result(self, reward: NamedReward, started: _StartedCall, batch: _Batch, rows: list[int]) -> Any:
        """A started call's return value; what it logged is kept only when it returns."""
        out = started.call.result()
        if started.log.problems:
            raise RewardFunctionError(
                f"reward {reward.key} {started.log.problems[0]} on row {_row_text(batch.truths[rows[0]])}: fix it"
            )
        batch.log.merge(started.log)
        return out

    def _per_sample_payload(self, reward: NamedReward, batch: _Batch, i: int) -> tuple[Any, dict[str, Any]]:
        ids = batch.completion_ids[i] if batch.completion_ids is not None else None
        response = batch.completions[i] if batch.completions is not None else batch.responses[i]
        return response, reward.per_sample_row(batch.truths[i], ids, batch.trainer_state)

    def _trl_payload(self, reward: NamedReward, batch: _Batch, rows: list[int]) -> dict[str, Any]:
        responses = [batch.responses[i] for i in rows]
        truths = [batch.truths[i] for i in rows]
        if batch.prompts is not None:  # an episode's opening messages
            prompts = [batch.prompts[i] for i in rows]
        else:
            prompts = [t.get("prompt") if isinstance(t, dict) else None for t in truths]
        ids = [batch.completion_ids[i] for i in rows] if batch.completion_ids is not None else None
        if batch.completions is not None:  # an episode's messages: always messages
            completions = [batch.completions[i] for i in rows]
        else:
            completions = self.completions_of(responses, prompts)
        return reward.trl_kwargs(prompts, completions, ids, batch.trainer_state, truths)

    def _one(
        self, reward: NamedReward, batch: _Batch, i: int, counts: dict[str, int], started: _StartedCall | None = None
    ) -> float | None:
        """per_sample: fn(response, row)."""
        truth = batch.truths[i]
        try:
            started = started or self._start(reward, self._per_sample_payload(reward, batch, i), batch, [i])
            value = self._result(reward, started, batch, [i])
        except RewardTimeout:
            if self.on_error == "stop":
                self._fail(reward, f"ran past task.reward_timeout_s={self.time_limit_s:g}s", truth)
            counts["timeouts"] += 1
            return None
        except RewardFunctionError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's code: stop with one line, or skip the sample
            if self.on_error == "stop":
                self._fail(reward, describe_error(e), truth)
            counts["errors"] += 1
            return None
        return self._checked(reward, value, truth, counts)

    def _checked(self, reward: NamedReward, value: Any, truth: GroundTruth, counts: dict[str, int]) -> float | None:
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

    def _trl_batch(
        self,
        reward: NamedReward,
        batch: _Batch,
        rows: list[int],
        counts: dict[str, int],
        started: _StartedCall | None = None,
    ) -> list[float | None]:
        truths = [batch.truths[i] for i in rows]
        n = len(rows)
        try:
            started = started or self._start(reward, self._trl_payload(reward, batch, rows), batch, rows)
            out = self._result(reward, started, batch, rows)
        except RewardTimeout:
            if self.on_error == "stop":
                self._fail(
                    reward, f"ran past task.reward_timeout_s={self.time_limit_s:g}s on a batch of {n}", truths[0]
                )
            counts["timeouts"] += n
            return [None] * n
        except RewardFunctionError:
            raise
        except Exception as e:  # noqa: BLE001 - find the row(s) it fails on, one sample at a time
            error = describe_error(e)
            if n == 1:
                if self.on_error == "stop":
                    self._fail(reward, error, truths[0])
                counts["errors"] += 1
                return [None]
            # Alone, each row either scores (skip keeps it) or fails (stop names that row; skip drops it).
            singles = [self._trl_batch(reward, batch, [i], counts)[0] for i in rows]
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

    def _model_values(self, reward: NamedReward, responses: list[str], truths: list[GroundTruth]) -> list[float | None]:
        if self._model is None:
            self._model = reward.fn(self.device)  # the scorer, loaded on first use on this run's device
        return [float(v) for v in self._model(responses, truths)]


def _no_answer(source: str | None) -> str:
    """Why a sample has no correctness: the reward that decides it (`CustomReward.answer_source`) gave none."""
    if source == ENV_COMPONENT:
        return "the environment gave no reward in the episode (task.answer_from=env: its summed step rewards)"
    return f"task.answer_from={source} gave no value (None) for the sample"


@dataclass
class _StartedCall:
    """One call of a user's function, started, and the log its log_extra and log_metric write to."""

    call: PendingCall | InProcessCall
    log: RewardLog


@dataclass
class _Batch:
    """One scored batch: what every reward reads, and what they log."""

    responses: list[str]
    truths: list[GroundTruth]
    completion_ids: list[list[Any]] | None
    trainer_state: TrainerState
    log: RewardLog
    completions: list[Any] | None = None  # given instead of the responses (episodes' messages)
    prompts: list[Any] | None = None  # given instead of the rows' prompts (episodes' opening messages)


# ------------------------------------------------------------------------------------------------ the task


def base_dir_of(task_cfg: CustomTaskConfig) -> Path:
    """Where relative paths and modules are found: task.base_dir, else this process's working directory."""
    base_dir = task_cfg.base_dir
    return Path(base_dir) if base_dir else Path.cwd()


def weights_of(task_cfg: CustomTaskConfig, names: list[str]) -> dict[str, float]:
    """{name: weight} for every reward (1 unless given) and each weighted shaping term; one line for a weight
    naming nothing."""
    given = {str(k): v for k, v in dict(task_cfg.reward_weights or {}).items()}
    allowed = [*names, *SHAPING_COMPONENTS]
    with_environment = environment_spec(task_cfg) is not None
    if with_environment:  # the environment's step rewards: multiturn_config.env_weight reads its weight
        allowed.append(ENV_COMPONENT)
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
    if with_environment and float(given.get(ENV_COMPONENT, 1.0)):
        return weights  # the environment's reward may be the only one
    if not any(weights.values()):
        raise UserFacingError(f"every task.reward_weights is 0: give one of {', '.join(names)} a weight")
    return weights


def _reward_model(task_cfg: CustomTaskConfig) -> NamedReward | None:
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


# Keys of a case line that are not columns of the row.
CASE_KEYS = ("response", "turns", "expected", "why", "completion_ids")


def read_cases(task_cfg: CustomTaskConfig, names: Sequence[str] = ()) -> tuple[SanityCase, ...]:
    """task.cases_path: {"response", "expected", <columns>} per line -> sanity cases (job=check_reward). "expected"
    is the weighted total (a number), or {reward name: value} for each reward it names (null: that reward gives
    this sample none); `names` are the rewards a case may name. "completion_ids" (optional) are the response's
    token ids, for rewards that read them."""
    if not task_cfg.cases_path:
        return ()
    rows = file_rows("task.cases_path", task_cfg.cases_path, None)
    cases = []
    for line, row in enumerate(rows, start=1):
        where = f"{task_cfg.cases_path}:{line}"
        turns = row.get("turns")
        if turns is not None and (
            not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns)
        ):
            raise TaskDataError(
                f'{where}: "turns" must be a non-empty list of the model\'s turns (strings), got {turns!r:.60}'
            )
        if ("response" not in row and turns is None) or "expected" not in row:
            raise TaskDataError(
                f'{where}: each case needs "response" (or "turns", a multi-turn episode\'s model turns) and '
                '"expected" (and the columns the prompt reads)'
            )
        columns = renamed(task_cfg, {k: v for k, v in row.items() if k not in CASE_KEYS})
        example = examples_of(task_cfg, [columns], where)[0]
        total, each = _expected_of(row["expected"], where, names)
        ids = row.get("completion_ids")
        if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, int) for i in ids)):
            raise TaskDataError(f'{where}: "completion_ids" must be a list of token ids (integers), got {ids!r:.60}')
        why = str(row.get("why", where))
        cases.append(
            SanityCase(
                example.ground_truth,
                str(turns[-1] if turns is not None else row["response"]),
                total,
                why,
                expected_each=each,
                completion_ids=tuple(ids) if ids is not None else None,
                turns=tuple(turns) if turns is not None else None,
                prompt=example.prompt if turns is not None else None,
            )
        )
    return tuple(cases)


def _expected_of(
    expected: Any, where: str, names: Sequence[str]
) -> tuple[float | None, dict[str, float | None] | None]:
    """(the weighted total, {reward: value}) a case expects: a number is the total, a dict each named reward."""
    if isinstance(expected, dict):
        if not expected:
            raise TaskDataError(f'{where}: "expected" names no reward: give {{"<name>": value, ...}} or a number')
        each: dict[str, float | None] = {}
        for name, value in expected.items():
            if names and name not in names:
                raise TaskDataError(
                    f'{where}: "expected" names {name!r}, which is no reward of this task: use {", ".join(names)}'
                )
            if value is not None and _value_problem(value) is not None:
                raise TaskDataError(f'{where}: "expected" of {name!r} must be a number or null, got {value!r}')
            each[str(name)] = None if value is None else float(value)
        return None, each
    if expected is None or _value_problem(expected) is not None:
        raise TaskDataError(
            f'{where}: "expected" must be a number (the weighted total) or {{"<reward name>": value, ...}}, '
            f"got {expected!r}"
        )
    return float(expected), None


def reward_specs(task_cfg: CustomTaskConfig) -> dict[str, RewardSpec]:
    """task.rewards as plain data: {name: reference string or plain dict node} (one line for another value)."""
    return named_specs(task_cfg.rewards, "task.rewards")


def build_custom_task(config: TaskConfig) -> TaskSpec:
    """This run's TaskSpec: the user's rewards imported and checked, the data read on build (preflight), all before
    any model loads."""
    # TaskSpec.from_config takes any task config; this task's is CustomTaskConfig (its TaskSpec.schema), which
    # validate_task_config checks before anything builds.
    task_cfg = cast(CustomTaskConfig, config)
    base_dir = base_dir_of(task_cfg)
    specs = reward_specs(task_cfg)
    names = list(specs)
    for name in names:
        if name in SHAPING_COMPONENTS:  # its values and the shaping term's would share train/reward/<name>
            raise UserFacingError(
                f"task.rewards.{name}: {name} is the name of a shaping term (task.reward_weights.{name}): give this "
                "reward another name"
            )
    rewards = [_user_reward(name, spec, task_cfg.reward_convention, base_dir) for name, spec in specs.items()]
    model = _reward_model(task_cfg)
    if model is not None:
        if model.name in names:
            raise UserFacingError(f"task.reward_model.name={model.name} is also in task.rewards: give it another name")
        rewards.append(model)
    if not rewards and environment_spec(task_cfg) is None:
        raise UserFacingError(
            "task=custom has no reward: give task.rewards.<name>=path/to/file.py:function (or a node {_target_: "
            "package.module.factory, <its arguments>}) or task.reward_model.path=<classifier>"
        )
    all_names = [r.name for r in rewards]
    with_environment = environment_spec(task_cfg) is not None
    for key in ("answer_from", "format_from"):
        chosen = getattr(task_cfg, key)
        allowed = [*all_names, ENV_COMPONENT] if with_environment and key == "answer_from" else all_names
        if chosen is not None and chosen not in allowed:
            if chosen == ENV_COMPONENT:
                raise UserFacingError(
                    f"task.{key}=env without task.environment: env is the environment's reward; use "
                    f"{', '.join(all_names)}"
                )
            raise UserFacingError(f"task.{key}={chosen}: there is no reward named {chosen}: use {', '.join(allowed)}")
    template_columns(task_cfg.template)
    reward = CustomReward(
        rewards,
        weights_of(task_cfg, all_names),
        task_cfg.reward_timeout_s or None,
        task_cfg.on_reward_error,
        completion_format=task_cfg.completion_format,
        answer_from=task_cfg.answer_from,
        format_from=task_cfg.format_from,
        shaping=Shaping(None, task_cfg.overlong_buffer, task_cfg.repetition_ngram),
        workers=task_cfg.reward_workers,
        env_weight=env_weight(task_cfg) if with_environment else None,
    )

    def build(split: str, n: int | None = None, seed: int = 0, prompt_style: str = "chat", **_: Any) -> list[Example]:
        del n, seed, prompt_style  # read from task_cfg itself, like every other source of this task
        return build_examples(task_cfg, rewards, split)

    extra_names = [term for term in SHAPING_COMPONENTS if reward.weights.get(term)]
    if with_environment:
        extra_names.append(ENV_COMPONENT)
    cases = read_cases(task_cfg, [*all_names, *extra_names])
    return dataclasses.replace(CUSTOM_TASK, reward_fn=reward, build=build, sanity_cases=cases)


def absolutize_paths(task_cfg: CustomTaskConfig, base_dir: Path) -> None:
    """Make task=custom's relative paths absolute against `base_dir` (the directory grpo-run was started from) and
    record it as task.base_dir, in place, before the config is saved and sent to ranks, actors and sweep jobs."""
    if not getattr(task_cfg, "base_dir", None):
        task_cfg.base_dir = str(base_dir)
    base = base_dir_of(task_cfg)
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
    for name, spec in reward_specs(task_cfg).items():
        task_cfg.rewards[name] = with_absolute_reference(spec, base)
    rm_path = task_cfg.reward_model.path
    if rm_path and (str(rm_path).startswith((".", "~")) or (base / str(rm_path)).is_dir()):
        task_cfg.reward_model.path = str(resolve_file(str(rm_path), base))


def code_hashes(task_cfg: CustomTaskConfig) -> dict[str, dict[str, str]]:
    """run_info.json's record of the user's code: {config key: {"file", "sha256"}} of every reward function's and
    the generator's file, so a rerun can tell they changed."""
    base_dir = base_dir_of(task_cfg)
    references = {f"task.rewards.{name}": spec_reference(spec) for name, spec in reward_specs(task_cfg).items()}
    if task_cfg.generator:
        references["task.generator"] = task_cfg.generator
    out = {}
    for key, reference in references.items():
        if reference is None:
            continue
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
