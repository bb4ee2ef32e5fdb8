"""Module paths that moved, each with its new path: when the package was laid out by trust (issue 48), and when
its packages were named for what they hold (issue 59: rollout/scoring.py -> rollout/rewards.py, agents/ ->
endpoint/, tasks/sandbox_settings.py -> sandbox/settings.py, scoring/ -> batch/, learner/update.py ->
learner/accounting.py). Every old path names the final one (no alias of an alias), and grpo-cli REMOVED_IN removes
them all.

An old path in a user's config, code or command keeps working until then: `install()` (run by
grpo_cli/__init__.py) puts one finder on sys.meta_path, so importing an old path (import, importlib, a
`module:attr` reference, a Hydra `_target_`, `python -m`) gives the new module itself, the same object (a patch of
one is a patch of the other), with a one-line MovedPathWarning naming the new path and the release that removes
the old one. No shim file stands at an old path: a shim in tasks/ would make tasks/ import the packages its old
modules moved to.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import CodeType, ModuleType

# The release that removes the old paths: two minor releases after the one that moved them (grpo-cli 0.1.0,
# pyproject.toml); the README and every MovedPathWarning say it.
REMOVED_IN = "0.3.0"

# old dotted path -> new dotted path
MOVED: dict[str, str] = {
    "grpo_cli.agents": "grpo_cli.endpoint",
    "grpo_cli.agents.recording": "grpo_cli.endpoint.recording",
    "grpo_cli.agents.requests": "grpo_cli.endpoint.requests",
    "grpo_cli.agents.server": "grpo_cli.endpoint.server",
    "grpo_cli.agents.verifiers_agent": "grpo_cli.endpoint.verifiers_agent",
    "grpo_cli.agents.vllm_front": "grpo_cli.endpoint.vllm_front",
    "grpo_cli.learner.update": "grpo_cli.learner.accounting",
    "grpo_cli.rollout.agent_episodes": "grpo_cli.endpoint.recording",
    "grpo_cli.rollout.agent_requests": "grpo_cli.endpoint.requests",
    "grpo_cli.rollout.agent_server": "grpo_cli.endpoint.server",
    "grpo_cli.rollout.agent_vllm": "grpo_cli.endpoint.vllm_front",
    "grpo_cli.rollout.base": "grpo_cli.engines.base",
    "grpo_cli.rollout.decode": "grpo_cli.engines.decode",
    "grpo_cli.rollout.engines": "grpo_cli.engines.build",
    "grpo_cli.rollout.episodes": "grpo_cli.episodes.turns",
    "grpo_cli.rollout.hf": "grpo_cli.engines.hf",
    "grpo_cli.rollout.hf_generate": "grpo_cli.engines.hf_generate",
    "grpo_cli.rollout.hf_internals": "grpo_cli.engines.hf_internals",
    "grpo_cli.rollout.loop_check": "grpo_cli.engines.loop_check",
    "grpo_cli.rollout.sampling": "grpo_cli.engines.sampling",
    "grpo_cli.rollout.scoring": "grpo_cli.rollout.rewards",
    "grpo_cli.rollout.stopping": "grpo_cli.engines.stopping",
    "grpo_cli.rollout.vllm_engine": "grpo_cli.engines.vllm_engine",
    "grpo_cli.rollout.vllm_server": "grpo_cli.engines.vllm_server",
    "grpo_cli.scoring": "grpo_cli.batch",
    "grpo_cli.scoring.batch": "grpo_cli.batch.rollout_data",
    "grpo_cli.scoring.forward": "grpo_cli.batch.forward",
    "grpo_cli.scoring.microbatches": "grpo_cli.batch.microbatches",
    "grpo_cli.scoring.plan": "grpo_cli.batch.plan",
    "grpo_cli.scoring.settings": "grpo_cli.batch.settings",
    "grpo_cli.tasks.agents": "grpo_cli.usercode.agents",
    "grpo_cli.tasks.awaiting": "grpo_cli.usercode.awaiting",
    "grpo_cli.tasks.builtin_tools": "grpo_cli.episodes.builtin_tools",
    "grpo_cli.tasks.cgroups": "grpo_cli.sandbox.cgroups",
    "grpo_cli.tasks.chat_roles": "grpo_cli.episodes.chat_roles",
    "grpo_cli.tasks.environments": "grpo_cli.episodes.environments",
    "grpo_cli.tasks.multiturn_config": "grpo_cli.episodes.config",
    "grpo_cli.tasks.openrlhf_agents": "grpo_cli.episodes.adapters.openrlhf",
    "grpo_cli.tasks.reward_workers": "grpo_cli.usercode.reward_workers",
    "grpo_cli.tasks.sandbox": "grpo_cli.sandbox",
    "grpo_cli.tasks.sandbox_bwrap": "grpo_cli.sandbox.bwrap",
    "grpo_cli.tasks.sandbox_prelude": "grpo_cli.sandbox.prelude",
    "grpo_cli.tasks.sandbox_privileges": "grpo_cli.sandbox.privileges",
    "grpo_cli.tasks.sandbox_settings": "grpo_cli.sandbox.settings",
    "grpo_cli.tasks.timelimit": "grpo_cli.usercode.timelimit",
    "grpo_cli.tasks.tool_calls": "grpo_cli.episodes.tool_calls",
    "grpo_cli.tasks.tools": "grpo_cli.episodes.tools",
    "grpo_cli.tasks.trl_environments": "grpo_cli.episodes.adapters.trl",
    "grpo_cli.tasks.user_code": "grpo_cli.usercode.user_code",
    "grpo_cli.tasks.verifiers_agent": "grpo_cli.endpoint.verifiers_agent",
}


class MovedPathWarning(FutureWarning):
    """An old module path was imported; the message names the new one. A FutureWarning, so a user sees it."""


def note(old: str) -> str:
    """The one line said when `old` is imported."""
    return f"{old} moved to {MOVED[old]}: use {MOVED[old]} (the old path is an alias until grpo-cli {REMOVED_IN})"


class _Alias(importlib.abc.Loader):
    """Loads an old path as the new module itself."""

    def __init__(self, old: str) -> None:
        self.old = old
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(note(self.old), MovedPathWarning, stacklevel=2)
        module = importlib.import_module(MOVED[self.old])
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # importlib gave the module the old path's spec; it stays the module of its new path.
        module.__spec__ = self.spec

    def get_code(self, fullname: str) -> CodeType | None:
        """`python -m <old path>` runs the new module's code (runpy asks for it)."""
        print(note(self.old), file=sys.stderr)
        spec = importlib.util.find_spec(MOVED[self.old])
        loader = spec.loader if spec is not None else None
        return loader.get_code(MOVED[self.old]) if isinstance(loader, importlib.abc.InspectLoader) else None


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of MOVED, before the path finder: a moved package's old path is the new package itself,
    whose __path__ is the new folder, so the path finder would load `<old package>.<module>` from there a second
    time, as another module. No file stands at an old path (tests/unit/project/test_moved_paths.py), so nothing
    real is shadowed."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        new = importlib.util.find_spec(MOVED[fullname])
        origin = new.origin if new is not None else None
        return importlib.machinery.ModuleSpec(fullname, _Alias(fullname), origin=origin)


def install() -> None:
    """Put the finder first on sys.meta_path, once (it answers only the names in MOVED)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
