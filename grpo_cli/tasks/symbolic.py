"""The symbolic step of math grading (math-verify + sympy), run in a helper process with a hard time limit.

Why a process: some answers make sympy compute for ever inside one C call. `\\boxed{10^{10^{10}}}` compared
with `\\frac{1}{2}` evaluates a ten-billion-digit integer power; nothing that runs between Python bytecodes
(an exception raised into the thread, and in other threads not even `signal.alarm`, which math-verify uses
and which only works in the main thread) can stop that. A process can be killed. So `symbolic_match` sends
both answers to one long-lived helper (`python -m grpo_cli.tasks.symbolic`, started on first use, ~1 s),
waits at most `timeout_s`, and on a timeout kills it; the next call starts a fresh one. Works from any
thread (calls are serialized by a lock), and a memory limit in the helper turns a memory bomb into an error.
If the helper cannot be started at all, the comparison runs in-process under `call_with_time_limit`.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
from functools import lru_cache
from typing import Any

from grpo_cli.usercode.timelimit import RewardTimeout, call_with_time_limit

HELPER_START_TIMEOUT_S = 60.0
HELPER_MEMORY_LIMIT_BYTES = 4 * 1024**3


class _QuietTimeoutWarning(logging.Filter):
    # We switch math-verify's signal timeouts off on purpose (ours works in any thread); its warning says so.
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


@lru_cache(maxsize=1)
def _math_verify() -> tuple[Any, Any, tuple[type, ...]]:
    """(parse, verify, the sympy object types), imported once and outside any time limit."""
    from math_verify import parse, verify
    from sympy import Basic, MatrixBase

    for name in ("math_verify", "math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_QuietTimeoutWarning())
    return parse, verify, (Basic, MatrixBase)


def _parse_expressions(text: str) -> list[Any]:
    """math-verify's parse of `text` as one whole expression; only math objects, no string fallback."""
    parse, _, math_types = _math_verify()
    parsed = parse("\\boxed{" + text + "}", parsing_timeout=None, fallback_mode="no_fallback")
    return [p for p in parsed if isinstance(p, math_types)]


def compare_in_process(pred_forms: list[str], gold_forms: list[str]) -> tuple[bool, bool]:
    """(parsed, match): whether any form of the prediction parses, and whether one equals a gold form."""
    _, verify, _ = _math_verify()
    pred = [e for form in pred_forms for e in _parse_expressions(form)]
    if not pred:
        return False, False
    gold = [e for form in gold_forms for e in _parse_expressions(form)]
    # verify(gold, target) is asymmetric on purpose (it unwraps "x = 5" on the prediction side only).
    return True, bool(gold) and bool(verify(gold, pred, timeout_seconds=None))


class _Helper:
    """One helper process speaking JSON lines: {"pred": [...], "gold": [...]} -> [parsed, match]."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[str] | None = None
        self.unavailable = False

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "grpo_cli.tasks.symbolic"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        if self._read_line(HELPER_START_TIMEOUT_S) != "ready":
            raise OSError("the symbolic grading helper did not start")

    def _read_line(self, timeout_s: float) -> str | None:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        return self.proc.stdout.readline().strip() if ready else None

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def compare(self, pred_forms: list[str], gold_forms: list[str], timeout_s: float) -> tuple[bool, bool]:
        with self.lock:
            try:
                if self.proc is None or self.proc.poll() is not None:
                    self._start()
                assert self.proc is not None and self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"pred": pred_forms, "gold": gold_forms}) + "\n")
                self.proc.stdin.flush()
                line = self._read_line(timeout_s)
            except BaseException:
                # Anything that interrupts a request half-way (a broken pipe, an outer time limit) leaves an
                # unread answer behind: start over with a fresh helper rather than read it as the next one's.
                self.kill()
                raise
            if line is None:
                self.kill()
                raise RewardTimeout(f"symbolic comparison took longer than {timeout_s:g}s")
            try:
                parsed, match = json.loads(line)
            except ValueError:  # no reply (the helper died, e.g. at its memory limit) or not ours: start over
                self.kill()
                return False, False
            return bool(parsed), bool(match)


_HELPER = _Helper()


def symbolic_match(pred_forms: list[str], gold_forms: list[str], timeout_s: float) -> tuple[bool, bool]:
    """(parsed, match) of `compare_in_process`, computed within `timeout_s` (RewardTimeout otherwise)."""
    if not _HELPER.unavailable and os.name == "posix":
        try:
            return _HELPER.compare(pred_forms, gold_forms, timeout_s)
        except OSError:
            _HELPER.unavailable = True  # no subprocesses here: fall back to the in-process limit below
    _math_verify()  # import before the clock starts
    return call_with_time_limit(timeout_s, compare_in_process, pred_forms, gold_forms)


def _serve() -> None:
    """The helper's loop: one JSON request per stdin line, one [parsed, match] reply per stdout line."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (HELPER_MEMORY_LIMIT_BYTES, HELPER_MEMORY_LIMIT_BYTES))
    except (ImportError, ValueError, OSError):
        pass  # no limit on this platform: the parent's time limit still applies
    # Replies go to the real stdout only; anything a library prints goes to stderr, not into the protocol.
    replies, sys.stdout = sys.stdout, sys.stderr
    _math_verify()
    print("ready", file=replies, flush=True)
    for line in sys.stdin:
        try:
            request = json.loads(line)
            reply = list(compare_in_process(request["pred"], request["gold"]))
        except Exception:  # noqa: BLE001 - a parser bug on one odd answer is a non-match, not a dead helper
            reply = [False, False]
        print(json.dumps(reply), file=replies, flush=True)


if __name__ == "__main__":
    _serve()
