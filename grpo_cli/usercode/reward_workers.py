"""The user's reward functions in worker processes that can be stopped (task=custom, `task.reward_workers`).

Why processes: usercode/timelimit.py interrupts a call between two bytecodes, so a call blocked inside one C call
(time.sleep, a catastrophic regex, a stuck socket) outlives its limit, and `sys.exit` or `os._exit` in the user's
code ends the run. In a worker process a call past its limit is killed with the process (and whatever it
started), and an exit or a crash is that call's error, reported like an exception.

Why not concurrent.futures.ProcessPoolExecutor: it cannot kill one stuck worker (a killed worker breaks the whole
pool). Why a fresh interpreter (subprocess, as tasks/symbolic.py's helper), not a fork: the parent holds the
threads of torch, Ray and the rollout engine, and forking a threaded process is unsafe. Why not multiprocessing's
`spawn`: it re-imports the parent's `__main__` in every worker (Ray's worker script in a Ray actor) and cannot
start the worker in its own session. A worker imports this module, the user's code and what that imports
(0.6-0.7 s per start on this project's 2-core CPU, paid once per run and after each kill); it talks to the pool
over a socket pair through multiprocessing.connection's framing, and gets the caller's sys.path first.

    pool = RewardWorkers(n, time_limit_s)     n workers, started on first use, one call at a time each
    pending = pool.submit(loader, args, kwargs, callbacks)   sent to the first idle worker (or queued)
    pending.result()   the function's return value, or RewardTimeout (killed at the limit) or RewardCallFailed
                       (raised, sys.exit, os._exit, crashed); waiting for one call serves every call in flight,
                       so calls submitted together run in parallel across the workers

`loader` is a picklable callable that returns the function (functools.partial(user_code.load_reward_spec, key,
spec, base_dir)); each worker calls it once and keeps the function, so module-level state of the user's code, and
a factory's reward built from a `_target_` node, is per worker, as under TRL with several processes. Loading does
not count toward the time limit (it has its own, LOAD_LIMIT_S). `callbacks` (TRL's log_extra and log_metric) are
recorded in the worker and replayed, in order, in the caller when it reads the result.

A worker is not dumpable (PR_SET_DUMPABLE 0: another process of the user cannot trace it or read its
/proc/<pid>/environ), and what it starts gets no descriptor of its own (subprocess's close_fds): the `python` tool's
programs (grpo_cli/sandbox/__init__.py) run in their own pid namespace, where the workers and the trainer do not exist.

No worker outlives its parent: each asks the kernel for SIGKILL when its parent dies (Linux PR_SET_PDEATHSIG,
which also covers the parent being killed outright), and the pool kills them on close, when it is garbage
collected and at exit. Each worker starts in its own session (so its own process group): a kill ends what the
user's code started too, and a terminal's Ctrl-C reaches only the parent, which finishes its step
(docs/reliability.md) and then stops its workers. A SIGINT or SIGTERM sent to every process (a batch scheduler's
stop) is ignored by the worker for the same reason (by a Python handler: the programs the user's code runs get
the default back).

A stop request (grpo-run's SIGINT/SIGTERM handler calls `notice_stop`) gives a call without a time limit
STOP_GRACE_S more seconds; one still running then is killed and raises RewardsAbandoned, which abandons the step.
A call with a limit is killed at its limit anyway.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from grpo_cli.usercode.awaiting import resolved
from grpo_cli.usercode.timelimit import RewardTimeout, call_with_time_limit

# A worker's start plus the user's imports (a module that imports torch or transformers takes seconds).
LOAD_LIMIT_S = 300.0
# After a stop request, how long a call without a time limit may still run before the step is abandoned.
STOP_GRACE_S = 5.0
# The longest single wait, so a stop request is seen within it.
_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
# How a worker starts: read the caller's sys.path (so grpo_cli and the user's code are found as the caller finds
# them), then serve. argv: the socket's file descriptor, the parent's pid.
_BOOTSTRAP = """
import pickle, sys
from multiprocessing.connection import Connection
conn = Connection(int(sys.argv[1]))
sys.path[:] = pickle.loads(conn.recv_bytes())
from grpo_cli.usercode.reward_workers import worker_main
worker_main(conn, int(sys.argv[2]))
"""

_stop_requested_at: float | None = None


def notice_stop() -> None:
    """The run was asked to stop (SIGINT/SIGTERM): calls without a time limit get STOP_GRACE_S more seconds.
    Safe in a signal handler."""
    global _stop_requested_at
    if _stop_requested_at is None:
        _stop_requested_at = time.monotonic()


def clear_stop_notice() -> None:
    global _stop_requested_at
    _stop_requested_at = None


class RewardCallFailed(Exception):
    """The user's function did not return a value: `what` says how, for the error line ("raised ValueError: x",
    "called sys.exit(3)", "ended its worker process with exit code 7", ...)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class RewardsAbandoned(BaseException):  # noqa: N818 - not an error of the user's code: the run is stopping
    """A stop was requested and a call without a time limit was still running STOP_GRACE_S later: its worker was
    killed and the step is abandoned. A BaseException, so that no reward's `except Exception` counts it."""


