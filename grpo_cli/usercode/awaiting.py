"""User code may be written async (TRL's docs' tools, verl's `@function_tool` examples, OpenRLHF's agents, async
reward functions): its result is awaited here, where the call is made (a reward or tool worker process, the
environment's worker), so the time limits that bound the call bound the awaiting too.

One implementation for every caller: :func:`resolved` takes what a user function returned and gives its value.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from typing import Any


def resolved(value: Any) -> Any:
    """`value`, or what it resolves to when it is awaitable (a coroutine from an ``async def``, a future).

    Without a running event loop in this thread the awaitable runs to completion on a fresh loop
    (``asyncio.run``); inside one (user code called from async code) it runs on its own loop in a helper thread,
    since a running loop cannot be re-entered. An exception of the user's code is raised as it was."""
    if not inspect.isawaitable(value):
        return value
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_awaited(value))
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
