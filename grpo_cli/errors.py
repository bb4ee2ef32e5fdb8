"""How a run ends when it cannot go on: the user's error (one line, exit 2), a deliberate stop (one line, its
own exit code), or a bug (one line naming the file that holds the traceback)."""

from __future__ import annotations

import os
import tempfile
import traceback
from pathlib import Path

# Every exit code of grpo-run (the table in docs/reliability.md lists them for users).
EXIT_INTERNAL_ERROR = 1  # a bug: one line naming the file that holds the traceback; also "some sweep jobs failed"
EXIT_USER_ERROR = 2  # bad input (config, data, model path, a reward that failed under on_reward_error=stop)
EXIT_DIVERGED = 3  # loss or gradients not finite for train.max_nonfinite_steps steps in a row (last good saved)
EXIT_WEIGHT_SYNC_FAILED = 4  # the sampler could not take the learner's new weights (the update is saved)
EXIT_SIGINT = 130  # stopped by Ctrl-C after a checkpoint (128 + SIGINT, the shell's convention)
EXIT_SIGTERM = 143  # stopped by SIGTERM (a scheduler's time limit) after a checkpoint (128 + SIGTERM)


def exit_code_for_signal(signal_name: str) -> int:
    """The exit code of a run stopped by `signal_name` ("SIGINT" or "SIGTERM")."""
    return EXIT_SIGINT if signal_name == "SIGINT" else EXIT_SIGTERM


class UserFacingError(Exception):
    """An error caused by the user's input; the CLI prints its one-line message and exits with code 2."""


class ModelLoadError(UserFacingError):
    """The model, its tokenizer, device or dtype could not be set up as configured (one-line message)."""


# The user's code failing at run time: raised in tasks/, caught by the loop (drivers/) to stop with its checkpoints
# kept, so they live here, below both.
class RewardFunctionError(UserFacingError):
    """A user's reward function failed on a row at run time (task.on_reward_error=stop)."""


class EnvironmentFailed(UserFacingError):
    """An environment failed on an episode at run time (task.on_reward_error=stop)."""


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
