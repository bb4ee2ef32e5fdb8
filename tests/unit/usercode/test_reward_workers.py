"""task.reward_workers: the user's reward functions run in worker processes that are killed at the time limit.

What no in-process limit can stop (a C call that blocks: time.sleep, a catastrophic regex; sys.exit; os._exit)
becomes that reward's error, decided by task.on_reward_error; workers score in parallel with the same values as
one process; and no worker outlives its pool or its parent. The scoring tests call the real task=custom reward
(make_reward_fn); the pool's own guarantees are tested on its API; the signal path runs the real `grpo-run`.
"""

from __future__ import annotations

import functools
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from grpo_cli.errors import RewardFunctionError
from grpo_cli.rollout.rewards import score_responses
from grpo_cli.tasks import load_examples, make_reward_fn
from tests.unit.tasks.test_custom_task import custom_cfg, rows_jsonl, write

# Each test's limit (s): far below how long its function blocks, so "stopped at the limit" cannot be luck.
LIMIT_S = 1.0
# What "stopped at the limit" allows: a worker's start (an interpreter and this package's imports, seconds on a
# busy 2-core machine), the limit, the kill. The functions below block for 40 s or more.
STOPPED_WITHIN_S = 20.0

REWARDS_PY = """
import os
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent

def sleeps_in_c(completions, **kwargs):
    time.sleep(40)  # one C call: nothing inside the calling process can interrupt it
    return [1.0 for _ in completions]

def sleeps_per_sample(response, row):
    time.sleep(40)
    return 1.0

def catastrophic_regex(completions, **kwargs):
    # (a+)+$ backtracks exponentially on a's then a b: minutes in the regex engine, which holds the GIL
    return [float(re.match(r"(a+)+$", "a" * 30 + "b") is not None) for _ in completions]

def exits(completions, **kwargs):
    sys.exit(3)

def hard_exit(completions, **kwargs):
    os._exit(7)

def fmt(completions, **kwargs):
    return [1.0 if c.startswith("<") else 0.0 for c in completions]

def words(completions, word, **kwargs):
    return [None if w == "skip" else float(w in c) for c, w in zip(completions, word)]

def length(response, row):
    return None if row["word"] == "skip" else len(response) / 10

def process_id(completions, **kwargs):
    return [float(os.getpid()) for _ in completions]

def _meet(mine, theirs, completions):
    # Arrive, then wait for the other function: both return 1 only when they ran at the same time.
    (HERE / mine).touch()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if (HERE / theirs).exists():
            return [1.0 for _ in completions]
        time.sleep(0.02)
    return [0.0 for _ in completions]

def meet_a(completions, **kwargs):
    return _meet("a.arrived", "b.arrived", completions)

def meet_b(completions, **kwargs):
    return _meet("b.arrived", "a.arrived", completions)
"""


@pytest.fixture
def folder(tmp_path):
    rows = [{"q": f"question {i}", "word": ["a", "b", "skip"][i % 3]} for i in range(6)]
    return write(tmp_path, {"rewards.py": REWARDS_PY, "train.jsonl": rows_jsonl(rows)})


def reward_of(folder: Path, functions: dict[str, str], **keys):
    cfg = custom_cfg(folder, rewards={name: f"rewards.py:{fn}" for name, fn in functions.items()}, **keys)
    return make_reward_fn(cfg), [e.ground_truth for e in load_examples(cfg, "train")]


def close(reward) -> None:
    """Stop the reward's worker processes (as RolloutWorker.close does: a reward without workers has no close)."""
    getattr(reward, "close", lambda: None)()


def timed_scoring(reward, responses, truths):
    started = time.monotonic()
    try:
        return score_responses(reward, responses, truths), time.monotonic() - started
    finally:
        close(reward)


# ------------------------------------------------------------------------------ what in-process limits miss


