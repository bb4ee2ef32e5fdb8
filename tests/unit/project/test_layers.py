"""Dependencies point down: no import from a lower layer to a higher one, against the layer table of
docs/architecture.md ("Dependency direction"), read from the page itself so that the page and the check cannot
drift apart. Every import statement counts (import_graph.py): at module level, inside functions and under
`if TYPE_CHECKING:`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import grpo_cli
from tests.conftest import REPO_ROOT
from tests.unit.project.import_graph import import_graph, module_names, write_package

PACKAGE_ROOT = Path(grpo_cli.__file__).parent
ARCHITECTURE = REPO_ROOT / "docs" / "architecture.md"
SECTION = "## Dependency direction"
# The table's row for the floors of the line: what each floor may import besides the floors after it.
EVERY_FLOOR = "every floor"


@dataclass(frozen=True)
class Layers:
    """The layer table: `allowed[package]` are the packages (top-level names under grpo_cli, `grpo_cli` for its
    own __init__) that `package` may import; `floors` the line's floors in order."""

    floors: tuple[str, ...]
    allowed: dict[str, frozenset[str]]


def parse_layers(markdown: str) -> Layers:
    """The line and the table of the page's "Dependency direction" section (their indented lines): a floor may
    import the floors after it on the line, but not the other members of its `{group}`, and what the table's
    EVERY_FLOOR row names; a package with a row of its own may import only what that row names."""
    section = markdown.split(SECTION, 1)[1].split("\n## ", 1)[0]
    block = [line.strip() for line in section.splitlines() if line.startswith("    ") and line.strip()]
    chain = next(line for line in block if "->" in line)
    groups = [set(re.findall(r"\w+", step)) for step in chain.split("->")]
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in block if line != chain)
    rows.pop("package")  # the header
    floors = tuple(name for group in groups for name in sorted(group))
    names = set(floors) | set(rows) - {EVERY_FLOOR}

    def named(text: str) -> frozenset[str]:
        return frozenset(word for word in re.findall(r"\w+", text) if word in names)

    allowed = {name: named(text) for name, text in rows.items() if name != EVERY_FLOOR}
    for position, group in enumerate(groups):
        below = set().union(*groups[position + 1 :])
        for floor in group:
            allowed.setdefault(floor, named(rows[EVERY_FLOOR]) | below)
    return Layers(floors, allowed)


def package_of(module: str, package: str) -> str:
    """The table's name for a module: its top-level package or module under `package` (`grpo_cli.rollout.worker`
    -> rollout), the package's own name for its __init__, and the first name for a module outside it."""
    parts = module.split(".")
    return parts[1] if parts[0] == package and len(parts) > 1 else parts[0]


def upward_imports(root: Path, layers: Layers, outside: tuple[Path, ...] = ()) -> list[str]:
    """Each import of a module of the package at `root` (or of the packages `outside` it, which may import the
    package) that its layer does not allow, as "importer -> imported (package may import: ...)"."""
    known = set(module_names(root))
    graph = import_graph(root)
    for other in outside:
        graph |= import_graph(other, known)
    found = []
    for importer, imported in sorted(graph.items()):
        source = package_of(importer, root.name)
        # The package's own __init__ runs before any module of it, so naming it (`from grpo_cli import
        # __version__`) adds no dependency.
        for target in sorted(imported - {root.name}):
            destination = package_of(target, root.name)
            if destination != source and destination not in layers.allowed.get(source, frozenset()):
                allowed = ", ".join(sorted(layers.allowed.get(source, ()))) or "nothing"
                found.append(f"{importer} -> {target} ({source} may import: {allowed})")
    return found


def unplaced(root: Path, layers: Layers) -> list[str]:
    """The packages of grpo_cli the table gives no place (a new package must be put on a floor or beside them)."""
    return sorted({package_of(module, root.name) for module in module_names(root)} - set(layers.allowed))


def test_no_module_imports_a_higher_layer():
    layers = parse_layers(ARCHITECTURE.read_text(encoding="utf-8"))
    found = upward_imports(PACKAGE_ROOT, layers, outside=(REPO_ROOT / "hydra_plugins",))
    assert not found, "imports against docs/architecture.md's layer table:\n" + "\n".join(found)


def test_every_package_has_a_place_in_the_layer_table():
    layers = parse_layers(ARCHITECTURE.read_text(encoding="utf-8"))
    assert not unplaced(PACKAGE_ROOT, layers), (
        f"not in docs/architecture.md's layer table: {unplaced(PACKAGE_ROOT, layers)}"
    )


