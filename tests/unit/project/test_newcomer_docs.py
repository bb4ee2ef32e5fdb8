"""What the README and docs tell a newcomer agrees with itself and with the config (issue 56's newcomer): one
8-GPU command, every config group in the README's table, MATH and GSM8K's need of the network said, no
`cd examples/<x> && grpo-run` (it writes outputs/ into the repository)."""

from __future__ import annotations

import re
from importlib.resources import files
from pathlib import Path

from tests.conftest import REPO_ROOT

ROOT = Path(REPO_ROOT)


def eight_gpu_commands(text: str) -> set[str]:
    """The 8-rank commands of a page's command blocks (indented lines)."""
    pattern = r"^ {4,}(grpo-run [^\n#]*nproc_per_node=8[^\n#]*)"
    return {" ".join(m.split()) for m in re.findall(pattern, text, flags=re.MULTILINE)}


def test_the_readme_and_the_distributed_page_give_one_8_gpu_command() -> None:
    readme = eight_gpu_commands((ROOT / "README.md").read_text())
    page = {c for c in eight_gpu_commands((ROOT / "docs" / "distributed.md").read_text()) if "cs336_math" in c}
    assert readme == page == {"grpo-run experiment=cs336_math distributed=fsdp distributed.nproc_per_node=8"}


def test_the_readme_group_table_has_every_group() -> None:
    rows = set(re.findall(r"^\| `(\w+)`", (ROOT / "README.md").read_text(), flags=re.MULTILINE))
    folders = {e.name for e in files("grpo_cli.conf").iterdir() if e.is_dir() and not e.name.startswith("_")}
    assert folders <= rows, folders - rows


def test_the_readme_says_math_and_gsm8k_need_the_network_or_local_files() -> None:
    text = " ".join((ROOT / "README.md").read_text().split())
    assert (
        "MATH (`task=math`, from `hiyouga/math12k`) and GSM8K (`task=gsm8k`, from `openai/gsm8k`) are downloaded"
        in text
    )
    assert "offline, give local JSONL files (`task.train_path=... task.eval_path=...`)" in text


def test_no_doc_runs_an_example_from_inside_the_repository() -> None:
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*/README.md")]
    offenders = [str(p.relative_to(ROOT)) for p in pages if "cd examples/" in p.read_text()]
    assert not offenders
