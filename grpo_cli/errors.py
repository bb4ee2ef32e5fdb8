"""How a run ends when it cannot go on: the user's error (one line, exit 2), a deliberate stop (one line, its
own exit code), or a bug (one line naming the file that holds the traceback)."""

from __future__ import annotations

import os
import tempfile
import traceback
from pathlib import Path

# Exit codes of grpo-run (a stop has its own: 128 + the signal, or the one RunStopped names).
EXIT_INTERNAL_ERROR = 1
EXIT_USER_ERROR = 2


class UserFacingError(Exception):
    """An error caused by the user's input; the CLI prints its one-line message and exits with code 2."""


class RunStopped(Exception):
    """A run that stopped early on purpose (a signal, diverging numbers) after saving its work.

    The CLI prints the one-line message and exits with `exit_code` (non-zero), without a traceback.
    """

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def error_summary(error: BaseException, limit: int = 300) -> str:
    """`ErrorType: message` on one line (whitespace collapsed, cut at `limit` characters)."""
    return f"{type(error).__name__}: {' '.join(str(error).split())[:limit]}"


def write_traceback(error: BaseException, log: Path) -> Path:
    """Append the full traceback of `error` to `log` (a temporary file when that cannot be written); returns the
    file written."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    for path in (log, Path(tempfile.gettempdir()) / f"grpo-run-{os.getpid()}.log"):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as f:
                f.write(f"grpo-run: internal error\n{text}")
            return path
        except OSError:
            continue
    return log
