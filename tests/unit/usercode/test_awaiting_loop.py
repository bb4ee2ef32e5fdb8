"""usercode/awaiting.resolved awaits every call on one long-lived event loop per process: what user code makes on
the loop in one call (a lock; an AsyncOpenAI client: tests/e2e/test_edge_cases_e2e.py) works in the next call; a time
limit's interrupt cancels the call; and the loop is closed when the process exits, without a warning."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest

from grpo_cli.usercode.awaiting import process_loop, resolved
from grpo_cli.usercode.timelimit import RewardTimeout, call_with_time_limit
from tests.conftest import REPO_ROOT


def test_a_lock_made_in_one_call_works_in_the_next_and_the_loop_is_one() -> None:
    made: dict[str, asyncio.Lock] = {}

    async def locked() -> asyncio.AbstractEventLoop:
        lock = made.setdefault("lock", asyncio.Lock())
        async with lock:  # a lock is bound to the loop that first used it
            return asyncio.get_running_loop()

    loops = [resolved(locked()), resolved(locked())]
    assert loops[0] is loops[1] is process_loop()


def test_a_time_limit_interrupts_the_waiting_call_and_cancels_it() -> None:
    cancelled = threading.Event()

    async def stuck() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    started = time.monotonic()
    with pytest.raises(RewardTimeout):
        call_with_time_limit(0.3, lambda: resolved(stuck()))
    assert time.monotonic() - started < 5 and cancelled.wait(5)


def test_the_loop_is_closed_when_the_process_exits_without_a_warning() -> None:
    # The check's exit hook is registered before awaiting's, so it runs after awaiting closed the loop.
    program = (
        "import atexit, asyncio\n"
        "seen = {}\n"
        "atexit.register(lambda: print('closed', seen['loop'].is_closed()))\n"
        "from grpo_cli.usercode.awaiting import resolved\n"
        "async def pending():\n"
        "    asyncio.get_running_loop().create_task(asyncio.sleep(60))  # left pending: cancelled at exit\n"
        "    seen['loop'] = asyncio.get_running_loop()\n"
        "    return 1\n"
        "assert resolved(pending()) == 1\n"
    )
    result = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "always::ResourceWarning", "-c", program],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "closed True"
    assert "unclosed" not in result.stderr and "was destroyed but it is pending" not in result.stderr, result.stderr
