"""call_with_time_limit: interrupts runaway Python code in any thread, nests, and leaves nothing behind."""

import threading
import time

import pytest

from grpo_cli.usercode.timelimit import RewardTimeout, call_with_time_limit


def busy(seconds: float) -> str:
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:  # a Python loop, like sympy's slow paths
        x += 1
    return "finished"


def test_fast_calls_return_their_value():
    assert call_with_time_limit(1.0, lambda a, b=0: a + b, 2, b=3) == 5
    assert call_with_time_limit(None, busy, 0.01) == "finished"  # None: no limit
    assert call_with_time_limit(0, busy, 0.01) == "finished"


@pytest.mark.alone  # a wall-clock bound
def test_a_runaway_call_is_interrupted_close_to_its_limit():
    start = time.perf_counter()
    with pytest.raises(RewardTimeout, match="busy took longer than 0.2s"):
        call_with_time_limit(0.2, busy, 30)
    assert time.perf_counter() - start < 1.0


def test_exceptions_of_the_call_pass_through():
    def fail():
        raise KeyError("boom")

    with pytest.raises(KeyError):
        call_with_time_limit(1.0, fail)


def test_works_in_a_worker_thread():
    outcome = []

    def work():
        try:
            call_with_time_limit(0.2, busy, 30)
        except RewardTimeout:
            outcome.append("timed out")

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=10)
    assert outcome == ["timed out"]


def test_a_call_that_swallows_the_interrupt_is_interrupted_again():
    caught = []

    def stubborn():
        for _ in range(2):
            try:
                busy(30)
            except BaseException:  # noqa: BLE001 - what careless library code does
                caught.append(1)
        busy(30)

    with pytest.raises(RewardTimeout):
        call_with_time_limit(0.2, stubborn)
    assert len(caught) == 2


def test_limits_nest_and_each_one_reports_its_own_timeout():
    def inner_times_out():
        try:
            call_with_time_limit(0.1, busy, 30)
        except RewardTimeout:
            return "inner timed out"

    assert call_with_time_limit(5.0, inner_times_out) == "inner timed out"

    def outer_fires_first():
        try:
            call_with_time_limit(30.0, busy, 30)
        except RewardTimeout:  # must not catch the outer limit's interrupt as its own
            return "wrong guard"

    with pytest.raises(RewardTimeout, match="outer_fires_first"):
        call_with_time_limit(0.2, outer_fires_first)


def test_no_interrupt_arrives_after_the_call_returned():
    for _ in range(200):
        call_with_time_limit(0.001, lambda: None)
    assert busy(0.2) == "finished"  # a stray interrupt would raise here
