"""The module paths that moved in the layout by trust (grpo_cli/moved.py) still import, as the new module,
with a one-line note naming the new path: by import, a `module:attr` reference, a Hydra `_target_` and `python -m`."""

from __future__ import annotations

import importlib
import importlib.machinery
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from hydra.utils import get_class, get_method
from packaging.version import Version

import grpo_cli
from grpo_cli.moved import MOVED, REMOVED_IN, MovedPathWarning, note
from grpo_cli.usercode.user_code import load_callable

PACKAGE_ROOT = Path(grpo_cli.__file__).parent
REPO_ROOT = PACKAGE_ROOT.parent


def forget(old: str) -> None:
    """The old path out of sys.modules, so that the next import goes through the finder again; a moved package
    above it imported first (its own note is its own test's), so the note counted is the old path's alone whatever
    test ran before on this worker."""
    sys.modules.pop(old, None)
    parent = old.rpartition(".")[0]
    if parent in MOVED:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MovedPathWarning)
            importlib.import_module(parent)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_imports_the_new_module_with_a_note(old):
    forget(old)
    with pytest.warns(MovedPathWarning) as caught:
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
    assert module.__name__ == MOVED[old] and module.__spec__.name == MOVED[old]  # the module stays its new self
    assert [str(w.message) for w in caught] == [note(old)] and MOVED[old] in note(old)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_no_file_stands_at_an_old_path(old):
    """The alias is found only because nothing else is: a module left at the old path would shadow the move."""
    parent, _, leaf = old.rpartition(".")
    folder = PACKAGE_ROOT.joinpath(*parent.split(".")[1:])
    assert not (folder / f"{leaf}.py").exists() and not (folder / leaf / "__init__.py").exists()
    assert importlib.util.find_spec(MOVED[old]) is not None


def test_references_the_docs_named_before_the_move_still_load():
    """The paths conf/, docs/ and examples/ named before the move, as a user's config writes them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MovedPathWarning)
        for old in (
            "grpo_cli.tasks.builtin_tools",
            "grpo_cli.tasks.environments",
            "grpo_cli.tasks.verifiers_agent",
            "grpo_cli.tasks.openrlhf_agents",
        ):
            forget(old)
        python = load_callable("task.tools.python", "grpo_cli.tasks.builtin_tools:python", PACKAGE_ROOT)
        calculator = load_callable("task.tools.calculator", "grpo_cli.tasks.builtin_tools:calculator", PACKAGE_ROOT)
        skyrl = get_class("grpo_cli.tasks.environments.SkyRLGymEnvironment")
        agent = get_method("grpo_cli.tasks.verifiers_agent.verifiers_agent")
        openrlhf_agent = get_class("grpo_cli.tasks.openrlhf_agents.OpenRLHFAgent")
    from grpo_cli.endpoint import verifiers_agent
    from grpo_cli.episodes import builtin_tools, environments
    from grpo_cli.episodes.adapters import openrlhf

    assert (python, calculator) == (builtin_tools.python, builtin_tools.calculator)
    assert skyrl is environments.SkyRLGymEnvironment and openrlhf_agent is openrlhf.OpenRLHFAgent
    assert agent is verifiers_agent.verifiers_agent


def test_python_dash_m_runs_the_moved_module_and_says_where_it_went():
    old = "grpo_cli.tasks.verifiers_agent"
    done = subprocess.run([sys.executable, "-m", old, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert note(old) in done.stderr
    new = subprocess.run([sys.executable, "-m", MOVED[old], "--help"], capture_output=True, text=True, timeout=120)
    assert done.stdout == new.stdout  # the same program


def test_every_old_path_names_a_final_path():
    """No alias of an alias: an old path moved twice names where it is now, and every new path is a real module."""
    assert not set(MOVED.values()) & set(MOVED), sorted(set(MOVED.values()) & set(MOVED))
    for new in MOVED.values():
        assert importlib.util.find_spec(new) is not None, new


def test_a_moved_packages_modules_are_the_new_modules():
    """grpo_cli.agents (a package) is grpo_cli.endpoint, and grpo_cli.agents.server the very module
    grpo_cli.endpoint.server, not a second copy loaded from the new folder under the old name."""
    for old in ("grpo_cli.agents.server", "grpo_cli.agents"):
        forget(old)
    with pytest.warns(MovedPathWarning):
        server = importlib.import_module("grpo_cli.agents.server")
    from grpo_cli.endpoint import server as new_server

    assert server is new_server and "grpo_cli.agents.server" not in {m.__name__ for m in sys.modules.values()}


def test_the_release_that_removes_the_old_paths_is_stated():
    """moved.py names it (two minor releases after this one), every warning says it, and so does the README."""
    version = Version(grpo_cli.__version__)
    assert Version(REMOVED_IN) == Version(f"{version.major}.{version.minor + 2}.0")
    assert all(f"until grpo-cli {REMOVED_IN}" in note(old) for old in MOVED)
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert f"until {REMOVED_IN}" in readme and "grpo_cli/moved.py" in readme
