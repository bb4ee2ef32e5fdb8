"""No input ends in a traceback or is silently misread (issue #20).

Every field of every schema is fed the values its declared constraint rules out (a wrong type, a negative, a
zero, past the end of its range, an unknown choice, a scalar for a list, a missing path), in-process: the
override applied as Hydra's compose applies it, then the validation `grpo-run` runs. A handful go through the
real command. Damaged data files and damaged files of a run directory are either recovered from (one message)
or reported in one line naming the file.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from grpo_cli import cli
from grpo_cli.config import (
    GROUP_SCHEMAS,
    GRPOConfig,
    SavedConfigError,
    constraint_of,
    validate_config,
)
from grpo_cli.config.resume import resumed_config
from grpo_cli.errors import UserFacingError
from grpo_cli.tasks import load_jsonl_examples
from grpo_cli.tracking import read_metrics
from grpo_cli.tracking.jsonl import truncate_metrics
from grpo_cli.tracking.run_info import write_run_info
from tests.unit.config.test_config_schemas import compose_raw

# ---------------------------------------------------------------------------------------------------------
# The schema walk: every leaf field, with the group choice whose schema has it


@dataclasses.dataclass(frozen=True)
class Leaf:
    key: str  # dotted, as typed on the command line
    schema: type  # the dataclass declaring it
    name: str
    hint: Any  # the field's type
    choice: str | None  # the group override selecting that schema (task=gsm8k), None for the defaults


def _strip_optional(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint


def _leaves(cls: type, prefix: str = "", choice: str | None = None) -> list[Leaf]:
    hints = typing.get_type_hints(cls)
    leaves = []
    for f in dataclasses.fields(cls):
        key, hint = f"{prefix}{f.name}", _strip_optional(hints[f.name])
        schemas = GROUP_SCHEMAS.get(key)
        if schemas:  # a group with a schema per choice (task is typed Any in GRPOConfig: each choice's schema)
            for name, schema in schemas.items():
                leaves += _leaves(schema, f"{key}.", f"{key}={name}")
        elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
            leaves += _leaves(hint, f"{key}.", choice)
        else:
            leaves.append(Leaf(key, cls, f.name, hint, choice))
    unique: dict[str, Leaf] = {}
    for leaf in leaves:  # a key every task shares is tested once, under the first task
        unique.setdefault(leaf.key, leaf)
    return list(unique.values())


LEAVES = _leaves(GRPOConfig)


def test_every_field_declares_a_constraint_or_any_value():
    """A key added without saying what it accepts fails here: a bool is its own constraint, every other field
    declares one (positive(), in_range(), choice(), path(), ...) or says any_value()."""
    undeclared = [
        leaf.key for leaf in LEAVES if leaf.hint is not bool and constraint_of(leaf.schema, leaf.name) is None
    ]
    assert not undeclared, f"declare a constraint (or any_value) for: {', '.join(undeclared)}"
    assert len(LEAVES) > 100  # the walk reaches every group's schema, task and rollout choices included


# ---------------------------------------------------------------------------------------------------------
# The bad values each declaration rules out


def _is_list(hint: Any) -> bool:
    return typing.get_origin(hint) is list


def bad_values(leaf: Leaf) -> list[str]:
    """Override values (as typed after `key=`) that must fail for this field."""
    hint, constraint = leaf.hint, constraint_of(leaf.schema, leaf.name)
    item = typing.get_args(hint)[0] if _is_list(hint) else hint
    values = []
    # a wrong type
    if _is_list(hint) or typing.get_origin(hint) is dict:
        values.append("abc")  # a scalar where a list or a mapping is meant
    elif hint in (int, float):
        values.append("ten")
    elif hint is bool:
        values.append("maybe")
    elif hint is str:
        values.append("[1,2]")
    if constraint is None or constraint.kind == "any":
        return values
    # out of the declared set
    singles: list[str] = []
    if constraint.kind == "range":
        if constraint.low is not None:
            singles.append(str(constraint.low - 1))  # a negative where >= 0 is asked
            if constraint.low_open:
                singles.append(str(constraint.low))  # zero where > 0 is asked
        if constraint.high is not None:
            singles.append(str(constraint.high + 1) if item is int else str(constraint.high + 0.5))
            if constraint.high_open:
                singles.append(str(constraint.high))
        if item is float:
            singles += ["nan", "inf"]
    elif constraint.kind == "choice":
        singles.append("no_such_choice")
    elif constraint.kind == "path":
        singles.append(f"{__file__}/below_a_file" if constraint.path_kind == "output" else "/no/such/path")
    if item is int:
        singles = [str(int(float(v))) for v in singles if v not in ("nan", "inf")]
    values += [f"[{v}]" for v in singles] if _is_list(hint) else singles
    return values


CASES = [(leaf, value) for leaf in LEAVES for value in bad_values(leaf)]
_BASES: dict[str | None, Any] = {}
_PARSER = OverridesParser.create()


def run_in_process(leaf: Leaf, value: str) -> str | None:
    """What `grpo-run <choice> <key>=<value>` says before anything loads (None: it would run): the override
    applied to the composed config as Hydra's compose applies it, then the checks of grpo-run's task function."""
    if leaf.choice not in _BASES:
        _BASES[leaf.choice] = compose_raw([leaf.choice] if leaf.choice else [])
    cfg = copy.deepcopy(_BASES[leaf.choice])
    try:
        ConfigLoaderImpl._apply_overrides_to_config(_PARSER.parse_overrides([f"{leaf.key}={value}"]), cfg)
        validate_config(OmegaConf.to_object(cfg))
    except (HydraException, OmegaConfBaseException) as e:
        return cli.config_error_line(e)
    except UserFacingError as e:
        return str(e)
    return None


def test_every_field_rejects_every_value_its_declaration_rules_out():
    """One test over all cases (hundreds, a few ms each): each fails in one line naming its key."""
    assert len(CASES) > 250
    failures = []
    for leaf, value in CASES:
        message = run_in_process(leaf, value)
        if message is None or leaf.key not in message or "\n" in message:
            failures.append(f"{leaf.choice or ''} {leaf.key}={value}: {message!r}")
    assert not failures, "\n".join(failures)


def test_the_defaults_of_every_schema_pass():
    for choice in {leaf.choice for leaf in LEAVES}:
        cfg = compose_raw([choice] if choice else [])
        try:
            validate_config(OmegaConf.to_object(cfg))
        except UserFacingError as e:  # a cross-field rule of a choice may object; no declared constraint may
            assert "must be" not in str(e) and "is not one of" not in str(e), (choice, e)


# ---------------------------------------------------------------------------------------------------------
# Damaged data files


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"question": "q", "ground_truth": "a"}\n{"question": "q2", "grou', ":2: not valid JSON"),
        (b"question,ground_truth\nq,a\n", ":1: not valid JSON"),
        (b'["q", "a"]\n', ":1: expected a JSON object per line"),
        (b'{"question": "q"}\n', ":1: "),
        (b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", "is not UTF-8 text"),
        (b"", "holds no examples"),
    ],
    ids=["truncated-line", "not-json", "not-an-object", "missing-field", "binary", "empty"],
)
def test_a_damaged_data_file_fails_in_one_line_naming_it(tmp_path, content, message):
    data = tmp_path / "train.jsonl"
    data.write_bytes(content)
    with pytest.raises(UserFacingError) as info:
        load_jsonl_examples(str(data), "chat")
    assert str(data) in str(info.value) and message in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------------------
# Damaged files of a run directory that a resume reads


def hand_made_run(tmp_path: Path) -> Path:
    """A run directory as grpo-run leaves it, as far as resumed_config reads it."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_000002").mkdir(parents=True)
    (run_dir / ".hydra").mkdir()
    text = OmegaConf.to_yaml(compose_raw(["model=tiny_random"], output_dir=str(run_dir)), resolve=True)
    (run_dir / "config.yaml").write_text(text)
    (run_dir / ".hydra" / "config.yaml").write_text(text)
    return run_dir


