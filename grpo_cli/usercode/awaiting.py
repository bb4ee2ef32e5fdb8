"""User code may be written async (TRL's docs' tools, verl's `@function_tool` examples, OpenRLHF's agents, async
reward functions, an OpenAI Agents SDK agent): its result is awaited here, where the call is made (a reward or tool
worker process, the environment's worker, an agent's thread), so the time limits that bound the call bound the
awaiting too.

One implementation for every caller: :func:`resolved` takes what a user function returned and gives its value.

One event loop per process, long-lived, run by its own daemon thread (as endpoint/verifiers_agent.py keeps its own):
every call's awaitable runs on it, whichever thread makes the call. User code keeps objects bound to the loop they
were made on across calls: an `AsyncOpenAI` client made in one call, or one the SDK caches, is closed (its
`aclose()` scheduled when it is garbage-collected) on the loop that made it. With a fresh `asyncio.run` loop per
call that loop was gone by then, and every episode ended with "Task exception was never retrieved ...
RuntimeError('Event loop is closed')" and a 30-line traceback. The loop is stopped and closed when the process
exits (its pending tasks cancelled, its async generators finalized): no "unclosed event loop" warning.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import inspect
import os
import threading
from typing import Any

# How often a waiting caller's thread runs Python bytecode: the in-process time limit (usercode/timelimit.py)
# interrupts a thread only between bytecodes, never inside one long wait.
_POLL_S = 0.05

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
_pid: int | None = None  # the process the loop belongs to (a forked child starts its own)


def resolved(value: Any) -> Any:
    """`value`, or what it resolves to when it is awaitable (a coroutine from an ``async def``, a future), awaited
    on this process's long-lived loop. Called from that loop's own thread (user code on the loop calling back into
    a sync call site), the awaitable runs on a fresh loop in a helper thread instead, since a running loop cannot
    wait for itself. An exception of the user's code is raised as it was; one raised in the waiting thread (a time
    limit's interrupt) cancels the awaitable."""
    if not inspect.isawaitable(value):
        return value
    loop = process_loop()
    if _thread is threading.current_thread():
        return _on_a_helper_thread(value)
    future = asyncio.run_coroutine_threadsafe(_awaited(value), loop)
    try:
        while True:
            try:
                return future.result(timeout=_POLL_S)
            except concurrent.futures.TimeoutError:
                continue
    except BaseException:
        future.cancel()
        raise


def process_loop() -> asyncio.AbstractEventLoop:
    """This process's long-lived event loop, started on first use (a daemon thread runs it until the process
    exits)."""
    global _loop, _thread, _pid
    with _lock:
        if _loop is None or _pid != os.getpid() or _loop.is_closed():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=_run_forever, args=(loop,), name="grpo-cli-async", daemon=True)
            thread.start()
            _loop, _thread, _pid = loop, thread, os.getpid()
        return _loop


def close_process_loop() -> None:
    """Stop and close this process's loop (at exit; a later `resolved` starts a new one): its pending tasks are
    cancelled and awaited, its async generators and default executor shut down."""
    global _loop, _thread
    with _lock:
        loop, thread, mine = _loop, _thread, _pid == os.getpid()
        _loop = _thread = None
    if loop is None or loop.is_closed() or not mine or thread is None:
        return
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5.0)
    if thread.is_alive():  # a coroutine blocks the loop (user code that never yields): leave it to the exit
        return
    try:
        pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        loop.close()


def _run_forever(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    loop.run_forever()


def _on_a_helper_thread(value: Any) -> Any:
    """`value` awaited on a fresh loop in a helper thread (the caller's thread runs the process loop itself)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = asyncio.run(_awaited(value))
        except BaseException as error:  # noqa: BLE001 - handed back to the caller's thread as is
            outcome["error"] = error

    thread = threading.Thread(target=run, name="grpo-cli-await", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


async def _awaited(value: Any) -> Any:
    return await value


atexit.register(close_process_loop)
