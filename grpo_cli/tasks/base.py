"""What every task provides: examples (prompt + ground truth) and a reward function. No torch here."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_cli.errors import UserFacingError
from grpo_cli.tasks.schema import PROMPT_STYLES

if TYPE_CHECKING:
    from grpo_cli.tasks.schema import TaskConfig

# A prompt is either plain text (r1_zero / question_only templates, fed to the model as is) or a list of
# chat messages that the tokenizer's chat template renders (instruct models).
Prompt = str | list[dict[str, str]]
# Any, named once here: a data row's values and a ground truth are whatever the task's data holds (JSON, CSV,
# Parquet or a `datasets` row; a number, a string, a dict of columns), read by the task that knows their shape.
Row = dict[str, Any]
GroundTruth = Any
RewardFn = Callable[[str, GroundTruth], dict[str, float]]
# A named part of a composite reward (task.reward_weights): one number per (response, ground truth).
RewardComponent = Callable[[str, GroundTruth], float]

# Every reward function returns these; it may add "unparseable" (1.0: no answer could be extracted or read)
# and, when composed from weighted components, "reward/<component>" for each weighted one and "correctness"
# (the task's own reward, which decides whether an answer is right: eval/pass@k and maj@n read it).
REWARD_KEYS = ("reward", "format_reward", "answer_reward")
OPTIONAL_REWARD_KEYS = ("unparseable", "correctness")


class TaskDataError(UserFacingError):
    """A data file or hub dataset that cannot be read or parsed."""


class RowError(ValueError):
    """One data row lacks a field or holds a bad value; the loader prefixes the file and line."""


@dataclass(frozen=True)
class Example:
    prompt: Prompt
    ground_truth: GroundTruth
    # Free-form data kept in eval JSONL (e.g. the source question); never read by rewards.
    meta: dict[str, Any] = field(default_factory=dict)
    # Where the example was read ("task.eval_path=/data/eval.jsonl", "task.eval_sets.hard=hard.jsonl"), for the
    # one-line errors about it (tasks.load_examples sets it); "" where it was made otherwise.
    source: str = field(default="", compare=False)


@dataclass(frozen=True)
class SanityCase:
    """A hand-made response with the reward it must get: shown by check_reward, asserted by tests."""

    ground_truth: GroundTruth
    response: str
    expected_reward: float | None  # None: the case expects values of the named rewards only (expected_each)
    why: str
    # task=custom: {reward name: value} the case expects of each reward it names (None: no value from it).
    expected_each: dict[str, float | None] | None = None
    # task=custom: the response's token ids, for rewards that read completion_ids (None: check_reward tokenizes).
    completion_ids: tuple[int, ...] | None = None
    # A multi-turn task's case: the model's turns, in order (`response` is then the last one); job=check_reward
    # runs the task's tools or environment for real between them (rollout/multiturn.py).
    turns: tuple[str, ...] | None = None
    # A multi-turn case's prompt (the conversation its episode opens with, unless the environment's reset gives one).
    prompt: Prompt | None = None


def iter_jsonl_objects(path: str | Path) -> Iterator[tuple[int, Row]]:
    """(line number, object) of each non-blank line of a JSONL file; a line that is not a JSON object is one
    TaskDataError naming the file and the line. OSError and UnicodeDecodeError reach the caller, which names the
    key the path came from."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskDataError(f"{path}:{line_no}: not valid JSON ({e.msg}): fix or remove that line") from None
            if not isinstance(row, dict):
                raise TaskDataError(f"{path}:{line_no}: expected a JSON object per line, got {type(row).__name__}")
            yield line_no, row


def parse_question_row(row: Row) -> tuple[str, GroundTruth, dict[str, Any]]:
    """The generic data row: {"question": str, "ground_truth": ...} -> (question, ground truth, meta)."""
    for key in ("question", "ground_truth"):
        if key not in row:
            raise RowError(f'missing field {key!r} (each line needs "question" and "ground_truth")')
    return row["question"], row["ground_truth"], {"question": row["question"]}


