"""The import graph of a package, read from its source: every import statement counts, at module level, inside
functions and under `if TYPE_CHECKING:` (test_import_cycles.py and test_layers.py walk it)."""

from __future__ import annotations

import ast
from pathlib import Path


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


def import_graph(root: Path, known: set[str] | None = None) -> dict[str, set[str]]:
    """Module -> the modules it imports, for every module of the package at `root`; `known`: the modules an
    import may name (default: the package's own)."""
    modules = module_names(root)
    targets = set(modules) if known is None else known
    return {name: imported_modules(name, path, targets) for name, path in modules.items()}


def write_package(root: Path, files: dict[str, str]) -> Path:
    """The package `pkg` written below `root` from {relative path: text} (the checkers' own tests); its folder."""
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"