DAMAGED_YAML = {
    "truncated": lambda text: text[: len(text) // 2] + "\n  bad: [",
    "binary": lambda _text: "\udcff",
    "empty": lambda _text: "",
    "not-a-mapping": lambda _text: "- a\n- b\n",
}


@pytest.mark.parametrize("damage", list(DAMAGED_YAML))
def test_a_damaged_config_yaml_is_rewritten_from_hydras_copy(tmp_path, damage):
    from rich.console import Console

    run_dir = hand_made_run(tmp_path)
    saved = run_dir / "config.yaml"
    original = saved.read_text()
    if damage == "binary":
        saved.write_bytes(b"\x89PNG\x00\xff\xfe")
    else:
        saved.write_text(DAMAGED_YAML[damage](original))
    console = Console(record=True, width=400)
    cfg = resumed_config(str(run_dir), tmp_path / "new", [], console)
    assert cfg.model.name == "tiny_random" and cfg.output_dir == str(run_dir) and cfg.resume is True
    printed = console.export_text()
    assert f"{saved} was damaged" in printed and "rewritten from" in printed
    assert OmegaConf.load(saved).model.name == "tiny_random"  # rewritten whole


def test_a_damaged_config_yaml_without_hydras_copy_fails_in_one_line(tmp_path):
    run_dir = hand_made_run(tmp_path)
    shutil.rmtree(run_dir / ".hydra")
    (run_dir / "config.yaml").write_text("model: {name: [\n")
    with pytest.raises(SavedConfigError) as info:
        resumed_config(str(run_dir), tmp_path / "new", [])
    message = str(info.value)
    assert message.startswith(f"{run_dir / 'config.yaml'} is damaged (not valid YAML") and "\n" not in message
    assert "start a new run without resume=" in message


@pytest.mark.parametrize("content", ['{"command": "grpo-run", "overr', "\x00\x01", "[1, 2]", ""])
def test_a_damaged_run_info_json_is_kept_aside_and_written_anew(tmp_path, content):
    (tmp_path / "run_info.json").write_text(content)
    info = {"command": "grpo-run resume=x", "created_utc": "t1", "git": {}, "packages": {}}
    message = write_run_info(tmp_path, info, resumed=True)
    assert message.startswith(f"{tmp_path / 'run_info.json'} was damaged") and "run_info.json.damaged" in message
    assert json.loads((tmp_path / "run_info.json").read_text()) == info
    assert (tmp_path / "run_info.json.damaged").read_text() == content  # nothing thrown away
    assert write_run_info(tmp_path, {**info, "created_utc": "t2"}, resumed=True) is None  # intact now


def test_metrics_jsonl_drops_a_torn_last_line_and_names_a_damaged_middle_line(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 0, "eval/reward": 0.1}\n{"step": 1, "train/loss": 0.5}\n{"step": 2, "tra')
    assert "dropped its last line" in truncate_metrics(metrics, last_step=2)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [0, 1]
    metrics.write_text('{"step": 0}\n\x00\x00garbage\n{"step": 1}\n')
    with pytest.raises(UserFacingError, match=rf"^{metrics}:2 is not a metrics line"):
        truncate_metrics(metrics, last_step=1)


@pytest.mark.parametrize("content", [b"\xff\xfe\x00", b"", b"abc def\n", b"x" * 500])
def test_a_damaged_wandb_run_id_file_starts_a_new_wandb_run_with_one_message(tmp_path, content):
    pytest.importorskip("wandb")
    from grpo_cli.tracking.wandb_sink import RUN_ID_FILE, read_run_id

    (tmp_path / RUN_ID_FILE).write_bytes(content)
    run_id, message = read_run_id(tmp_path)
    assert run_id is None and message is not None and str(tmp_path / RUN_ID_FILE) in message
    (tmp_path / RUN_ID_FILE).write_text("abc123xy\n")
    assert read_run_id(tmp_path) == ("abc123xy", None)


# A checkpoint damaged in a way its COMPLETE sizes do not show (same size, other bytes; a hand edit).
DAMAGED_CHECKPOINT = {
    "state.json not JSON": ("state.json", lambda data: b"{" * len(data)),
    "state.json without the sampler": ("state.json", lambda data: json.dumps({"step": 2}).encode().ljust(len(data))),
    "rng.pt garbage": ("rng.pt", lambda data: b"\0" * len(data)),
    "optimizer.pt garbage": ("optimizer.pt", lambda data: b"\0" * len(data)),
    "COMPLETE not JSON": ("COMPLETE", lambda data: b"\xff" * len(data)),
}


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    from rich.console import Console

    from grpo_cli.drivers.loop import TrainingLoop
    from grpo_cli.learner.checkpoint import list_checkpoints
    from tests.conftest import compose_config

    overrides = ["debug=smoke", "train.steps=2", "train.checkpoint_every=1", "train.eval_every=0"]
    first = tmp_path / "first"
    TrainingLoop(compose_config(overrides, output_dir=str(first)), first, Console(quiet=True)).run()
    for name, (file, damage) in DAMAGED_CHECKPOINT.items():
        run_dir = tmp_path / name.replace(" ", "_")
        shutil.copytree(first, run_dir)
        newest = list_checkpoints(run_dir)[-1]
        (newest / file).write_bytes(damage((newest / file).read_bytes()))
        console = Console(record=True, width=400)
        cfg = compose_config([*overrides, "resume=true"], output_dir=str(run_dir))
        loop = TrainingLoop(cfg, run_dir, console)
        loop.close()
        printed = console.export_text()
        assert loop.start_step == 1, name
        assert f"skipping checkpoint {newest}" in printed and "resumed" in printed, (name, printed)


@pytest.mark.parametrize(
    ("failure", "free_bytes", "why"),
    [
        # What torch.save raised when the disk filled up during the ablation sweeps (2026-11-23): a raw traceback.
        (
            RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1022732672 vs 1022732560"),
            10**3,
            "no space left on the device (0.0 GB free",
        ),
        (OSError(28, "No space left on device"), 10**12, "no space left on the device"),
        (PermissionError(13, "Permission denied"), 10**12, "PermissionError: [Errno 13] Permission denied"),
    ],
)
def test_a_checkpoint_that_cannot_be_written_is_one_line_and_keeps_the_previous_one(
    tmp_path, monkeypatch, failure, free_bytes, why
):
    from rich.console import Console

    from grpo_cli.drivers.loop import TrainingLoop
    from grpo_cli.learner import checkpoint
    from grpo_cli.learner.checkpoint import list_checkpoints
    from tests.conftest import compose_config

    real_save, real_usage = checkpoint.torch.save, shutil.disk_usage

    def save_failing_at_step_2(obj, path, *args, **kwargs):
        if "step_000002" in str(path):
            Path(path).write_bytes(b"\0" * 1000)  # half a file, as a full disk leaves it
            raise failure
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", save_failing_at_step_2)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real_usage(path)._replace(free=free_bytes))
    overrides = ["debug=smoke", "train.steps=2", "train.checkpoint_every=1", "train.eval_every=0"]
    run_dir = tmp_path / "run"
    loop = TrainingLoop(compose_config(overrides, output_dir=str(run_dir)), run_dir, Console(quiet=True))
    with pytest.raises(UserFacingError) as info:
        loop.run()
    loop.close()
    message = str(info.value)
    assert message.startswith(f"could not write checkpoint {run_dir / 'checkpoints' / 'step_000002'}: {why}")
    assert message.endswith(
        f"checkpoint step_000001 and the metrics so far are kept: continue with: grpo-run resume={run_dir}"
    )
    assert "\n" not in message
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_000001"]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_000001"]  # no half-written directory
    assert max(row["step"] for row in read_metrics(run_dir / "metrics.jsonl")) == 2


def test_an_internal_error_prints_one_line_with_the_log_holding_the_traceback(tmp_path, monkeypatch, capsys):
    def broken(*_args, **_kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(cli.jobs, "run_job", broken)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(cli, "_full_error_asked", False)
    run_dir = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["grpo-run", "model=tiny_random", f"hydra.run.dir={run_dir}"])
    with pytest.raises(SystemExit) as info:
        cli.main()
    assert info.value.code == 1
    stderr = capsys.readouterr().err.strip()
    assert len(stderr.splitlines()) == 1, stderr
    assert stderr.startswith("grpo-run: internal error: RuntimeError: boom (full traceback in ")
    log = Path(stderr.rpartition("full traceback in ")[2].rstrip(")"))
    assert log.parent == run_dir and "Traceback" in log.read_text() and "boom" in log.read_text()


def test_a_run_stopped_by_bad_input_ends_with_the_error_prefix_the_docs_show():
    """A reward (or environment) failing under task.on_reward_error=stop after step 1 stops the run with its update
    saved (RunStopped, exit code 2): its line reads `grpo-run: error: ...` as docs/custom-tasks.md shows; a stop by a
    signal is not an error (issue #39)."""
    from grpo_cli.errors import EXIT_DIVERGED, EXIT_USER_ERROR, RunStopped

    failed = RunStopped("reward task.rewards.r=r.py:reward raised ValueError: x on row {}: fix it", EXIT_USER_ERROR)
    assert cli.stop_line(failed) == f"grpo-run: error: {failed}"
    assert (
        cli.stop_line(RunStopped("stopped by SIGTERM after step 2", 143)) == "grpo-run: stopped by SIGTERM after step 2"
    )
    assert cli.stop_line(RunStopped("loss was not finite", EXIT_DIVERGED)).startswith("grpo-run: loss")
