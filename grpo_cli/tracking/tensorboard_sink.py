"""TensorBoard backend (`logger=tensorboard`): event files in <run dir>/tensorboard, beside metrics.jsonl.

Every numeric metric becomes a scalar against the GRPO step (train and eval lines share it, as in W&B), and each
evaluation's completions become one markdown text entry (`eval/samples`, under logger.samples_every and
logger.samples_rows). View with `tensorboard --logdir <run dir>` (or a multirun directory, one run per folder).
The only module in grpo-cli that imports TensorBoard, and only when this backend is chosen; it needs the
`tensorboard` package (`pip install 'grpo-cli[tensorboard]'`).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from grpo_cli.errors import UserFacingError
from grpo_cli.tracking.jsonl import read_metrics, transcript_text

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from grpo_cli.config.schemas import GRPOConfig

LOG_SUBDIR = "tensorboard"
SAMPLES_TAG = "eval/samples"
MISSING_PACKAGE = (
    "logger=tensorboard needs the tensorboard package: pip install 'grpo-cli[tensorboard]' (or pick logger=none)"
)


def require_tensorboard() -> None:
    """UserFacingError, one line naming the extra, when the tensorboard package is not installed. Checked
    without importing it (or torch), so config validation stays fast."""
    if importlib.util.find_spec("tensorboard") is None:
        raise UserFacingError(MISSING_PACKAGE)


def scalar_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics as floats (0-d tensors and numpy scalars included); text and None are not scalars."""
    scalars = {}
    for key, value in metrics.items():
        if hasattr(value, "item"):
            value = value.item()
        if isinstance(value, int | float):  # bool is an int: a flag plots as 0/1
            scalars[key] = float(value)
    return scalars


def resume_purge_step(metrics_path: Path) -> int:
    """The first step a resumed run logs again: one past the last step metrics.jsonl kept (0 when it kept none).
    TensorBoard hides the earlier run's events from that step on, so its charts show what metrics.jsonl holds."""
    rows = read_metrics(metrics_path) if metrics_path.exists() else []
    return max((int(row["step"]) for row in rows), default=-1) + 1


def _fenced(text: str) -> str:
    # A fence longer than any run of backticks in the text, so a completion holding ``` cannot end the block.
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}\n{text}\n{fence}"


def _number(value: object) -> str:
    return f"{value:g}" if isinstance(value, int | float) and math.isfinite(value) else str(value)


def samples_markdown(rows: list[dict[str, Any]], max_rows: int) -> str:
    """The first `max_rows` eval records as one markdown text: rewards, ground truth, prompt and response."""
    parts = []
    for index, row in enumerate(rows[:max_rows], start=1):
        scores = ", ".join(
            f"{key} {_number(row[key])}" for key in ("reward", "format_reward", "answer_reward") if key in row
        )
        truth = row.get("ground_truth")
        truth_text = truth if isinstance(truth, str) else json.dumps(truth)
        parts.append(
            f"### Sample {index} ({scores})\n\n**ground truth**\n\n{_fenced(truth_text)}\n\n"
            f"**prompt**\n\n{_fenced(str(row.get('prompt', '')))}\n\n"
            f"**response**\n\n{_fenced(str(row.get('response', '')))}"
        )
    return "\n\n---\n\n".join(parts)


class TensorBoardSink:
    """Scalars against the GRPO step and eval completions as text, flushed at every call so a live TensorBoard
    shows each step as it lands and a killed run keeps what it logged (as metrics.jsonl does)."""

    def __init__(self, writer: SummaryWriter, samples_every: int, samples_rows: int) -> None:
        self.writer = writer
        self.samples_every = samples_every
        self.samples_rows = samples_rows
        self._closed = False

    @classmethod
    def start(cls, cfg: GRPOConfig, output_dir: Path, console: Console) -> TensorBoardSink:
        """Open <output_dir>/tensorboard; a resumed run first hides the steps it is about to log again."""
        require_tensorboard()
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # installed but unusable (e.g. too old for torch): still one line
            raise UserFacingError(f"{MISSING_PACKAGE} ({' '.join(str(e).split())[:160]})") from None
        log_dir = output_dir / LOG_SUBDIR
        purge_step = resume_purge_step(output_dir / "metrics.jsonl") if cfg.resume else None
        writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
        console.print(
            f"TensorBoard: {log_dir} (view with `tensorboard --logdir {log_dir}`)", highlight=False, markup=False
        )
        return cls(writer, cfg.logger.samples_every, cfg.logger.samples_rows)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in scalar_metrics(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        """One text entry of eval completions at evaluations whose step is a multiple of logger.samples_every."""
        if not self.samples_every or step % self.samples_every or not rows:
            return
        self.writer.add_text(SAMPLES_TAG, samples_markdown(rows, self.samples_rows), global_step=step)
        self.writer.flush()

    def log_episodes(self, rows: list[dict[str, Any]], step: int) -> None:
        """One text entry of a training step's first logger.samples_rows episodes (none with samples_every=0)."""
        if not self.samples_every or not rows:
            return
        text = "\n\n---\n\n".join(
            f"### Episode {i} (reward {_number(r['rewards'].get('reward', 0.0))}, {r['turns']} turns)\n\n"
            f"{_fenced(transcript_text(r['messages']))}"
            for i, r in enumerate(rows[: self.samples_rows], start=1)
        )
        self.writer.add_text("train/episodes", text, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.writer.close()
