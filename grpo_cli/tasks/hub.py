"""Examples from a Hugging Face hub dataset (through `datasets`), for real users; the tests never reach it."""

from __future__ import annotations

import functools
import os
import socket
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo_cli.tasks.base import Example, GroundTruth, Prompt, Row, RowError, TaskDataError, format_prompt

RowParser = Callable[[Row], tuple[str, GroundTruth, dict[str, Any]]]


def _one_line(error: BaseException, limit: int = 200) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def hub_offline() -> bool:
    """Whether the Hugging Face libraries are told not to reach the hub (read now, not at import)."""
    flags = (os.environ.get(name, "") for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return any(flag.strip().upper() in ("1", "ON", "YES", "TRUE") for flag in flags)


def hub_dataset_cached(name: str) -> bool:
    """Whether hub dataset `name` has a copy in either local cache (the hub's snapshots, or `datasets`' own) that
    an offline load could read. A cheap look at two directories: `datasets` itself, asked offline for a dataset it
    does not hold, may spend its retries first."""
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")).expanduser()
    hub = Path(os.environ.get("HF_HUB_CACHE", home / "hub")).expanduser()
    own = Path(os.environ.get("HF_DATASETS_CACHE", home / "datasets")).expanduser()
    return (hub / f"datasets--{name.replace('/', '--')}").is_dir() or (own / name.replace("/", "___")).is_dir()


@functools.cache
def hub_unreachable() -> str | None:
    """Why the hub cannot be reached from here (its host does not resolve, or does not accept a connection within
    3 s), else None; asked once a process. A machine without a network, HF_HUB_OFFLINE unset, otherwise spends
    huggingface_hub's retries (5 per file, ~45 s in all for a model and its tokenizer) before the same failure.
    Behind a proxy nothing is probed: the proxy decides."""
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    endpoint = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = endpoint.hostname or "huggingface.co"
    try:
        with socket.create_connection((host, endpoint.port or (80 if endpoint.scheme == "http" else 443)), timeout=3):
            return None
    except OSError as error:
        return f"the hub ({host}) cannot be reached ({error.strerror or type(error).__name__})"


def offline_refusal(name: str) -> str | None:
    """Why hub dataset `name` cannot load now (no local copy, and HF_HUB_OFFLINE set or the hub unreachable), or
    None. A name that is a local directory or file is `datasets`' to load from disk, never the hub's."""
    if Path(name).expanduser().exists() or hub_dataset_cached(name):
        return None
    if hub_offline():
        return f"{name} is not in the local cache and HF_HUB_OFFLINE is set"
    if (unreachable := hub_unreachable()) is not None:
        return f"{name} is not in the local cache and {unreachable}"
    return None


def load_hub_examples(
    split: str,
    n: int | None,
    seed: int,
    prompt_style: str,
    *,
    parse_row: RowParser,
    hub_dataset: str | None,
    hub_config: str | None,
    hub_train_split: str,
    hub_eval_split: str,
    prompt_format: Callable[[str, str], Prompt] = format_prompt,
) -> list[Example]:
    """The first `n` rows (all when None) of the hub split, parsed by `parse_row`. `seed` is unused: the
    split's own order is kept, so every run evaluates the same examples (the trainer shuffles train prompts).

    `prompt_format` wraps each question (a task with its own system prompt passes its own).
    Any failure to load (offline, no such dataset, `datasets` missing) becomes one TaskDataError line that
    says which path option to pass instead.
    """
    del seed
    hub_split = hub_train_split if split == "train" else hub_eval_split
    path_key = "task.train_path" if split == "train" else "task.eval_path"
    if not hub_dataset:
        raise TaskDataError(f"task.hub_dataset is not set: pass a local JSONL file with {path_key}=...")
    where = f"{hub_dataset}" + (f" ({hub_config})" if hub_config else "") + f" split {hub_split!r}"
    if (refused := offline_refusal(hub_dataset)) is not None:
        raise TaskDataError(
            f"cannot load {where} from the Hugging Face hub ({refused}): pass a local JSONL file with {path_key}=..."
        )
    try:
        import datasets

        rows = datasets.load_dataset(hub_dataset, hub_config, split=hub_split)
    except Exception as e:  # noqa: BLE001 - offline, missing dataset or missing package: one line, never a traceback
        raise TaskDataError(
            f"cannot load {where} from the Hugging Face hub ({type(e).__name__}: {_one_line(e)}): "
            f"pass a local JSONL file with {path_key}=..."
        ) from None
    examples: list[Example] = []
    for index, row in enumerate(rows):
        if n is not None and len(examples) >= n:
            break
        try:
            question, ground_truth, meta = parse_row(dict(row))
        except RowError as e:
            raise TaskDataError(f"{where} row {index}: {e}") from None
        examples.append(Example(prompt_format(question, prompt_style), ground_truth, meta))
    if not examples:
        raise TaskDataError(f"{where} holds no examples: pass a local JSONL file with {path_key}=...")
    return examples
