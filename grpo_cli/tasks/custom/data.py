"""task=custom's data and prompts: the rows of a split (a file, the user's generator or a `datasets` source),
renamed, checked and rendered into the model's prompts and the ground truths the rewards read."""

from __future__ import annotations

import json
import string
from typing import TYPE_CHECKING, Any

from grpo_cli.errors import UserFacingError
from grpo_cli.tasks.base import R1_ZERO_TEMPLATE, Example, Prompt, Row, TaskDataError
from grpo_cli.tasks.custom.schema import MESSAGE_ROLES, CustomTaskConfig
from grpo_cli.tasks.sources import check_json_values, dataset_rows, file_rows, generated_rows

if TYPE_CHECKING:
    from grpo_cli.tasks.custom.trl_convention import NamedReward


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
        rows = generated_rows("task.generator", task_cfg.generator, task_cfg.reference_dir(), n, seed)
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
