"""A per-call time limit that works in any thread, for reward functions that may not terminate.

Why not signals: `signal.alarm` (math-verify's own mechanism) only works in the main thread, and a rollout
engine or a notebook may score from another one. Why not a worker thread or process: a thread cannot be
killed, so an abandoned runaway sympy simplification would keep burning one of our two cores, and a worker
process costs an interpreter start and pickling every call.

How: the call runs in the caller's own thread; a single watchdog thread raises `_Interrupt` inside it when
its deadline passes (CPython's `PyThreadState_SetAsyncExc`, the same "exception at the next bytecode" that a
signal handler gives, but aimed at any thread). `_Interrupt` derives from BaseException so that the broad
`except Exception` blocks inside sympy and math-verify cannot swallow it; the watchdog re-raises it every
`_REPEAT_S` until the call returns, in case some `except BaseException` does. Limits nest: each guard knows
whether its own deadline fired and passes an outer guard's interrupt on.

The limit cannot interrupt a single long C call (a huge integer power computed in one step); in practice
sympy's slow paths are Python loops, which it does interrupt.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

T = TypeVar("T")
P = ParamSpec("P")

_REPEAT_S = 0.05  # re-raise period for calls that swallowed the first interrupt


class RewardTimeout(Exception):
    """A time-limited call ran past its limit (raised to the caller; the call itself was interrupted)."""


class _Interrupt(BaseException):
    """Raised asynchronously inside the guarded call; never escapes `call_with_time_limit`."""


@dataclass(order=True)
class _Guard:
    deadline: float
    serial: int
    thread_id: int = field(compare=False)
    active: bool = field(default=True, compare=False)
    fired: bool = field(default=False, compare=False)


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    # exc=None clears an interrupt that was raised but not yet delivered.
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


class _Watchdog:
    """One daemon thread that interrupts guarded calls whose deadline has passed."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[_Guard] = []
        self._thread: threading.Thread | None = None

    def arm(self, guard: _Guard) -> None:
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="grpo-cli-time-limit", daemon=True)
                self._thread.start()
            if guard.active:  # not disarmed by an interrupt that landed before the lock was taken
                heapq.heappush(self._heap, guard)
                self._cond.notify()

    def disarm(self, guard: _Guard) -> None:
        """After this returns, no interrupt for `guard` is pending or will be raised."""
        # First, before waiting for the lock: the watchdog re-checks `active` before every interrupt, so at
        # most one more can arrive after this line (one it decided on just before), and the caller's retry
        # loop absorbs it.
        guard.active = False
        with self._cond:
            if guard.fired:
                _set_async_exc(guard.thread_id, None)

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and not self._heap[0].active:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                guard = self._heap[0]
                delay = guard.deadline - time.monotonic()
                if delay > 0:
                    self._cond.wait(delay)
                    continue
                # Under the lock, so `disarm` cannot clear pending interrupts between the check and this one.
                guard.fired = True
                _set_async_exc(guard.thread_id, _Interrupt)
                heapq.heappop(self._heap)
                guard.deadline = time.monotonic() + _REPEAT_S
                heapq.heappush(self._heap, guard)


_WATCHDOG = _Watchdog()
_SERIAL = itertools.count()


def _disarm_uninterrupted(guard: _Guard) -> None:
    # An interrupt raised before `disarm` took the lock may land inside it; disarm again until it completes.
    while True:
        try:
            _WATCHDOG.disarm(guard)
            return
        except _Interrupt:
            continue


def call_with_time_limit(seconds: float | None, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)`, interrupted with RewardTimeout after `seconds` (None or <= 0: no limit).

    Works from any thread and nests (an inner limit raises RewardTimeout inside the outer call).
    """
    if seconds is None or seconds <= 0:
        return fn(*args, **kwargs)
    guard = _Guard(time.monotonic() + seconds, next(_SERIAL), threading.get_ident())
    try:
        try:
            # Armed inside the try: an outer interrupt landing right after arming must still disarm this guard.
            _WATCHDOG.arm(guard)
            return fn(*args, **kwargs)
        finally:
            _disarm_uninterrupted(guard)
    except _Interrupt:
        _disarm_uninterrupted(guard)
        if not guard.fired:
            raise  # an outer guard's deadline: let that guard handle it
        raise RewardTimeout(f"{getattr(fn, '__name__', 'call')} took longer than {seconds:g}s") from None