def test_the_page_states_the_layers():
    """The line names the floors in order; the table gives core nothing and the beside packages their rows."""
    layers = parse_layers(ARCHITECTURE.read_text(encoding="utf-8"))
    assert layers.floors[:4] == ("cli", "jobs", "export", "drivers") and layers.floors[-1] == "core"
    assert layers.allowed["core"] == frozenset()
    assert "learner" not in layers.allowed["rollout"] and "rollout" not in layers.allowed["learner"]
    assert layers.allowed["sandbox"] == {"errors"}  # a leaf: the jail imports nothing of tasks/ (their settings)
    assert layers.allowed["cli"] > layers.allowed["jobs"] > layers.allowed["drivers"]


# The checker's own tests, on a small package written for each: a table of the page's form.
TABLE = """
## Dependency direction

    app -> {left, right} -> base -> core

text between

    package          imports, of pkg
    every floor      the floors after it on the line above, and util
    core             nothing: torch only
    util             nothing
    pkg              nothing
    plugins          nothing

## Next section

    other -> lines -> ignored
"""


def test_the_table_is_read_with_its_groups_and_rows():
    layers = parse_layers(TABLE)
    assert layers.floors == ("app", "left", "right", "base", "core")
    assert layers.allowed == {
        "app": frozenset({"left", "right", "base", "core", "util"}),
        "left": frozenset({"base", "core", "util"}),
        "right": frozenset({"base", "core", "util"}),
        "base": frozenset({"core", "util"}),
        "core": frozenset(),
        "util": frozenset(),
        "pkg": frozenset(),
        "plugins": frozenset(),
    }


def upward_imports_of(tmp_path: Path, files: dict[str, str], outside: tuple[Path, ...] = ()) -> list[str]:
    """The imports the checker refuses in a package of TABLE's layers, where `files` are added to (or replace
    files of) one whose imports all point down."""
    one_way = {
        "pkg/__init__.py": "",
        "pkg/app.py": "from pkg import left, base\nfrom pkg.right import R\n",
        "pkg/left.py": "from pkg.base import B\n",
        "pkg/right.py": "import pkg.core\nR = 1\n",
        "pkg/base.py": "from pkg import util\nfrom . import core\nB = 1\n",
        "pkg/core.py": "",
        "pkg/util.py": "",
    }
    root = write_package(tmp_path, one_way | files)
    return [line.split(" (")[0] for line in upward_imports(root, parse_layers(TABLE), outside)]


def test_the_checker_passes_imports_that_point_down(tmp_path):
    assert upward_imports_of(tmp_path, {}) == []
    assert unplaced(tmp_path / "pkg", parse_layers(TABLE)) == []


def test_the_checker_refuses_an_upward_import_even_inside_a_function(tmp_path):
    planted = {"pkg/base.py": "from pkg import util\nB = 1\ndef f():\n    from pkg.app import run\n"}
    assert upward_imports_of(tmp_path, planted) == ["pkg.base -> pkg.app"]


def test_the_checker_refuses_an_import_between_the_members_of_a_group_under_type_checking(tmp_path):
    planted = {"pkg/left.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.right import R\n"}
    assert upward_imports_of(tmp_path, planted) == ["pkg.left -> pkg.right"]


def test_the_checker_refuses_a_floor_imported_from_beside_and_anything_imported_by_core(tmp_path):
    planted = {"pkg/util.py": "from pkg.base import B\n", "pkg/core.py": "from . import util\n"}
    assert upward_imports_of(tmp_path, planted) == ["pkg.core -> pkg.util", "pkg.util -> pkg.base"]


def test_the_checker_refuses_an_import_of_the_package_from_a_package_outside_it(tmp_path):
    write_package(tmp_path, {"plugins/__init__.py": "", "plugins/launcher.py": "import pkg.util\n"})
    assert upward_imports_of(tmp_path, {}, outside=(tmp_path / "plugins",)) == ["plugins.launcher -> pkg.util"]


def test_the_checker_names_a_package_the_table_has_no_place_for(tmp_path):
    upward_imports_of(tmp_path, {"pkg/newcomer/__init__.py": "from pkg import core\n"})
    assert unplaced(tmp_path / "pkg", parse_layers(TABLE)) == ["newcomer"]