def describe_error(error: BaseException) -> str:
    """How a call failed, as the error line says it: `raised ValueError: message`, or what a worker reported
    (`called sys.exit(3)`, ...)."""
    if isinstance(error, RewardCallFailed):
        return error.what
    return f"raised {_summary(error)}"


def _summary(error: BaseException) -> str:
    """`ValueError: message`, whitespace collapsed, the message cut at 200 characters."""
    return f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"


# ---------------------------------------------------------------------------------------------- in the worker


@dataclass(frozen=True)
class Recorder:
    """Stands in for a callback (TRL's log_extra, log_metric) inside a worker: records each call for the parent."""

    name: str

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        _RECORDED.append((self.name, args, kwargs))


_RECORDED: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []


def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL when the parent dies, however it dies; a parent already gone ends this worker now."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(0)


def _not_dumpable() -> None:
    """Linux: no process of this user may ptrace this worker or read its /proc/<pid>/environ, mem or fds (only
    one with CAP_SYS_PTRACE may): the worker keeps the user's environment (rewards may need API keys) and holds the
    socket the trainer unpickles replies from."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)


def _ignore(signum: int, frame: Any) -> None:
    """A stop signal sent to every process is the parent's to act on."""


def worker_main(conn: Connection, parent_pid: int) -> None:
    """A worker's loop: one call per request, until the pool closes its end."""
    _die_with_parent(parent_pid)
    _not_dumpable()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _ignore)
    functions: dict[bytes, Callable[..., Any]] = {}
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the pool closed its end
        conn.send_bytes(_serve(request, functions, conn))


def _serve(request: bytes, functions: dict[bytes, Callable[..., Any]], conn: Connection) -> bytes:
    """One call: load the function on first use (saying "loaded", so the time limit starts), call it, and return
    the pickled reply."""
    try:
        loader, args, kwargs = pickle.loads(request)
    except BaseException as e:  # noqa: BLE001 - anything the arguments do when read is this call's failure
        return _reply("failed", f"could not read its arguments in its worker process ({_summary(e)})")
    fn = functions.get(loader)
    if fn is None:
        try:
            fn = pickle.loads(loader)()
        except BaseException as e:  # noqa: BLE001 - one line, as when the parent loaded it
            return _reply("failed", f"could not be loaded in its worker process: {_summary(e)}")
        functions[loader] = fn
        conn.send_bytes(pickle.dumps(("loaded",)))
    _RECORDED.clear()
    try:
        value = resolved(fn(*args, **kwargs))  # an async function's coroutine is awaited here, within the limit
    except SystemExit as e:
        return _reply("failed", f"called sys.exit({'' if e.code is None else repr(e.code)})")
    except BaseException as e:  # noqa: BLE001 - the user's code: its error goes back to the parent
        return _reply("failed", describe_error(e))
    try:
        return pickle.dumps(("ok", value, list(_RECORDED)), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - a value pickle cannot send
        return _reply("failed", f"returned or logged a value its worker process cannot send back ({e})")


def _reply(kind: str, *parts: Any) -> bytes:
    return pickle.dumps((kind, *parts), protocol=pickle.HIGHEST_PROTOCOL)


# ---------------------------------------------------------------------------------------------- in the caller


class PendingCall:
    """One submitted call; `result()` waits for it (making progress on every call in flight)."""

    def __init__(
        self, pool: RewardWorkers, request: bytes, loader: bytes, callbacks: Mapping[str, Callable], label: str
    ) -> None:
        self._pool = pool
        self.request = request
        self.loader = loader
        self._callbacks = callbacks
        self.label = label
        self.done = False
        self._value: Any = None
        self._records: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self._error: BaseException | None = None

    def finish(self, value: Any = None, records: Sequence[Any] = (), error: BaseException | None = None) -> None:
        self.done, self._value, self._records, self._error = True, value, list(records), error

    def result(self) -> Any:
        """The function's return value, after replaying its recorded callbacks; or the call's error."""
        if not self.done:
            self._pool.wait_for(self)
        if self._error is not None:
            raise self._error
        records, self._records = self._records, []
        for name, args, kwargs in records:
            self._callbacks[name](*args, **kwargs)
        return self._value


class InProcessCall:
    """task.reward_workers=0: the call runs in the caller's process when its result is read, under the in-process
    time limit (usercode/timelimit.py), as before workers existed: a C call that blocks outlives the limit, and an exit
    ends the run."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], limit: float | None):
        self.fn, self.args, self.kwargs, self.limit = fn, args, kwargs, limit

    def result(self) -> Any:
        return call_with_time_limit(self.limit, _called, self.fn, self.args, self.kwargs)


def _called(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`fn(*args, **kwargs)`, awaited when `fn` is async (under the caller's time limit)."""
    return resolved(fn(*args, **kwargs))


@dataclass
class _Worker:
    process: subprocess.Popen
    conn: Connection
    loaded: set[bytes] = field(default_factory=set)  # the loaders it has called (it keeps their functions)
    call: PendingCall | None = None
    loading: bool = False  # the current call is waiting for its function to load
    started: float = 0.0  # when the current call's function started (or its loading)


def _start_worker() -> _Worker:
    here, there = socket.socketpair()
    with there:
        process = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, str(there.fileno()), str(os.getpid())],
            pass_fds=[there.fileno()],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    conn = Connection(here.detach())
    conn.send_bytes(pickle.dumps(sys.path))
    return _Worker(process, conn)


