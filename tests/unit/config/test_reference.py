"""Help in the schema (issue #34): every key says what it is for, `grpo-run --help [<group>]` prints it with the
key's value and constraint, docs/config-reference.md is a fresh render of it, and every key the docs name exists.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from grpo_cli import cli
from grpo_cli.config import GROUP_SCHEMAS, GRPOConfig, help_of, registry
from grpo_cli.config.fields import flag, positive
from grpo_cli.config.reference import (
    GENERATED_KEYS,
    all_sections,
    fill_generated_tables,
    group_sections,
    groups,
    markdown,
    schema_doc,
)
from grpo_cli.errors import EXIT_USER_ERROR

REPO_ROOT = Path(__file__).resolve().parents[3]
REFERENCE_PAGE = REPO_ROOT / "docs" / "config-reference.md"


def _schemas_and_keys(cls: type, prefix: str = "") -> typing.Iterator[tuple[type, str, str]]:
    """(schema, dotted key, field name) of every leaf key under `cls`, through every choice of the per-choice
    groups, and every nested schema as (schema, key, "") so that it is checked for a docstring."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, hint = f"{prefix}{f.name}", hints[f.name]
        nested = [*GROUP_SCHEMAS.get(key, {}).values()]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            nested.append(hint)
        for schema in nested:
            yield schema, key, ""
            yield from _schemas_and_keys(schema, f"{key}.")
        if not nested:
            yield cls, key, f.name


def test_every_key_and_every_schema_says_what_it_is_for():
    walked = list(_schemas_and_keys(GRPOConfig))
    no_help = [f"{key} ({cls.__name__})" for cls, key, name in walked if name and not help_of(cls, name)]
    assert not no_help, f"give these keys a help= text in their schema: {', '.join(no_help)}"
    no_doc = sorted({cls.__name__ for cls, _, name in walked if not name and not schema_doc(cls)})
    assert not no_doc, f"give these schemas a docstring (their group's help): {', '.join(no_doc)}"
    assert len({key for _, key, name in walked if name}) > 150  # every choice's schema was walked


def test_help_is_the_declaration_s_own_and_a_plain_redeclaration_keeps_the_base_s():
    @dataclasses.dataclass
    class Base:
        steps: int = positive(3, help="How many steps.")
        verbose: bool = flag(True, help="Talk.")

    @dataclasses.dataclass
    class NewDefault(Base):
        steps: int = 5  # only the default changes: the meaning is the base's

    @dataclasses.dataclass
    class Undocumented(Base):
        steps: int = positive(5)  # a new declaration must say what it is for itself

    assert help_of(Base, "steps") == "How many steps." and help_of(Base, "verbose") == "Talk."
    assert help_of(NewDefault, "steps") == "How many steps."
    assert help_of(Undocumented, "steps") == ""


def test_the_reference_page_is_a_fresh_render_of_the_schemas():
    fresh = markdown()
    assert REFERENCE_PAGE.read_text(encoding="utf-8") == fresh, (
        "docs/config-reference.md is stale: python -m grpo_cli.tasks.config_reference > docs/config-reference.md"
    )
    for section in all_sections():
        for doc in section.keys:
            assert f"| `{doc.key}` |" in fresh
    assert "| `loss.cliprange_high` |" in fresh and "### task=custom" in fresh and "### rollout=vllm" in fresh


def test_the_docs_generated_key_tables_are_fresh():
    stale, tables = [], 0
    for page in doc_pages():
        text = page.read_text(encoding="utf-8")
        tables += len(GENERATED_KEYS.findall(text))
        if fill_generated_tables(text) != text:
            stale.append(str(page.relative_to(REPO_ROOT)))
    assert not stale, f"stale key tables: python -m grpo_cli.tasks.config_reference --fill {' '.join(stale)}"
    assert tables >= 3  # docs/custom-tasks.md, docs/evaluation.md, docs/rollout.md


