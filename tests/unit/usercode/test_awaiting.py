"""usercode/awaiting.py: async user code's results are awaited where the call is made."""

from __future__ import annotations

import asyncio

import pytest

from grpo_cli.usercode.awaiting import resolved


async def add(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a + b


async def fails() -> None:
    await asyncio.sleep(0)
    raise ValueError("user bug")


class AsyncCallable:
    async def __call__(self, x: int) -> int:
        return 2 * x


def test_plain_values_pass_through_and_coroutines_are_awaited():
    assert resolved(3) == 3
    assert resolved(add(1, 2)) == 3
    assert resolved(AsyncCallable()(4)) == 8


def test_a_coroutine_is_awaited_inside_a_running_loop_too():
    async def caller() -> int:
        return resolved(add(2, 3))  # a sync call site reached from async code

    assert asyncio.run(caller()) == 5


def test_the_user_codes_exception_comes_back_as_it_was():
    with pytest.raises(ValueError, match="user bug"):
        resolved(fails())

    async def caller() -> None:
        resolved(fails())

    with pytest.raises(ValueError, match="user bug"):
        asyncio.run(caller())
