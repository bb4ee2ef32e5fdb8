"""Print the lowest versions pyproject.toml declares for its dependencies, one `name==floor` requirement a line.

Each dependency's `>=` bound becomes `==` (extras and markers kept); a dependency without one is printed as is.
.ci/lowest_versions installs these, so the floors the package declares are the versions it is tested on.
"""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement


def lowest_pins(pyproject: Path) -> list[str]:
    pins = []
    for line in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        requirement = Requirement(line)
        floors = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
        marker = f"; {requirement.marker}" if requirement.marker else ""
        pinned = f"=={floors[0]}" if floors else str(requirement.specifier)
        pins.append(f"{requirement.name}{extras}{pinned}{marker}")
    return pins


if __name__ == "__main__":
    print("\n".join(lowest_pins(Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml"))))