def test_a_generated_table_is_rendered_between_its_markers_and_names_only_keys_that_exist():
    page = "intro\n<!-- generated keys: eval loss.dual_clip -->\nold rows\n<!-- end of generated keys -->\nafter\n"
    filled = fill_generated_tables(page)
    assert filled.startswith("intro\n<!-- generated keys: eval loss.dual_clip -->\n| Key | Default |")
    assert "old rows" not in filled and filled.endswith("<!-- end of generated keys -->\nafter\n")
    assert [line.split(" | ")[0] for line in filled.splitlines() if line.startswith("| `")] == [
        "| `eval.n_samples`",
        "| `eval.pass_k`",
        "| `eval.model`",
        "| `eval.step`",
        "| `loss.dual_clip`",
    ]
    assert fill_generated_tables(filled) == filled
    with pytest.raises(KeyError, match="loss.dual_clipp"):
        fill_generated_tables(page.replace("loss.dual_clip", "loss.dual_clipp"))


def test_each_choice_of_a_per_choice_group_lists_only_its_own_keys_after_the_common_ones():
    sections = group_sections("task", "custom")
    titles = [s.title for s in sections]
    assert titles == ["task", "task.sandbox", "task=custom", "task.reward_model"]  # reward_weights: a dict under custom
    custom_keys = {doc.key for doc in sections[titles.index("task=custom")].keys}
    assert {"task.rewards", "task.reward_weights", "task.train_path"} <= custom_keys  # own or redeclared
    assert "task.n_train" not in custom_keys  # a common key, listed once under "task"
    keyword = group_sections("task", "keyword")
    assert [s.title for s in keyword] == ["task", "task.reward_weights", "task.sandbox", "task=keyword"]
    assert [doc.key for doc in keyword[-1].keys] == ["task.keywords_per_prompt"]


# ---------------------------------------------------------------------------------------------------------
# Every key a doc names exists

# `grpo-run <group>.<key>...`: a dotted name starting with a group, not inside another name (cfg.train.steps is
# Python, grpo_cli.tasks a module), ending before `=`, `<name>` or `*`.
FILE_SUFFIXES = {"py", "md", "yaml", "yml", "json", "jsonl", "csv", "parquet", "txt", "log", "gguf", "safetensors"}
# Dotted names in the docs that start like a key on purpose and are not one.
NOT_KEYS = {
    "optim.lrr": "docs/reliability.md shows the error a typo'd key gets",
    "model.generate": "transformers' generate(), in the code layout of docs/design.md",
    "loss.log_ratio_clamp": "the hypothetical option of docs/architecture.md's worked example (Adding a loss option)",
}
# Keys a draft page proposes (with the names of the user's own under them): remove each when its schema has it.
PROPOSED_KEYS: dict[str, str] = {}  # key -> the draft doc that proposes it (none now: #35's keys landed)


def is_named_on_purpose(key: str) -> bool:
    return key in NOT_KEYS or any(key == p or key.startswith(f"{p}.") for p in PROPOSED_KEYS)


def named_keys(text: str, group_names: list[str]) -> list[str]:
    """The config keys `text` names: `train.steps=3`, `loss.cliprange_high`, `+task.eval_sets.math500=test`."""
    pattern = re.compile(rf"(?<![\w./$-])((?:{'|'.join(group_names)})(?:\.[A-Za-z_]\w*)+)")
    return [key for key in pattern.findall(text) if key.rsplit(".", 1)[1] not in FILE_SUFFIXES]


@functools.cache
def _keys_and_mappings() -> tuple[set[str], set[str]]:
    """(every key and nested schema, the keys whose value is a mapping of the user's own names)."""
    sections = all_sections()
    docs = [doc for section in sections for doc in section.keys]
    mappings = {doc.key for doc in docs if doc.type.startswith(("dict", "Any"))}
    return {doc.key for doc in docs} | {section.title for section in sections}, mappings


def is_a_key(key: str) -> bool:
    """A key of some schema, a nested schema (model.lora), or a name of the user's own under a mapping key
    (task.rewards.<name>, task.eval_sets.<name>, rollout.vllm_kwargs.<option>)."""
    keys, mappings = _keys_and_mappings()
    parts = key.split(".")
    return key in keys or any(".".join(parts[:i]) in mappings for i in range(1, len(parts)))


