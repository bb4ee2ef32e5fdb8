"""The Ray executors' actors and how they are called (grpo_cli/drivers/ray_actors.py, ray_run.py): the two executors
hold the run's Ray as a component (neither inherits the other), every actor method is called through a typed handle
of the same name and parameters, never by a name in a string, and closing stops every actor once. The actors
themselves run in tests/e2e/test_sync_strategies_e2e.py and test_async_e2e.py."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import grpo_cli.drivers.ray_run
from grpo_cli.drivers.async_executor import AsyncExecutor
from grpo_cli.drivers.ray_actors import (
    AsyncGeneratorHandle,
    GeneratorHandle,
    Handle,
    HostedAsyncGenerator,
    HostedGenerator,
    HostedLearner,
    LearnerHandle,
)
from grpo_cli.drivers.ray_executor import RayExecutor
from grpo_cli.drivers.ray_run import RayRun
from grpo_cli.learner.learner import Learner
from grpo_cli.rollout.async_generation import AsyncGeneration
from grpo_cli.rollout.worker import RolloutWorker
from tests.unit.drivers.test_async import FakeActor, FakeRay

HANDLES = (LearnerHandle, GeneratorHandle, AsyncGeneratorHandle)
# What each actor hosts: the object its methods forward to.
HOSTS = {HostedLearner: Learner, HostedGenerator: RolloutWorker, HostedAsyncGenerator: AsyncGeneration}


def methods(cls: type) -> dict[str, inspect.Signature]:
    """The public methods `cls` defines or inherits from its own package's classes, by name."""
    return {
        name: inspect.signature(member)
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_") and member.__module__.startswith("grpo_cli")
    }


def parameters(signature: inspect.Signature) -> list[str]:
    # `_ray_trace_ctx`: the parameter Ray's tracing hook adds to an actor class's methods once ray.remote has wrapped
    # it in this process (another test's run), not one of ours
    return [name for name in signature.parameters if name not in ("self", "_ray_trace_ctx")]


def test_the_async_executor_holds_the_ray_run_and_inherits_nothing_of_the_ray_executor():
    assert not issubclass(AsyncExecutor, RayExecutor) and not issubclass(RayExecutor, AsyncExecutor)
    # Starting Ray, placing the actors, fetching results and stopping them are the component's alone.
    for shared in ("start_ray", "check_nodes", "get", "get_all", "check_loads"):
        assert hasattr(RayRun, shared)
        assert not hasattr(AsyncExecutor, shared) and not hasattr(RayExecutor, shared), shared


@pytest.mark.parametrize("handle", HANDLES, ids=lambda h: h.__name__)
def test_each_handle_has_every_method_of_its_actor_with_the_same_parameters(handle: type[Handle]):
    hosted = methods(handle.hosted)
    calls = {name: sig for name, sig in methods(handle).items() if name != "role"}
    assert set(calls) == set(hosted), f"{handle.__name__} and {handle.hosted.__name__} differ"
    for name, signature in calls.items():
        assert parameters(signature) == parameters(hosted[name]), f"{handle.__name__}.{name}"


@pytest.mark.parametrize("hosted", list(HOSTS), ids=lambda h: h.__name__)
def test_each_actor_method_forwards_to_the_hosted_object_s_method_of_that_name(hosted: type):
    target = methods(HOSTS[hosted])
    for name, signature in methods(hosted).items():
        if name in ("start", "check_node"):  # the actor's own: building its object, the cluster's node check
            continue
        assert name in target, f"{hosted.__name__}.{name}: {HOSTS[hosted].__name__} has no {name}"
        # The actor passes its parameters on by name, in order (RolloutWorker.evaluate's progress callback, which
        # an actor cannot call back with, is left out).
        own, theirs = parameters(signature), parameters(target[name])
        assert [p for p in theirs if p in own] == own, f"{hosted.__name__}.{name}{own} vs {theirs}"


@pytest.mark.parametrize("handle", HANDLES, ids=lambda h: h.__name__)
def test_a_handle_calls_the_actor_method_it_is_named_for_with_its_arguments(handle: type[Handle]):
    actor = FakeActor()
    wrapped = handle(actor)
    for name, signature in methods(handle).items():
        if name == "role":
            continue
        args = tuple(f"{name}:{p}" for p in parameters(signature))
        assert getattr(wrapped, name)(*args) == (name, *args)
    assert [call[0] for call in actor.calls] == [n for n in methods(handle) if n != "role"]


def test_no_actor_method_is_called_by_a_name_in_a_string():
    package = Path(grpo_cli.drivers.ray_run.__file__).parent
    spelled = re.compile(r"""\.remote\(\s*["']|getattr\([^)]*,\s*["']""")
    offenders = [
        f"{path.name}:{n}"
        for path in sorted(package.glob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if spelled.search(line)
    ]
    assert not offenders


def test_closing_stops_every_actor_once_and_asks_the_generators_to_release_first_only_when_told():
    learner, generators = FakeActor(), [FakeActor(), FakeActor()]
    run = RayRun(FakeRay, Path("unused"), LearnerHandle(learner), [AsyncGeneratorHandle(g) for g in generators])
    run.close(generators_close_s=70)
    run.close()  # safe more than once: nothing called again
    assert [g.calls for g in generators] == [[("close",), ("killed",)]] * 2
    assert learner.calls == [("killed",)]
    generator = FakeActor()
    RayRun(FakeRay, Path("unused"), LearnerHandle(FakeActor()), [GeneratorHandle(generator)]).close()
    assert generator.calls == [("killed",)]  # a batch in flight: killed without waiting for it
