"""No key silently ignored: every key of GRPOConfig is declared for every job (config/job_keys.py), and a key set on
the command line that the chosen job never reads is refused in one line naming the job and what to use instead."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from grpo_cli import jobs
from grpo_cli.config.declared import allowed_values
from grpo_cli.config.job_keys import JOB_SUMMARIES, KEY_USES, PRESET_GROUPS, job_accepts, key_use, unread_key_error
from grpo_cli.config.schemas import GROUP_SCHEMAS, GRPOConfig


def schema_keys(cls: type, prefix: str = "") -> set[str]:
    """Every leaf key of a schema dataclass, dotted; a group with a schema per choice (task, rollout) walked
    through every choice's schema."""
    keys: set[str] = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        if not prefix and f.name in GROUP_SCHEMAS:
            for schema in GROUP_SCHEMAS[f.name].values():
                keys |= schema_keys(schema, f"{name}.")
        elif dataclasses.is_dataclass(hints[f.name]):
            keys |= schema_keys(hints[f.name], f"{name}.")
        else:
            keys.add(name)
    return keys


KEYS = sorted(schema_keys(GRPOConfig))


def test_the_walk_finds_the_keys_of_every_group() -> None:
    # The walk itself is tested: it reaches nested schemas (model.lora.r), per-choice ones (task.*, rollout.*),
    # and the run's own keys.
    for key in ("model.lora.r", "task.prompt", "rollout.max_tokens", "rollout.max_model_len", "init_from", "seed"):
        assert key in KEYS
    assert len(KEYS) > 150


def test_every_job_is_described() -> None:
    # A job added to job.name's choices or to the registry must say what it does and what it reads here (the walk
    # below then covers it).
    assert set(JOB_SUMMARIES) == set(allowed_values("job.name"))
    assert set(jobs.JOBS) <= set(JOB_SUMMARIES)


@pytest.mark.parametrize("key", KEYS)
def test_every_key_is_declared_for_every_job(key: str) -> None:
    use = key_use(key)
    assert use is not None, f"{key}: declare which jobs read it in grpo_cli/config/job_keys.py KEY_USES"
    assert use.read_by, f"{key}: no job reads it"
    assert not set(use.read_by) & set(use.ignored), key
    assert set(use.read_by) | set(use.ignored) <= set(JOB_SUMMARIES), key


def test_no_entry_names_a_key_the_schema_lacks() -> None:
    groups = {key.split(".")[0] for key in KEYS}
    for entry in KEY_USES:
        assert entry in groups or any(key == entry or key.startswith(entry + ".") for key in KEYS), entry


def test_baseline_eval_refuses_init_from_naming_job_eval() -> None:
    line = unread_key_error("baseline_eval", ["init_from=outputs/run"])
    assert line == (
        "job=baseline_eval evaluates the untrained model and does not read init_from (init_from=outputs/run): "
        "use grpo-run job=eval eval.model=<run dir> to evaluate a trained run"
    )


@pytest.mark.parametrize(
    ("job", "override", "named"),
    [
        ("baseline_eval", "optim.lr=1e-5", "job=train, job=benchmark"),
        ("report", "model=tiny_random", "job=train"),
        ("report", "task.prompt=chat", "job=check_reward"),
        ("check_reward", "rollout.temperature=0.5", "job=eval"),
        ("eval", "train.eval_every=3", "job=train"),
        ("train", "report.runs=[a]", "job=report"),
        ("train", "job.engines=[hf]", "job=benchmark"),
    ],
)
def test_an_unread_key_is_refused_naming_its_readers(job: str, override: str, named: str) -> None:
    line = unread_key_error(job, ["output_dir=x", override])  # the first one read by every job
    assert line is not None and line.startswith(f"job={job} ") and override in line and named in line
    assert "\n" not in line


@pytest.mark.parametrize(
    ("job", "override"),
    [
        ("baseline_eval", "logger.backend=wandb"),  # ignored by design outside training
        ("report", "distributed.nproc_per_node=2"),  # one-process jobs
        ("check_reward", "model=tiny_random"),  # its tokenizer
        ("check_reward", "rollout.max_tokens=64"),
        ("eval", "train.eval_examples=4"),
        ("train", "eval.n_samples=4"),
        ("report", "hydra.run.dir=/tmp/x"),
        ("baseline_eval", "debug=smoke"),  # a preset
        ("benchmark", "+loss.cliprange_high=0.28"),
    ],
)
def test_read_and_ignored_keys_are_accepted(job: str, override: str) -> None:
    assert unread_key_error(job, [override]) is None


def test_a_group_choice_is_accepted_where_any_of_its_keys_is_read() -> None:
    assert job_accepts("check_reward", "model")
    assert not job_accepts("check_reward", "loss")
    assert not job_accepts("report", "rollout")


def test_every_group_grpo_run_help_lists_has_its_own_help() -> None:
    # `grpo-run --help` lists every folder of conf/; `grpo-run --help <group>` must answer for each (it said
    # "no such group" for experiment and generation): a schema group's keys, or a preset group's choices.
    from importlib.resources import files

    from grpo_cli.cli import preset_help, take_help_topics
    from grpo_cli.config.reference import groups

    folders = {e.name for e in files("grpo_cli.conf").iterdir() if e.is_dir() and not e.name.startswith("_")}
    assert folders <= set(groups()) | set(PRESET_GROUPS) | {"job"}
    for group in PRESET_GROUPS:
        assert take_help_topics(["--help", group]) == ([group], ["--help"])
        text = preset_help(group)
        names = sorted(e.name.removesuffix(".yaml") for e in (files("grpo_cli.conf") / group).iterdir())
        listed = [line.split()[0] for line in text.splitlines()[1:] if line and not line.startswith(" ")]
        assert listed == [n for n in names if not n.startswith("_")], group


def test_the_contract_page_shows_the_table() -> None:
    from pathlib import Path

    from grpo_cli.config.job_keys import markdown_table

    page = (Path(__file__).resolve().parents[3] / "docs" / "config-contract.md").read_text()
    assert markdown_table() in page, "regenerate the table in docs/config-contract.md from job_keys.markdown_table()"
