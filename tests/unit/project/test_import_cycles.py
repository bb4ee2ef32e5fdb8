"""Dependencies point one way: no import cycle between modules of grpo_cli (docs/architecture.md).

Every import statement counts: at module level, inside functions, and under `if TYPE_CHECKING:`; a package's
`__init__` that imports a submodule which imports the package back is a cycle too.
"""

from __future__ import annotations

from pathlib import Path

import grpo_cli
from tests.unit.project.import_graph import import_graph, write_package

PACKAGE_ROOT = Path(grpo_cli.__file__).parent


def import_cycles(root: Path) -> list[list[str]]:
    """Each strongly connected group of modules (a cycle) in the import graph of the package at `root`."""
    graph = import_graph(root)
    # Tarjan's strongly connected components, iteratively deep enough for any package of ours.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return cycles


def test_grpo_cli_has_no_import_cycle():
    cycles = import_cycles(PACKAGE_ROOT)
    assert not cycles, "import cycles (dependencies must point one way): " + "; ".join(
        " <-> ".join(group) for group in cycles
    )


def test_the_checker_sees_imports_inside_functions_and_under_type_checking(tmp_path):
    package = write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "def f():\n    from pkg import b\n",
            "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n",
            "pkg/c.py": "import pkg.a\n",
        },
    )
    assert import_cycles(package) == [["pkg.a", "pkg.b"]]


def test_the_checker_sees_a_package_init_importing_a_submodule_that_imports_it_back(tmp_path):
    package = write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/sub/__init__.py": "from .leaf import X\n",
            "pkg/sub/leaf.py": "from pkg.sub import Y\n",
            "pkg/other.py": "from pkg.sub.leaf import X\n",
        },
    )
    assert import_cycles(package) == [["pkg.sub", "pkg.sub.leaf"]]


def test_the_checker_passes_a_one_way_package(tmp_path):
    package = write_package(
        tmp_path,
        {"pkg/__init__.py": "", "pkg/core.py": "", "pkg/app.py": "from pkg import core\nfrom . import core as c\n"},
    )
    assert import_cycles(package) == []