@pytest.mark.alone  # a wall-clock bound
@pytest.mark.parametrize(
    ("function", "convention"),
    [("sleeps_in_c", "trl"), ("sleeps_per_sample", "per_sample"), ("catastrophic_regex", "trl")],
)
def test_a_reward_blocked_in_c_is_that_rewards_timeout_at_the_limit(folder, function, convention):
    reward, truths = reward_of(folder, {"stuck": function}, reward_timeout_s=LIMIT_S, reward_convention=convention)
    started = time.monotonic()
    with pytest.raises(RewardFunctionError) as info:
        score_responses(reward, ["<a", "b"], truths[:2])
    assert time.monotonic() - started < STOPPED_WITHIN_S
    message = str(info.value)
    assert "\n" not in message and f"rewards.py:{function} ran past task.reward_timeout_s=1s" in message
    close(reward)

    # skip: the stuck function gives no reward, the others still score, and the run goes on
    functions = {"stuck": function, "fmt": "fmt"} if convention == "trl" else {"stuck": function}
    reward, truths = reward_of(
        folder, functions, reward_timeout_s=LIMIT_S, reward_convention=convention, on_reward_error="skip"
    )
    scores, took = timed_scoring(reward, ["<a", "b"], truths[:2])
    assert took < STOPPED_WITHIN_S * (1 if convention == "trl" else 2)  # per_sample: each sample stops alone
    assert scores.n_timeouts == 2 and scores.n_errors == 0
    assert [r["reward"] for r in scores.rewards] == ([1.0, 0.0] if convention == "trl" else [0.0, 0.0])


@pytest.mark.parametrize(
    ("function", "said"),
    [("exits", "called sys.exit(3)"), ("hard_exit", "ended its worker process with exit code 7")],
)
def test_an_exit_in_a_reward_is_that_rewards_error_and_on_reward_error_decides(folder, function, said):
    reward, truths = reward_of(folder, {"bad": function})
    with pytest.raises(RewardFunctionError) as info:
        score_responses(reward, ["<a", "b"], truths[:2])
    message = str(info.value)
    assert "\n" not in message and f"rewards.py:{function} {said} on row" in message
    assert '"q": "question 0"' in message and "task.on_reward_error=skip" in message
    close(reward)

    reward, truths = reward_of(folder, {"bad": function, "fmt": "fmt"}, on_reward_error="skip")
    try:
        # the batch fails, then each row alone (a new worker after each os._exit): no reward from it, none lost
        first = score_responses(reward, ["<a", "b"], truths[:2])
        again = score_responses(reward, ["<c", "<d"], truths[:2])  # the same reward keeps scoring
    finally:
        close(reward)
    assert first.n_errors == 2 and [r["reward"] for r in first.rewards] == [1.0, 0.0]
    assert again.n_errors == 2 and [r["reward"] for r in again.rewards] == [1.0, 1.0]


# ------------------------------------------------------------------------------------- parallel and serial


