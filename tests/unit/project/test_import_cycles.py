"""Dependencies point one way: no import cycle between modules of grpo_cli (docs/design.md, "Code layout").

Every import statement counts: at module level, inside functions, and under `if TYPE_CHECKING:`; a package's
`__init__` that imports a submodule which imports the package back is a cycle too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import grpo_cli

PACKAGE_ROOT = Path(grpo_cli.__file__).parent


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file below the package directory `root`."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that any import statement of module `name` names (`from a import b` names `a`,
    and `a.b` when b is a module)."""
    is_package = path.name == "__init__.py"
    package = name.split(".") if is_package else name.split(".")[:-1]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets.add(module)
            targets.update(f"{module}.{alias.name}" for alias in node.names)
    return {t for t in targets if t in known and t != name}


def import_cycles(root: Path) -> list[list[str]]:
    """Each strongly connected group of modules (a cycle) in the import graph of the package at `root`."""
    modules = module_names(root)
    graph = {name: imported_modules(name, path, set(modules)) for name, path in modules.items()}
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


def write_package(root: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


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
