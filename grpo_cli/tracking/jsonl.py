"""metrics.jsonl: one JSON object per logged step, each with its "step"; flushed line by line so a killed
run keeps every completed step. Sample completions go to eval/step_<step>.jsonl beside it."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from grpo_cli.errors import UserFacingError


def _jsonable(value: object) -> object:
    if hasattr(value, "item"):  # 0-d tensors and numpy scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible instead of failing the run
    return value


class JsonlMetricsSink:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        """Every sample of an evaluation, one line each, in eval/step_00010.jsonl next to metrics.jsonl."""
        write_jsonl(self.path.parent / "eval" / f"step_{step:05d}.jsonl", rows)

    def log_episodes(self, rows: list[dict[str, Any]], step: int) -> None:
        """Every episode of a training step, one line each, in episodes/step_00001.jsonl next to metrics.jsonl."""
        write_jsonl(self.path.parent / "episodes" / f"step_{step:05d}.jsonl", rows)

    def close(self) -> None:
        self._file.close()


def transcript_text(messages: list[dict[str, Any]]) -> str:
    """An episode's conversation as plain text, one `[role] content` block per message (the samples tables)."""
    return "\n\n".join(f"[{m.get('role', '?')}] {m.get('content', '')}" for m in messages)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({k: _jsonable(v) for k, v in row.items()}) + "\n")


def truncate_metrics(path: Path, last_step: int) -> str | None:
    """Drop metrics.jsonl lines logged after `last_step` (a resumed run logs them again).

    A last line cut off mid-write (the process died, the disk filled) is dropped too: the file is truncated back
    to its last complete line and the returned message says so (None when the file was intact). A damaged line
    before the last one is not something a killed writer leaves behind: UserFacingError naming it.
    """
    if not path.exists():
        return None
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    kept, message = [], None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, KeyError, TypeError):
            if number < len(lines):
                raise UserFacingError(
                    f"{path}:{number} is not a metrics line (damaged file): remove that line, or start a new run "
                    "without resume=..."
                ) from None
            message = f"{path}: dropped its last line, cut off mid-write ({len(line)} characters): {line[:40]!r}"
            continue
        if step <= last_step:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    return message


def baseline_eval_reward(path: Path) -> float:
    """The step-0 evaluation's reward from metrics.jsonl (also right after a resume)."""
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["step"] == 0 and "eval/reward" in row:
            return float(row["eval/reward"])
    return float("nan")
