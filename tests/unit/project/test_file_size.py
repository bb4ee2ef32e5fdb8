"""Each room one concern: no source file under grpo_cli/ is over MAX_LINES lines (tests are exempt: a test file
reads as a list of cases). A longer file holds more than one concern: split it by concern, as
docs/architecture.md's code layout shows."""

from __future__ import annotations

from pathlib import Path

import grpo_cli

PACKAGE_ROOT = Path(grpo_cli.__file__).parent
# Issue #41's bound on a source file of grpo_cli.
MAX_LINES = 600


def long_files(root: Path, limit: int) -> dict[str, int]:
    """Each .py file below `root` over `limit` lines: its path relative to `root` -> its line count."""
    counts = {path: len(path.read_text(encoding="utf-8").splitlines()) for path in sorted(root.rglob("*.py"))}
    return {str(path.relative_to(root)): count for path, count in counts.items() if count > limit}


def test_no_source_file_is_over_the_line_bound():
    found = long_files(PACKAGE_ROOT, MAX_LINES)
    assert not found, f"over {MAX_LINES} lines (split by concern): " + ", ".join(f"{p} ({n})" for p, n in found.items())


def test_the_check_names_each_file_over_the_bound(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "short.py").write_text("x = 1\n" * 3)
    (tmp_path / "sub" / "long.py").write_text("x = 1\n" * 4)
    (tmp_path / "notes.txt").write_text("x\n" * 10)
    assert long_files(tmp_path, 3) == {"sub/long.py": 4}
