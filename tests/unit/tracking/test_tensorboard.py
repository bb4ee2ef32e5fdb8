"""logger=tensorboard: the sink read back with TensorBoard's own EventAccumulator, its pairing with metrics.jsonl,
a resumed run's purge, the missing-package error, and one real `grpo-run` training step."""

import importlib.util
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from grpo_cli.config import validate_config
from grpo_cli.errors import UserFacingError
from grpo_cli.jobs.preflight import preflight
from grpo_cli.tracking import FanOutSink, JsonlMetricsSink, build_metrics_sink, read_metrics
from grpo_cli.tracking.tensorboard_sink import (
    MISSING_PACKAGE,
    SAMPLES_TAG,
    TensorBoardSink,
    resume_purge_step,
    samples_markdown,
    scalar_metrics,
)
from tests.conftest import compose_config

TEXT_TAG = f"{SAMPLES_TAG}/text_summary"  # torch's add_text stores the text under <tag>/text_summary


def tensorboard_config(output_dir: Path, *overrides: str):
    return compose_config(["debug=smoke", "logger=tensorboard", *overrides], output_dir=str(output_dir))


def read_events(log_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def scalars(events: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, pytest.approx(e.value)) for e in events.Scalars(tag)]


def texts(events: EventAccumulator) -> dict[int, str]:
    return {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors(TEXT_TAG)}


def start_sink(output_dir: Path, *overrides: str) -> TensorBoardSink:
    return TensorBoardSink.start(tensorboard_config(output_dir, *overrides), output_dir, Console(quiet=True))


def test_every_metric_is_a_scalar_at_its_step_and_eval_samples_are_text(tmp_path):
    sink = start_sink(tmp_path)
    sink.log({"eval/reward": 0.25, "eval/format_rate": 1}, step=0)
    sink.log({"train/reward": 0.5, "train/loss": torch.tensor(1.25), "train/skipped": True, "note": "text"}, step=1)
    sink.log({"train/reward": float("nan")}, step=2)
    rows = [
        {"prompt": "If you add 40 and 2?", "response": "```\n42\n```", "ground_truth": 42, "reward": 1.0},
        {"prompt": "p", "response": "r", "ground_truth": ["apple", "red"], "reward": 0.0, "format_reward": 1.0},
    ]
    sink.log_samples(rows, step=2)
    sink.close()
    sink.close()  # idempotent, like the other sinks

    events = read_events(tmp_path / "tensorboard")
    assert scalars(events, "eval/reward") == [(0, 0.25)]
    assert scalars(events, "train/loss") == [(1, 1.25)] and scalars(events, "train/skipped") == [(1, 1.0)]
    assert [e.step for e in events.Scalars("train/reward")] == [1, 2]
    assert events.Scalars("train/reward")[1].value != events.Scalars("train/reward")[1].value  # NaN stays NaN
    assert "note" not in events.Tags()["scalars"]
    (text,) = texts(events).values()
    assert list(texts(events)) == [2]
    assert "### Sample 1 (reward 1)" in text and "If you add 40 and 2?" in text
    assert "````\n```\n42\n```\n````" in text  # a fence longer than the response's own backticks
    assert '["apple", "red"]' in text and "### Sample 2 (reward 0, format_reward 1)" in text


def test_samples_follow_samples_every_and_samples_rows(tmp_path):
    sink = start_sink(tmp_path, "logger.samples_every=2", "logger.samples_rows=1")
    rows = [{"prompt": f"p{i}", "response": f"r{i}", "ground_truth": i, "reward": 0.0} for i in range(3)]
    for step in (1, 2, 3, 4):
        sink.log_samples(rows, step=step)
    sink.close()
    logged = texts(read_events(tmp_path / "tensorboard"))
    assert sorted(logged) == [2, 4]
    assert "r0" in logged[2] and "Sample 2" not in logged[2]


def test_samples_markdown_and_scalar_metrics_are_pure():
    assert samples_markdown([], 5) == ""
    text = samples_markdown([{"prompt": "a", "response": "``x``", "ground_truth": "7", "reward": 0.5}], 5)
    assert text == "### Sample 1 (reward 0.5)\n\n**ground truth**\n\n```\n7\n```\n\n**prompt**\n\n```\na\n```\n\n" + (
        "**response**\n\n```\n``x``\n```"
    )
    assert scalar_metrics({"a": 1, "b": torch.tensor(2.5), "c": None, "d": "x", "e": False}) == {
        "a": 1.0,
        "b": 2.5,
        "e": 0.0,
    }


def test_build_metrics_sink_writes_metrics_jsonl_and_the_same_scalars(tmp_path):
    cfg = tensorboard_config(tmp_path)
    validate_config(cfg)
    sink = build_metrics_sink(cfg, tmp_path, Console(quiet=True))
    assert isinstance(sink, FanOutSink)
    assert [type(s) for s in sink.sinks] == [JsonlMetricsSink, TensorBoardSink]
    for step in range(3):
        sink.log({"train/reward": step / 4}, step=step)
    sink.close()
    on_disk = [(row["step"], row["train/reward"]) for row in read_metrics(tmp_path / "metrics.jsonl")]
    assert scalars(read_events(tmp_path / "tensorboard"), "train/reward") == on_disk


def test_a_resumed_run_hides_the_steps_it_logs_again(tmp_path):
    first = start_sink(tmp_path)
    for step in range(4):
        first.log({"train/reward": float(step)}, step=step)
    first.close()
    # the trainer kept metrics.jsonl up to its step-1 checkpoint and logs steps 2 and 3 again
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    assert resume_purge_step(tmp_path / "metrics.jsonl") == 2
    time.sleep(1.1)  # event files sort by their creation second: the resumed run's file must come after
    resumed = start_sink(tmp_path, f"resume={tmp_path}")
    for step in (2, 3):
        resumed.log({"train/reward": 10.0 + step}, step=step)
    resumed.close()
    assert scalars(read_events(tmp_path / "tensorboard"), "train/reward") == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)]


def test_resume_purge_step_without_kept_metrics_is_zero(tmp_path):
    assert resume_purge_step(tmp_path / "metrics.jsonl") == 0
    (tmp_path / "metrics.jsonl").write_text("")
    assert resume_purge_step(tmp_path / "metrics.jsonl") == 0


def test_a_missing_package_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real_find_spec(name, *a)
    )
    with pytest.raises(UserFacingError) as info:
        preflight(tensorboard_config(tmp_path), ("eval",), tmp_path, [])
    assert str(info.value) == MISSING_PACKAGE and "grpo-cli[tensorboard]" in MISSING_PACKAGE
    preflight(compose_config(["debug=smoke"], output_dir=str(tmp_path)), ("eval",), tmp_path, [])  # others need none
    # A job that loads nothing (check_reward) validates without it: presets naming tensorboard still check.
    validate_config(tensorboard_config(tmp_path))
