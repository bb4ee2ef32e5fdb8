"""Rows of a user's data for task=custom: a local JSONL, CSV or Parquet file, a `datasets` directory or hub id
with a split, or the user's own generator `file.py:function(n, seed)`. A row is a dict of columns, any names.

Every failure is one TaskDataError line naming the source and what to give instead. No torch.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from grpo_cli.tasks.base import Row, TaskDataError, iter_jsonl_objects
from grpo_cli.tasks.hub import _one_line, offline_refusal
from grpo_cli.usercode.user_code import check_signature, load_callable

FILE_SUFFIXES = (".jsonl", ".csv", ".parquet")


def _jsonl_rows(path: Path, n: int | None) -> list[Row]:
    rows = []
    for _, row in iter_jsonl_objects(path):
        rows.append(row)
        if n is not None and len(rows) >= n:
            break
    return rows


def _csv_rows(path: Path, n: int | None) -> list[Row]:
    with path.open(encoding="utf-8", newline="") as f:
        rows = []
        for row in csv.DictReader(f):
            rows.append(dict(row))
            if n is not None and len(rows) >= n:
                break
    return rows


def _parquet_rows(path: Path, n: int | None) -> list[Row]:
    import pyarrow.parquet as pq  # a dependency of `datasets`

    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - a damaged or non-parquet file: one line
        raise TaskDataError(f"{path} is not a readable Parquet file ({_one_line(e)})") from None
    if n is not None:
        table = table.slice(0, n)
    return table.to_pylist()


def file_rows(key: str, path: str, n: int | None) -> list[Row]:
    """The first `n` rows (all when None) of a local .jsonl, .csv or .parquet file, or of a directory a
    `datasets` save (save_to_disk) or data files are in."""
    target = Path(path)
    if target.is_dir():
        return dataset_rows(key, str(target), None, "train", n)
    suffix = target.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise TaskDataError(
            f"{key}={path}: read by its suffix, which must be {', '.join(FILE_SUFFIXES)} (or give a dataset directory)"
        )
    try:
        reader = {".jsonl": _jsonl_rows, ".csv": _csv_rows, ".parquet": _parquet_rows}[suffix]
        rows = reader(target, n)
    except FileNotFoundError:
        raise TaskDataError(f"{key}={path}: no such file (relative paths start where you ran grpo-run)") from None
    except UnicodeDecodeError as e:
        raise TaskDataError(f"{key}={path} is not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise TaskDataError(f"{key}={path}: cannot read it ({e.strerror})") from None
    if not rows:
        raise TaskDataError(f"{key}={path} holds no rows")
    return rows


def dataset_rows(key: str, name: str, config: str | None, split: str, n: int | None) -> list[Row]:
    """Rows of a `datasets` dataset: a directory written by save_to_disk, a directory of data files, or a hub id."""
    where = f"{key}={name}" + (f" ({config})" if config else "") + f" split {split!r}"
    try:
        import datasets

        if Path(name).is_dir() and (Path(name) / "dataset_dict.json").is_file():
            rows = datasets.load_from_disk(name)[split]
        elif Path(name).is_dir() and (Path(name) / "dataset_info.json").is_file():
            rows = datasets.load_from_disk(name)
        else:
            if not Path(name).exists() and (refused := offline_refusal(name)) is not None:
                raise TaskDataError(
                    f"cannot load {where} from the Hugging Face hub ({refused}): give a local file with "
                    "task.train_path / task.eval_path, or a dataset directory"
                )
            rows = datasets.load_dataset(name, config, split=split)
    except TaskDataError:
        raise
    except Exception as e:  # noqa: BLE001 - offline, no such dataset or split: one line, never a traceback
        raise TaskDataError(
            f"cannot load {where} ({type(e).__name__}: {_one_line(e)}): give a local file with "
            "task.train_path / task.eval_path, or a dataset directory"
        ) from None
    if n is not None:
        rows = rows.select(range(min(n, len(rows))))
    out = [dict(row) for row in rows]
    if not out:
        raise TaskDataError(f"{where} holds no rows")
    return out


def generated_rows(key: str, reference: str, base_dir: Path, n: int | None, seed: int) -> list[Row]:
    """Rows the user's generator makes: `fn(n, seed)` -> a list (or any iterable) of dicts."""
    fn = load_callable(key, reference, base_dir)
    check_signature(key, reference, fn, n, seed)
    try:
        rows = list(fn(n, seed))
    except Exception as e:  # noqa: BLE001 - the user's generator failing: one line
        raise TaskDataError(
            f"{key}={reference} raised {type(e).__name__}: {_one_line(e)} (called with n={n}, seed={seed})"
        ) from None
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise TaskDataError(f"{key}={reference}: row {index} is a {type(row).__name__}; return a list of dicts")
    if not rows:
        raise TaskDataError(f"{key}={reference} returned no rows for n={n}, seed={seed}")
    return rows[:n] if n is not None else rows


def check_json_values(where: str, rows: list[Row]) -> None:
    """Rows travel to Ray actors and into eval JSONL: a column value JSON cannot hold (nan, a set) fails here."""
    for index, row in enumerate(rows[:1000]):
        for column, value in row.items():
            if isinstance(value, float) and not math.isfinite(value):
                continue  # JSON writes it as NaN, readable back; a missing CSV number reads as text anyway
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                raise TaskDataError(
                    f"{where} row {index} column {column!r} holds a {type(value).__name__}, which cannot be "
                    "written as JSON: give text, numbers, lists or dicts"
                ) from None
