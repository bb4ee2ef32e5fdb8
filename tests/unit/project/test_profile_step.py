"""benchmarks/profile_step.py: each phase of a step is profiled in a range of its own, its operations attributed to
it (none twice), and the executor's classes are left as they were."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import torch

from tests.conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "profile_step.py"


def _module():
    spec = importlib.util.spec_from_file_location("profile_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Engine:
    def generate(self, a):
        return a @ a  # aten::mm


class BaseRun:
    def score(self, a):
        return a.sum()


class Run(BaseRun):  # score inherited: patched on Run, removed again after
    pass


class Learner:
    def learn(self, a, engine):
        return engine.generate(a).exp()  # a phase inside a phase: its mm belongs to generation only


class Worker:
    def sync_weights(self):
        return None


def test_each_phase_gets_its_own_operations_and_the_classes_are_restored():
    profile_step = _module()
    executor = SimpleNamespace(worker=Worker(), learner=Learner())
    executor.worker.engine, executor.worker.run = Engine(), Run()
    originals = {cls: dict(vars(cls)) for cls in (Engine, Run, Learner, Worker)}
    a = torch.randn(64, 64)
    with profile_step.phase_ranges(executor), torch.profiler.profile() as profile:
        executor.worker.engine.generate(a)
        executor.worker.run.score(a)
        executor.learner.learn(a, executor.worker.engine)
        executor.worker.sync_weights()
    tables = profile_step.phase_tables(profile.events(), step_us=1e6, top=10)
    ops = {name: {row["op"]: row["calls"] for row in table["top"]} for name, table in tables.items()}
    assert tables["generation"]["calls"] == 2 and ops["generation"]["aten::mm"] == 2
    assert "aten::sum" in ops["scoring"] and "aten::mm" not in ops["scoring"]
    assert "aten::exp" in ops["learn"] and "aten::mm" not in ops["learn"]  # counted once, in generation
    assert tables["weight sync"]["calls"] == 1
    for table in tables.values():
        assert 0 <= table["ops_s"] * 1e6 <= table["us"] + 1  # self times within the phase's own time
    assert {cls: dict(vars(cls)) for cls in originals} == originals  # nothing left patched
    assert "score" not in vars(Run)