def _kill(worker: _Worker) -> int | None:
    """Kill the worker and everything left in its process group; its exit code (negative: the signal)."""
    # The group outlives a worker that exited while a process it started runs (its id is not reused meanwhile).
    with contextlib.suppress(OSError):
        os.killpg(worker.process.pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        worker.process.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        worker.process.wait(timeout=10)
    worker.conn.close()
    return worker.process.returncode


def _kill_all(workers: list[_Worker]) -> None:
    while workers:
        _kill(workers.pop())


_LIVE_POOLS: weakref.WeakSet[RewardWorkers] = weakref.WeakSet()


@atexit.register
def _close_all_pools() -> None:
    for pool in list(_LIVE_POOLS):
        pool.close()


class RewardWorkers:
    """`n_workers` worker processes running the user's functions, each call killed at `time_limit_s` (None: no
    limit). Thread-safe: a lock serializes submitting and waiting."""

    def __init__(self, n_workers: int, time_limit_s: float | None) -> None:
        if n_workers < 1:
            raise ValueError(f"a reward worker pool needs at least one worker, not {n_workers}")
        self.n_workers = n_workers
        self.time_limit_s = time_limit_s or None
        self._workers: list[_Worker] = []
        self._queue: deque[PendingCall] = deque()
        self._lock = threading.RLock()
        self._loaders: dict[int, tuple[Any, bytes]] = {}  # id(loader) -> (loader, its pickle)
        # Kills the workers when the pool is garbage collected (at exit, _close_all_pools does).
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)
        self._finalizer.atexit = False
        _LIVE_POOLS.add(self)

    # --- the API ------------------------------------------------------------------------------------------
    def submit(
        self,
        loader: Callable[[], Callable[..., Any]],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        callbacks: Mapping[str, Callable[..., Any]] | None = None,
        label: str = "the reward function",
    ) -> PendingCall:
        """Queue `loader()(*args, **kwargs)` for a worker. A value of `kwargs`, or of a dict in `args` (a
        per-sample row), that is one of `callbacks` is sent as a Recorder of that name, and its calls are replayed
        on the callback when the result is read. `label` names the function in RewardsAbandoned's message."""
        callbacks = dict(callbacks or {})
        swap = {id(fn): Recorder(name) for name, fn in callbacks.items()}
        args = tuple(_with_recorders(a, swap) if isinstance(a, dict) else a for a in args)
        kwargs = _with_recorders(dict(kwargs), swap)
        loader_bytes = self._loader_bytes(loader)
        try:
            request = pickle.dumps((loader_bytes, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - an argument pickle cannot send: that call's error
            pending = PendingCall(self, b"", loader_bytes, callbacks, label)
            pending.finish(error=RewardCallFailed(f"got an argument its worker process cannot receive ({e})"))
            return pending
        pending = PendingCall(self, request, loader_bytes, callbacks, label)
        with self._lock:
            self._queue.append(pending)
            self._dispatch()
        return pending

    def wait_for(self, pending: PendingCall) -> None:
        with self._lock:
            while not pending.done:
                self._dispatch()
                self.poll(_POLL_S)

    def pids(self) -> list[int]:
        """The process ids of the workers started and not yet stopped."""
        return [w.process.pid for w in self._workers]

    def close(self) -> None:
        """Kill every worker; calls in flight or queued fail. The pool starts new workers if used again."""
        with self._lock:
            for worker in self._workers:
                if worker.call is not None:
                    worker.call.finish(error=RewardCallFailed("did not finish: its worker pool was closed"))
            while self._queue:
                self._queue.popleft().finish(error=RewardCallFailed("did not start: its worker pool was closed"))
            _kill_all(self._workers)

    # --- the machinery ------------------------------------------------------------------------------------
    def _loader_bytes(self, loader: Callable[[], Callable[..., Any]]) -> bytes:
        # Pickled once per loader object (kept alive here, so its id stays its own).
        known = self._loaders.get(id(loader))
        if known is None or known[0] is not loader:
            known = self._loaders[id(loader)] = (loader, pickle.dumps(loader, protocol=pickle.HIGHEST_PROTOCOL))
        return known[1]

    def _dispatch(self) -> None:
        """Start the workers on first use, replace any that died while idle, and hand queued calls to idle ones."""
        if not self._workers:
            self._workers.extend(_start_worker() for _ in range(self.n_workers))
        for index, worker in enumerate(self._workers):
            if not self._queue:
                return
            if worker.call is not None:
                continue
            if worker.process.poll() is not None:  # killed while idle (the OOM killer): nothing was lost
                _kill(worker)
                worker = self._workers[index] = _start_worker()
            pending = self._queue.popleft()
            try:
                worker.conn.send_bytes(pending.request)
            except OSError:  # it died just now, before reading the call: a new worker takes it
                _kill(worker)
                worker = self._workers[index] = _start_worker()
                worker.conn.send_bytes(pending.request)
            worker.call, worker.loading, worker.started = pending, pending.loader not in worker.loaded, time.monotonic()

    def poll(self, timeout: float) -> None:
        """Wait up to `timeout` s for a busy worker to reply, die or reach its deadline, settle those calls, and hand
        queued calls to the workers that are free."""
        with self._lock:
            busy = [w for w in self._workers if w.call is not None]
            if not busy:
                return
            now = time.monotonic()
            deadlines = [d for d in map(self._deadline, busy) if d is not None]
            timeout = max(0.0, min([timeout, *(d - now for d in deadlines)]))
            ready = set(wait([w.conn for w in busy], timeout))
            for worker in busy:
                if worker.conn in ready:
                    self._read(worker)
                if worker.call is not None and worker.process.poll() is not None:
                    self._read(worker)  # died: a reply it sent first still counts
                if worker.call is not None:
                    self._enforce_deadline(worker, worker.call)
            self._dispatch()  # a worker freed here takes the next queued call

    def _deadline(self, worker: _Worker) -> float | None:
        if worker.loading:
            return worker.started + LOAD_LIMIT_S
        if self.time_limit_s is not None:
            return worker.started + self.time_limit_s
        if _stop_requested_at is not None:
            return max(worker.started, _stop_requested_at) + STOP_GRACE_S
        return None

    def _read(self, worker: _Worker) -> None:
        """Every message the worker has sent; a closed connection, or a process that ended with no reply, means
        the process died in the call."""
        closed = False
        while worker.call is not None:
            try:
                if not worker.conn.poll():
                    break
                message = pickle.loads(worker.conn.recv_bytes())
            except (EOFError, OSError):
                closed = True
                break
            if message[0] == "loaded":
                worker.loaded.add(worker.call.loader)
                worker.loading, worker.started = False, time.monotonic()
            elif message[0] == "ok":
                worker.call.finish(value=message[1], records=message[2])
                worker.call = None
            else:
                worker.call.finish(error=RewardCallFailed(message[1]))
                worker.call = None
        if worker.call is None:
            return
        if closed:  # the process is ending (its socket closed with it): wait for its exit code
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(timeout=5)
        if closed or worker.process.poll() is not None:
            self._replace(worker, RewardCallFailed(_how_it_ended(_kill(worker))))

    def _enforce_deadline(self, worker: _Worker, call: PendingCall) -> None:
        deadline = self._deadline(worker)
        if deadline is None or time.monotonic() < deadline:
            return
        if worker.loading:
            error: BaseException = RewardCallFailed(
                f"did not load in its worker process within {LOAD_LIMIT_S:g}s: its worker process was killed"
            )
        elif self.time_limit_s is not None:
            error = RewardTimeout(f"took longer than {self.time_limit_s:g}s: its worker process was killed")
        else:
            error = RewardsAbandoned(
                f"{call.label} was still running {STOP_GRACE_S:g}s after the stop was requested (with no "
                "task.reward_timeout_s)"
            )
        _kill(worker)
        self._replace(worker, error)

    def _replace(self, worker: _Worker, error: BaseException) -> None:
        """The call of a killed or dead worker fails with `error`; a new worker takes its place."""
        call, worker.call = worker.call, None
        if call is not None:
            call.finish(error=error)
        self._workers[self._workers.index(worker)] = _start_worker()


def _with_recorders(values: dict[str, Any], swap: dict[int, Recorder]) -> dict[str, Any]:
    if not swap:
        return values
    return {key: swap.get(id(value), value) for key, value in values.items()}


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is None:
        return "ended its worker process (it could not be reaped)"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"ended its worker process by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    return f"ended its worker process with exit code {exitcode}"
