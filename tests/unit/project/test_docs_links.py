"""The documentation holds together: every relative link in README.md and docs/ resolves, and the README stays a
front page (at most 20,000 bytes; topics and measurements live in docs/)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.conftest import REPO_ROOT

README = REPO_ROOT / "README.md"
README_MAX_BYTES = 20_000

# [text](target) and ![alt](target); the text may hold one level of brackets ("[see [1]](x.md)").
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]*)")
# Reference-style definitions: [label]: target
LINK_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
FENCE = re.compile(r"^ {0,3}(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def doc_files() -> list[Path]:
    return [README, *sorted((REPO_ROOT / "docs").rglob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The lines of a markdown file outside code, with inline code spans removed.

    Fenced blocks are skipped, and so are indented code blocks: a line indented by 4 or more spaces (or a tab)
    that follows a blank line or another code line. That is CommonMark's rule outside lists; this repository's
    docs indent list continuations by 2 spaces, so it holds here.
    """
    lines: list[str] = []
    in_fence = False
    in_indented = False
    previous_blank = True
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        blank = not line.strip()
        if not blank and (line.startswith("    ") or line.startswith("\t")) and (previous_blank or in_indented):
            in_indented = True
            previous_blank = False
            continue
        if not blank:
            in_indented = False
        previous_blank = blank
        lines.append(INLINE_CODE.sub("", line))
    return lines


def relative_link_targets(text: str) -> list[str]:
    """Every link target in `text` that points at a file of this repository (anchors and URLs left out)."""
    targets = []
    for line in prose_lines(text):
        found = [m.group(1) for m in INLINE_LINK.finditer(line)]
        definition = LINK_DEFINITION.match(line)
        if definition:
            found.append(definition.group(1))
        for target in found:
            target = target.strip("<>").strip()
            if not target or target.startswith("#") or EXTERNAL.match(target):
                continue
            path = unquote(target.split("#", 1)[0].split("?", 1)[0])
            if path:
                targets.append(path)
    return targets


def broken_links(markdown_file: Path) -> list[str]:
    """The relative link targets in `markdown_file` that name no existing file or directory."""
    text = markdown_file.read_text(encoding="utf-8")
    base = markdown_file.parent
    return [target for target in relative_link_targets(text) if not (base / target).exists()]


@pytest.mark.parametrize("markdown_file", doc_files(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_resolves(markdown_file: Path) -> None:
    broken = broken_links(markdown_file)
    assert not broken, f"{markdown_file.relative_to(REPO_ROOT)} links to missing files: {broken}"


def test_readme_links_to_the_docs_pages() -> None:
    # Guards the link pattern itself: if it matched nothing, every file would pass vacuously.
    targets = relative_link_targets(README.read_text(encoding="utf-8"))
    assert "docs/design.md" in targets
    assert len(targets) >= 9


def test_readme_is_a_front_page() -> None:
    size = README.stat().st_size
    assert size <= README_MAX_BYTES, (
        f"README.md is {size:,} bytes (limit {README_MAX_BYTES:,}): move the topic into a docs/ page and link it"
    )


def test_a_broken_link_is_caught(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# page\n")
    (tmp_path / "img.png").write_bytes(b"")
    readme = tmp_path / "README.md"
    readme.write_text(
        "See [the page](docs/page.md), [a section](docs/page.md#page), ![a picture](img.png),\n"
        '[`code` in text](docs/page.md "title"), [an anchor](#usage), [the web](https://example.com),\n'
        "[mail](mailto:someone@example.com), [gone](docs/missing.md#x) and ![lost](lost.png).\n"
        "[ref]: docs/also-missing.md\n"
        "Inline code is not a link: `[x](nowhere.md)`.\n"
        "\n"
        "    [an indented code block](nowhere-either.md)\n"
        "\n"
        "```\n"
        "[a fenced block](nor-here.md)\n"
        "```\n"
    )
    assert broken_links(readme) == ["docs/missing.md", "lost.png", "docs/also-missing.md"]
    # Links resolve relative to the linking file.
    (tmp_path / "docs" / "other.md").write_text("[up](../README.md) [sibling](page.md) [wrong](docs/page.md)\n")
    assert broken_links(tmp_path / "docs" / "other.md") == ["docs/page.md"]