def test_workers_score_in_parallel_with_the_same_values_as_one_process(folder):
    responses = ["<a", "b", "<skip", "a b", "<", "xyz"]
    functions = {"fmt": "fmt", "words": "words"}
    by_workers = {}
    for workers in (0, 1, 2):
        trl, truths = reward_of(folder, functions, reward_workers=workers)
        per_sample, _ = reward_of(folder, {"length": "length"}, reward_convention="per_sample", reward_workers=workers)
        try:
            by_workers[workers] = [score_responses(r, responses, truths).rewards for r in (trl, per_sample)]
        finally:
            close(trl)
            close(per_sample)
    assert by_workers[0] == by_workers[1] == by_workers[2]
    trl_rewards, per_sample_rewards = by_workers[0]
    assert [r["reward"] for r in trl_rewards] == [2.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert [r.get("reward/length") for r in per_sample_rewards] == [0.2, 0.1, None, 0.3, 0.1, None]

    # Each of two functions returns 1 only if the other one runs at the same time (one after the other, the
    # first waits in vain and returns 0): with 2 workers they do.
    reward, truths = reward_of(folder, {"a": "meet_a", "b": "meet_b"}, reward_workers=2, reward_timeout_s=30)
    scores, _ = timed_scoring(reward, ["x"], truths[:1])
    assert (scores.rewards[0]["reward/a"], scores.rewards[0]["reward/b"]) == (1.0, 1.0)


def test_reward_workers_0_calls_the_functions_in_this_process_as_before(folder):
    pids = {}
    for workers in (0, 1):
        reward, truths = reward_of(folder, {"pid": "process_id"}, reward_workers=workers)
        scores, _ = timed_scoring(reward, ["x"], truths[:1])
        pids[workers] = scores.rewards[0]["reward"]
    assert pids[0] == os.getpid() and pids[1] != os.getpid()


# ----------------------------------------------------------------------------------------- the pool itself


def pool_folder(tmp_path: Path) -> Path:
    return write(
        tmp_path,
        {
            "logs.py": """
            def reward(completions, log_extra=None, log_metric=None, **kwargs):
                log_extra("judge", ["ok" for _ in completions])
                log_metric("length", sum(map(len, completions)) / len(completions))
                return [1.0 for _ in completions]

            def per_row(response, row):
                row["log_metric"]("chars", len(response))
                return 0.5

            def sleeps(seconds):
                import os, time
                print(os.getpid(), flush=True)  # on the caller's stdout, which the worker shares
                time.sleep(seconds)
                return seconds
            """
        },
    )


def loader(folder: Path, name: str):
    from grpo_cli.usercode.user_code import load_callable

    return functools.partial(load_callable, f"task.rewards.{name}", f"logs.py:{name}", folder)


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie has exited; only its parent's wait is missing)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_log_extra_and_log_metric_calls_in_a_worker_are_replayed_in_the_caller_in_order(tmp_path):
    from grpo_cli.usercode.reward_workers import RewardWorkers

    folder = pool_folder(tmp_path)
    calls = []
    callbacks = {
        "log_extra": lambda column, values: calls.append(("extra", column, values)),
        "log_metric": lambda name, value: calls.append(("metric", name, value)),
    }
    pool = RewardWorkers(2, time_limit_s=30)
    try:
        batches = (["ab", "abcd"], ["x"])
        pending = [
            pool.submit(loader(folder, "reward"), (), {"completions": c, **callbacks}, callbacks=callbacks)
            for c in batches
        ]
        # per_sample: the callbacks in the row
        row = {"q": "x", "log_metric": callbacks["log_metric"]}
        pending.append(pool.submit(loader(folder, "per_row"), ("abc", row), {}, callbacks=callbacks))
        assert calls == []  # nothing reaches the caller before it reads a result
        assert [p.result() for p in pending] == [[1.0, 1.0], [1.0], 0.5]
    finally:
        pool.close()
    assert calls == [
        ("extra", "judge", ["ok", "ok"]),
        ("metric", "length", 3.0),
        ("extra", "judge", ["ok"]),
        ("metric", "length", 1.0),
        ("metric", "chars", 3),
    ]


def test_no_worker_outlives_its_pool_its_garbage_collection_or_its_killed_parent(tmp_path):
    from grpo_cli.usercode.reward_workers import RewardWorkers

    folder = pool_folder(tmp_path)
    pool = RewardWorkers(2, time_limit_s=None)
    assert pool.submit(loader(folder, "sleeps"), (0,), {}).result() == 0
    pids = pool.pids()
    assert len(pids) == 2 and all(map(alive, pids))
    # Each in its own session (and process group): a terminal's Ctrl-C reaches only the caller, which finishes its
    # step, and killing the group ends whatever the user's code started.
    assert [os.getsid(pid) for pid in pids] == pids and [os.getpgid(pid) for pid in pids] == pids
    os.kill(pids[0], signal.SIGKILL)  # an idle worker that died (the OOM killer) is replaced on the next call
    while alive(pids[0]):
        time.sleep(0.01)
    assert [pool.submit(loader(folder, "sleeps"), (0,), {}).result() for _ in range(3)] == [0, 0, 0]
    pids += pool.pids()
    pool.close()
    assert not any(map(alive, pids))

    pool = RewardWorkers(1, time_limit_s=None)
    pool.submit(loader(folder, "sleeps"), (0,), {}).result()
    pids = pool.pids()
    del pool
    gc.collect()
    assert not any(map(alive, pids))

    # A parent killed outright (SIGKILL: no cleanup of its own runs) while its worker is stuck in a call.
    script = f"""
    import functools, sys, time
    from grpo_cli.usercode.reward_workers import RewardWorkers
    from grpo_cli.usercode.user_code import load_callable
    pool = RewardWorkers(1, time_limit_s=None)
    pending = pool.submit(functools.partial(load_callable, "k", "logs.py:sleeps", {str(folder)!r}), (600,), {{}})
    pending.result()  # the worker prints its pid, then sleeps
    """
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, text=True, cwd=folder
    )
    worker_pid = int(parent.stdout.readline())
    assert alive(worker_pid)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while alive(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(worker_pid)


# ---------------------------------------------------------------------------------- signals, end to end
