"""The suite's parallel workers (tests/conftest.py, "Parallel workers"), on a generated suite of sleeping tests run
as the README's test command runs the real one (`-n 2 --dist loadgroup`): a test marked `alone` runs while no other
test does, the tests of one resource of the machine (Ray, vLLM, torch.distributed ports) run on one worker, and so
do the tests that share a module-scoped fixture."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytest.importorskip("xdist")  # the [dev] extra's; the other CI venvs install plain pytest

# Each test sleeps 0.4 s and records when it ran and on which worker; CLOCK_MONOTONIC is one clock for the machine.
SUITE = """
import json, os, time

import pytest


def record(name):
    start = time.monotonic()
    time.sleep(0.4)
    line = {"name": name, "start": start, "end": time.monotonic(), "worker": os.environ["PYTEST_XDIST_WORKER"]}
    with open(os.environ["RECORD"], "a") as out:
        out.write(json.dumps(line) + "\\n")


@pytest.fixture(scope="module")
def built_once():
    return object()


@pytest.mark.parametrize("i", range(8))
def test_free(i):
    record(f"free{i}")


@pytest.mark.alone
@pytest.mark.parametrize("i", range(2))
def test_alone(i):
    record(f"alone{i}")


@pytest.mark.machine_wide
@pytest.mark.parametrize("i", range(2))
def test_ranks(i):
    record(f"ports{i}")


@pytest.mark.machine_wide("ray")
def test_ray_without_its_fixture():
    record("ray0")


def test_ray(ray_installed):
    record("ray1")


@pytest.mark.vllm
@pytest.mark.parametrize("i", range(2))
def test_engine(i):
    record(f"vllm{i}")


@pytest.mark.parametrize("i", range(3))
def test_shares_a_module_fixture(built_once, i):
    record(f"module{i}")


@pytest.fixture
def ray_installed():  # the name is what counts: this one starts nothing
    return None
"""

CONFTEST = "from tests.conftest import OneAtATime, pytest_collection_modifyitems, pytest_configure  # noqa: F401\n"
MARKERS = "[pytest]\nmarkers =\n    alone: x\n    machine_wide: x\n    vllm: x\n"


def test_alone_tests_run_alone_and_each_group_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text(MARKERS)
    record = tmp_path / "record.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "RECORD": str(record)}
    command = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider", "-q"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = {row["name"]: row for row in map(json.loads, record.read_text().splitlines())}
    assert len(runs) == 19
    # Two workers really ran side by side (else "alone" would hold trivially): some free tests overlapped.
    free = [runs[f"free{i}"] for i in range(8)]
    assert {run["worker"] for run in free} == {"gw0", "gw1"}
    assert any(a["start"] < b["end"] and b["start"] < a["end"] for a in free for b in free if a is not b)
    for name in ("alone0", "alone1"):
        alone = runs[name]
        beside = [other for other in runs.values() if other["start"] < alone["end"] and alone["start"] < other["end"]]
        assert beside == [alone], (name, beside)
    for group in ("ports", "ray", "vllm", "module"):
        assert len({run["worker"] for name, run in runs.items() if name.startswith(group)}) == 1, group


def test_the_integration_mark_is_exactly_the_machine_wide_groups(tmp_path: Path) -> None:
    """The README's test command leaves out `-m integration`, which .ci/run then runs: the Ray, vLLM and ranks
    tests, however each joined its group, and nothing else."""
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text(MARKERS + "    integration: x\n")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    selected = {}
    for expression in ("integration", "not integration"):
        command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", expression]
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        ids = [line for line in result.stdout.splitlines() if "::" in line]
        selected[expression] = {line.split("::")[1].split("[")[0] for line in ids}
    assert selected["integration"] == {"test_ranks", "test_ray_without_its_fixture", "test_ray", "test_engine"}
    assert selected["not integration"] == {"test_free", "test_alone", "test_shares_a_module_fixture"}
