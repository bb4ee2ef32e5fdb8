"""Weights & Biases backend (`logger=wandb`). The only module in grpo-cli that imports wandb.

A run must never wait on W&B: without an API key `online` becomes `offline` before any connection is tried,
and an online init that cannot reach the server within `logger.init_timeout_s` falls back to offline too,
each with a one-line notice. Offline runs keep everything on disk; `wandb sync <dir>` uploads them later.
"""

from __future__ import annotations

import dataclasses
import netrc
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlparse

import wandb
from rich.console import Console

from grpo_cli.tracking.jsonl import transcript_text

if TYPE_CHECKING:
    from grpo_cli.config.schemas import GRPOConfig

RUN_ID_FILE = "wandb_run_id.txt"
STEP_METRIC = "step"  # the GRPO step, the x axis of every chart (train and eval lines share it)
# The columns of the training episodes table (multi-turn tasks).
EPISODE_COLUMNS = ("step", "transcript", "reward", "turns", "truncated")
SAMPLE_COLUMNS = ("step", "prompt", "response", "ground_truth", "reward", "format_reward", "answer_reward")
# Keys of an eval record that are not shown (besides "reward/<name>"): every other key beyond SAMPLE_COLUMNS is a
# column a task=custom reward function logged with log_extra, shown after them (TRL's completions table does).
UNSHOWN_RECORD_KEYS = ("unparseable", "correctness", "n_tokens", "truncated", "sample", "majority", "eval_set")


