"""A multi-turn run's training transcripts: one JSONL file per step in the run directory (episodes/step_00001.jsonl,
one line per episode) and a W&B table of the first logger.samples_rows episodes of each step."""

from __future__ import annotations

import json

from grpo_cli.tracking.jsonl import JsonlMetricsSink, transcript_text
from grpo_cli.tracking.sinks import FanOutSink
from grpo_cli.tracking.wandb_sink import EPISODE_COLUMNS, WandbSink

EPISODES = [
    {
        "messages": [{"role": "user", "content": "Guess."}, {"role": "assistant", "content": "5"}],
        "rewards": {"reward": 1.0, "reward/env": 1.0},
        "turns": 1,
        "truncated": False,
    },
    {
        "messages": [{"role": "user", "content": "Guess."}, {"role": "assistant", "content": "7"}],
        "rewards": {"reward": 0.0, "reward/env": 0.0},
        "turns": 3,
        "truncated": True,
    },
]


def test_each_steps_episodes_are_one_jsonl_file_in_the_run_directory(tmp_path) -> None:
    sink = FanOutSink([JsonlMetricsSink(tmp_path / "metrics.jsonl")])
    sink.log_episodes(EPISODES, step=3)
    sink.close()
    lines = (tmp_path / "episodes" / "step_00003.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == EPISODES


class FakeRun:
    def __init__(self) -> None:
        self.logged: list[dict] = []

    def log(self, values: dict) -> None:
        self.logged.append(values)


def test_wandb_shows_the_first_samples_rows_episodes_of_each_step() -> None:
    run = FakeRun()
    WandbSink(run, samples_every=5, samples_rows=1).log_episodes(EPISODES, step=2)
    (logged,) = run.logged
    table = logged["train/episodes"]
    assert list(table.columns) == list(EPISODE_COLUMNS)
    assert table.data == [[2, "[user] Guess.\n\n[assistant] 5", 1.0, 1, False]]
    assert transcript_text(EPISODES[1]["messages"]).endswith("[assistant] 7")
    WandbSink(run, samples_every=0, samples_rows=1).log_episodes(EPISODES, step=3)  # tables off: nothing logged
    assert len(run.logged) == 1


def test_tensorboard_shows_the_first_samples_rows_episodes_as_text(tmp_path) -> None:
    from tests.unit.tracking.test_tensorboard import read_events, start_sink

    sink = start_sink(tmp_path, "logger.samples_rows=1")
    sink.log_episodes(EPISODES, step=4)
    sink.close()
    events = read_events(tmp_path / "tensorboard")
    (event,) = events.Tensors("train/episodes/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 4 and "### Episode 1 (reward 1, 1 turns)" in text and "[assistant] 5" in text
    assert "Episode 2" not in text