@dataclass(frozen=True)
class TaskSpec:
    name: str
    # The reward for every prompt style not listed in reward_fns_by_prompt.
    reward_fn: RewardFn
    # build(split, n, seed, prompt_style, **options) -> list[Example]: synthetic data, or the hub download.
    build: Callable[..., list[Example]]
    # Hand-made responses with the reward they must get, for reward_fn (job=check_reward and the tests).
    sanity_cases: tuple[SanityCase, ...] = ()
    # Task-specific keys of the task config passed to build() as keyword arguments.
    options: tuple[str, ...] = ()
    # Reads one row of a local JSONL file (task.train_path / task.eval_path) or of the hub dataset.
    parse_row: Callable[[Row], tuple[str, GroundTruth, dict[str, Any]]] = parse_question_row
    # Prompt styles whose answers are graded differently (math: r1_zero's strict tags), with their cases.
    reward_fns_by_prompt: dict[str, RewardFn] = field(default_factory=dict)
    sanity_cases_by_prompt: dict[str, tuple[SanityCase, ...]] = field(default_factory=dict)
    # Extra named reward components for task.reward_weights: (prompt_style, reward options) -> {name: fn}.
    reward_components: Callable[..., dict[str, RewardComponent]] | None = None
    # Task-specific keys of the task config passed to reward_components() as keyword arguments.
    reward_options: tuple[str, ...] = ()
    # (question, prompt style) -> prompt, for local JSONL rows too; None: `format_prompt`. A task with its own
    # system prompt or template (addition) sets it so a data file gets the same prompts as the built-in data.
    prompt_format: Callable[[str, str], Prompt] | None = None
    # The prompt styles the task's prompts and reward work under (validate_task_config rejects the others).
    prompt_styles: tuple[str, ...] = PROMPT_STYLES
    # Majority voting (eval/maj@n, docs/evaluation.md): (response, prompt style) -> the answer the reward grades
    # (None: the response has none, and does not vote), and whether two such answers are the same. None: the
    # task has no separate answer and the normalized response text votes, equal strings agreeing.
    extract_answer: Callable[[str, str], str | None] | None = None
    same_answer: Callable[[str, str], bool] | None = None
    # The task's config schema (a dataclass extending grpo_cli.tasks.schema.TaskConfig, next to the task), whose
    # keys hold `options` and `reward_options`; registered as `<name>_schema` in group `task`. None: TaskConfig.
    schema: type[TaskConfig] | None = None
    # A task made from its config and the user's code (task=custom): task config -> this run's TaskSpec, whose
    # reward applies task.reward_weights itself and whose build() reads its own data sources. Callers get it
    # through grpo_cli.tasks.task_for(task_cfg).
    from_config: Callable[[TaskConfig], TaskSpec] | None = None

    def reward_for(self, prompt_style: str) -> RewardFn:
        """The task's own reward under a prompt style (the "correctness" component)."""
        return self.reward_fns_by_prompt.get(prompt_style, self.reward_fn)

    def cases_for(self, prompt_style: str) -> tuple[SanityCase, ...]:
        """The sanity cases of `reward_for(prompt_style)`."""
        return self.sanity_cases_by_prompt.get(prompt_style, self.sanity_cases)

    def make_prompt(self, question: str, prompt_style: str) -> Prompt:
        """A question wrapped in a prompt style the way this task's prompts are built."""
        return (self.prompt_format or format_prompt)(question, prompt_style)


def format_prompt(question: str, style: str) -> Prompt:
    """Wrap a task's question in the configured prompt style (docs/architecture.md, "Tasks and rewards")."""
    if style == "chat":
        return [{"role": "user", "content": question}]
    if style == "question_only":
        return question
    if style == "r1_zero":
        return R1_ZERO_TEMPLATE.format(question=question)
    raise ValueError(f"unknown prompt style {style!r}: use {', '.join(PROMPT_STYLES)}")


def prompt_stop_strings(style: str) -> tuple[str, ...]:
    """Stop strings a prompt style implies: r1_zero ends at its closing answer tag (docs/architecture.md, "Tasks and
    rewards"), so nothing the model writes after the answer is generated or trained on."""
    return ("</answer>",) if style == "r1_zero" else ()


def stop_strings(configured: list[str] | tuple[str, ...], style: str) -> tuple[str, ...]:
    """rollout.stop plus the prompt style's own stop strings, each once, in order."""
    return tuple(dict.fromkeys((*configured, *prompt_stop_strings(style))))


R1_ZERO_TEMPLATE = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the User with the "
    "answer. The reasoning process is enclosed within <think> </think> and answer is enclosed within <answer> "
    "</answer> tags, respectively, i.e., <think> reasoning process here </think> <answer> answer here </answer>.\n"
    "User: {question}\n"
    "Assistant: <think>"
)