def has_wandb_credentials(base_url: str, environ: dict[str, str] | None = None) -> bool:
    """Whether an API key is configured (WANDB_API_KEY or a netrc entry for the server), without any I/O
    beyond reading the netrc file: `wandb login` stores the key there."""
    environ = dict(os.environ) if environ is None else environ
    if environ.get("WANDB_API_KEY"):
        return True
    netrc_path = environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(netrc_path).authenticators(urlparse(base_url).hostname or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False


WandbMode = Literal["online", "offline", "disabled"]
WANDB_MODES: tuple[WandbMode, ...] = ("online", "offline", "disabled")  # logger.mode's choices


def choose_mode(requested: str, has_credentials: bool) -> tuple[WandbMode, str | None]:
    """The mode to start W&B in, and a notice when it differs from the requested one."""
    if requested == "online" and not has_credentials:
        return "offline", "no API key (set WANDB_API_KEY or run `wandb login`)"
    for mode in WANDB_MODES:  # logger.mode as wandb.init's literal type; the schema allows no other value
        if requested == mode:
            return mode, None
    raise ValueError(f"logger.mode={requested}: use one of {', '.join(WANDB_MODES)}")


_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def read_run_id(output_dir: Path) -> tuple[str | None, str | None]:
    """(the W&B run id saved by an earlier start in this run directory, None): a resumed run reattaches to it.

    A damaged file (not one id: a kill mid-write, a bad edit) gives (None, a message): the run starts a new W&B
    run, which rewrites the file; the earlier W&B run keeps what it logged.
    """
    path = output_dir / RUN_ID_FILE
    if not path.exists():
        return None, None
    try:
        run_id = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        run_id = "\0"
    if _RUN_ID.fullmatch(run_id):
        return run_id, None
    return None, f"{path} is damaged (not a W&B run id): this run logs to a new W&B run, and the file is rewritten"


def extra_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The log_extra columns of eval records (see UNSHOWN_RECORD_KEYS), in first-seen order."""
    known = {*SAMPLE_COLUMNS, *UNSHOWN_RECORD_KEYS}
    return list(dict.fromkeys(k for row in rows for k in row if k not in known and not k.startswith("reward/")))


def sample_table_rows(
    rows: list[dict[str, Any]], step: int, max_rows: int, extra: list[str] | None = None
) -> list[list[str | int | float | None]]:
    """Rows of the W&B samples table (SAMPLE_COLUMNS, then the `extra` columns); values that are not scalars (a
    ground truth's list of keywords, a logged list) become text."""
    table: list[list[str | int | float | None]] = []
    for row in rows[:max_rows]:
        values = [row.get("prompt"), row.get("response"), row.get("ground_truth")]
        values += [row.get(k) for k in (*SAMPLE_COLUMNS[4:], *(extra or ()))]
        table.append([step, *(v if isinstance(v, str | int | float | type(None)) else str(v) for v in values)])
    return table


def _scalar(value: object) -> object:
    return value.item() if hasattr(value, "item") else value


class WandbSink:
    """Scalars against the GRPO step, a samples table at evaluations, the resolved config, the run id on disk."""

    def __init__(self, run: wandb.Run, samples_every: int, samples_rows: int) -> None:
        self.run = run
        self.samples_every = samples_every
        self.samples_rows = samples_rows
        self._closed = False

    @classmethod
    def start(cls, cfg: GRPOConfig, output_dir: Path, console: Console) -> WandbSink:
        """Start (or, when the run directory holds a run id, resume) the W&B run of this GRPO run."""
        lg = cfg.logger
        base_url = wandb.Settings().base_url
        mode, notice = choose_mode(lg.mode, lg.mode != "online" or has_wandb_credentials(base_url))
        run_id, damaged = read_run_id(output_dir)
        if damaged is not None:
            console.print(damaged, highlight=False, markup=False)
        init_kwargs: dict[str, Any] = dict(  # Any: wandb.init's keywords each have their own type
            project=lg.project,
            entity=lg.entity,
            group=lg.group,
            tags=list(lg.tags),
            name=lg.name or output_dir.name,
            job_type=cfg.job.name,
            config=dataclasses.asdict(cfg),
            id=run_id,
            resume="allow" if run_id else None,
            # Inside the run directory unless WANDB_DIR says otherwise, so a run directory is complete.
            dir=None if os.environ.get("WANDB_DIR") else str(output_dir),
            settings=wandb.Settings(init_timeout=lg.init_timeout_s, silent=True, console="off"),
        )
        try:
            run = wandb.init(mode=mode, **init_kwargs)
        except Exception as e:  # noqa: BLE001 - whatever the server says, the run goes on offline
            if mode != "online":
                raise
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            notice = f"W&B could not start online within {lg.init_timeout_s:g}s ({reason[:160]})"
            mode = "offline"
            run = wandb.init(mode=mode, **init_kwargs)
        run.define_metric(STEP_METRIC)
        run.define_metric("*", step_metric=STEP_METRIC)
        if mode != "disabled":
            (output_dir / RUN_ID_FILE).write_text(run.id + "\n")
        console.print(_start_line(run, mode, notice), highlight=False, markup=False)
        return cls(run, lg.samples_every, lg.samples_rows)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log({**{k: _scalar(v) for k, v in metrics.items()}, STEP_METRIC: step})

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        """A table of eval completions at evaluations whose step is a multiple of logger.samples_every."""
        if not self.samples_every or step % self.samples_every:
            return
        extra = extra_columns(rows)
        table = wandb.Table(
            columns=[*SAMPLE_COLUMNS, *extra], data=sample_table_rows(rows, step, self.samples_rows, extra)
        )
        self.run.log({"eval/samples": table, STEP_METRIC: step})

    def log_episodes(self, rows: list[dict[str, Any]], step: int) -> None:
        """A table of a training step's first logger.samples_rows episodes (none with logger.samples_every=0)."""
        if not self.samples_every or not rows:
            return
        data = [
            [step, transcript_text(r["messages"]), r["rewards"].get("reward"), r["turns"], r["truncated"]]
            for r in rows[: self.samples_rows]
        ]
        table = wandb.Table(columns=list(EPISODE_COLUMNS), data=data)
        self.run.log({"train/episodes": table, STEP_METRIC: step})

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.run.finish()


def _start_line(run: wandb.Run, mode: WandbMode, notice: str | None) -> str:
    prefix = f"{notice}: " if notice else ""
    if mode == "online":
        return f"W&B: run {run.name} at {run.url}"
    if mode == "disabled":
        return "W&B: disabled (logger.mode=disabled); metrics go to metrics.jsonl only"
    offline_dir = Path(run.dir).parent  # run.dir is <offline run dir>/files
    return f"W&B: {prefix}offline run {run.name} ({run.id}); upload later with `wandb sync {offline_dir}`"
