"""The agents' runner in a worker (grpo_cli/usercode/agents.py): each agent's task.agent_timeout_s runs from its own
start, all of a share's agents at once, so stuck agents do not add their limits up."""

from __future__ import annotations

import socket
import threading
import time

from grpo_cli.usercode.agents import AgentJob, run_agents


def closed_port() -> int:
    """A loopback port nothing listens on: a report there fails at once (the endpoint has gone)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_stuck_agents_are_timed_out_together_not_one_after_another() -> None:
    release = threading.Event()

    def stuck(row, base_url):
        release.wait(30)

    end_url = f"http://127.0.0.1:{closed_port()}/ep/end"
    jobs = [AgentJob({"i": i}, [], "http://127.0.0.1:1/v1", "key", "m", end_url) for i in range(4)]
    started = time.monotonic()
    try:
        left = run_agents(stuck, jobs, timeout_s=0.5)
    finally:
        release.set()
    took = time.monotonic() - started
    # Joined one after another with 0.5 s each, four stuck agents took 2.0 s: the limit is each agent's own.
    assert left == {"left_running": 4}
    assert took < 1.5, took
