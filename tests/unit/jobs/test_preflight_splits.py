"""task=math offline: both splits that need the hub are said in one line (it stopped at the train split, and a
second run found the test split), each with the key that gives a local file instead."""

from __future__ import annotations

import pytest

from grpo_cli.errors import UserFacingError
from grpo_cli.jobs.preflight import load_splits
from tests.conftest import compose_config


def test_every_split_that_cannot_load_is_said_at_once(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache: nothing of hiyouga/math12k here
    with pytest.raises(UserFacingError) as error:
        load_splits(compose_config(["task=math"]), ("train", "eval"))
    line = str(error.value)
    assert "\n" not in line
    assert "split 'train'" in line and "task.train_path=..." in line
    assert "split 'test'" in line and "task.eval_path=..." in line
    # One split that loads, one that cannot: that one alone, as before.
    with pytest.raises(UserFacingError) as error:
        load_splits(
            compose_config(["task=math", "task.train_path=tests/fixtures/math500_sample.jsonl"]), ("train", "eval")
        )
    assert "split 'train'" not in str(error.value) and "task.eval_path=..." in str(error.value)