def doc_pages() -> list[Path]:
    docs = REPO_ROOT / "docs"
    return [
        REPO_ROOT / "README.md",
        *(p for p in sorted(docs.rglob("*.md")) if "results" not in p.relative_to(docs).parts),
    ]


def test_every_key_the_docs_name_exists():
    group_names = groups()
    unknown, named = [], 0
    for page in doc_pages():
        for key in named_keys(page.read_text(encoding="utf-8"), group_names):
            named += 1
            if not is_a_key(key) and not is_named_on_purpose(key):
                unknown.append(f"{page.relative_to(REPO_ROOT)}: {key}")
    assert not unknown, f"the docs name keys no schema has (docs/config-reference.md lists them): {unknown}"
    assert named > 300  # the pattern finds the keys the docs are full of
    landed = [key for key in PROPOSED_KEYS if is_a_key(key)]
    assert not landed, f"these keys exist now: drop them from PROPOSED_KEYS: {landed}"


def test_the_docs_key_check_reads_what_users_type_and_skips_what_is_no_key():
    text = (
        "grpo-run loss=grpo_clip loss.cliprange_high=0.28 +task.eval_sets.math500=test task.rewards.<name>=f\n"
        "`train.stepz=3`, `model.lora.*`, cfg.train.steps, grpo_cli.tasks, eval/reward, hydra.run.dir=x, "
        "`train.jsonl`, job.log, rollout.vllm_kwargs.enable_prefix_caching=false, task.reward_weights.fmt=0.5"
    )
    keys = named_keys(text, groups())
    assert keys == [
        "loss.cliprange_high",
        "task.eval_sets.math500",
        "task.rewards",
        "train.stepz",
        "model.lora",
        "rollout.vllm_kwargs.enable_prefix_caching",
        "task.reward_weights.fmt",
    ]
    assert [key for key in keys if not is_a_key(key)] == ["train.stepz"]


# ---------------------------------------------------------------------------------------------------------
# grpo-run --help [<group> ...]


def test_help_topics_come_off_the_command_line_before_hydra_reads_it():
    assert cli.take_help_topics(["loss=grpo_clip", "train.steps=3"]) == ([], ["loss=grpo_clip", "train.steps=3"])
    assert cli.take_help_topics(["--help", "task=math", "task", "loss"]) == (["task", "loss"], ["--help", "task=math"])
    # a config name is an option's value, not a group to show
    assert cli.take_help_topics(["--config-name", "loss", "-h"]) == ([], ["--config-name", "loss", "-h"])
    assert cli.take_help_topics(["--help", "all"]) == (["all"], ["--help"])
    with pytest.raises(SystemExit) as stop:
        cli.take_help_topics(["--help", "los"])
    assert stop.value.code == EXIT_USER_ERROR


def help_text(overrides: list[str], topics: list[str]) -> str:
    """The body of `grpo-run --help <topics> <overrides>`, resolved from the composed config as Hydra's help does."""
    registry.register_configs()
    registry.HELP_TOPICS[:] = topics
    try:
        with initialize_config_module(config_module="grpo_cli.conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
            return cfg.hydra.help.template
    finally:
        registry.HELP_TOPICS.clear()


def test_help_lists_the_top_level_keys_and_the_groups_and_a_group_s_keys_only_when_asked():
    overview = help_text([], [])
    assert "seed = 0  (>= 0)\n    Seed of the run" in overview and "grpo-run --help <group>" in overview
    assert "output_dir = $${hydra:runtime.output_dir}" in overview  # $ doubled for Hydra's string.Template
    assert "loss.cliprange =" not in overview
    for group in groups():
        assert re.search(rf"^{group} +\S", overview, re.MULTILINE), group

    every = help_text([], ["all"])
    assert "== Allowed values" not in every
    defaults = {"task": "keyword", "rollout": "hf"}  # conf/config.yaml's choices
    shown = [*group_sections(""), *(s for group in groups() for s in group_sections(group, defaults.get(group)))]
    assert len(shown) > len(groups())
    for section in shown:
        assert f"== {section.title}" in every, section.title
        for doc in section.keys:
            assert f"\n{doc.key} = " in every, doc.key
    assert "task.reward_model.path" not in every  # a key of task=custom, not of the selected task=keyword
