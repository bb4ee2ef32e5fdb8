"""Print the lowest versions pyproject.toml declares for its dependencies, one `name==floor` requirement a line.

Each dependency's `>=` bound becomes `==` (extras and markers kept); a dependency without one is printed as is. The
optional extras named after the file are pinned the same way (.ci/lowest_versions: `agents`).
.ci/lowest_versions installs these, so the floors the package declares are the versions it is tested on.
"""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement


def lowest_pins(pyproject: Path, extras: list[str]) -> list[str]:
    """The pins of the dependencies and of the named optional extras' (e.g. agents)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    lines = [*project["dependencies"], *(d for name in extras for d in project["optional-dependencies"][name])]
    pins = []
    for line in lines:
        requirement = Requirement(line)
        floors = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
        marker = f"; {requirement.marker}" if requirement.marker else ""
        pinned = f"=={floors[0]}" if floors else str(requirement.specifier)
        pins.append(f"{requirement.name}{extras}{pinned}{marker}")
    return pins


if __name__ == "__main__":
    # python .ci/lowest_pins.py [pyproject.toml] [extra ...]
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml")
    print("\n".join(lowest_pins(path, sys.argv[2:])))
