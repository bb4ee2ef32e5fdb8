"""metrics.jsonl: one JSON object per logged step, each with its "step"; flushed line by line so a killed
run keeps every completed step. Sample completions go to eval/step_<step>.jsonl beside it."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def _jsonable(value: Any) -> Any:
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

    def close(self) -> None:
        self._file.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({k: _jsonable(v) for k, v in row.items()}) + "\n")


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop metrics.jsonl lines logged after `last_step` (a resumed run logs them again)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


def baseline_eval_reward(path: Path) -> float:
    """The step-0 evaluation's reward from metrics.jsonl (also right after a resume)."""
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["step"] == 0 and "eval/reward" in row:
            return float(row["eval/reward"])
    return float("nan")
