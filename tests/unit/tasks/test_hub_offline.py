"""Offline, a hub dataset that is in no local cache is one line at once: `datasets` is not asked (asked, it may
spend its retries first: `experiment=gsm8k_tools job=check_reward` once waited ~45 s through 44 of them)."""

import sys

import pytest

from grpo_cli.tasks import TaskDataError, load_examples
from grpo_cli.tasks.hub import hub_dataset_cached
from tests.conftest import FakeDatasets, compose_config


@pytest.fixture
def empty_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    return tmp_path / "hf"


@pytest.mark.parametrize(
    ("task", "split", "key"), [("gsm8k", "eval", "task.eval_path"), ("gsm8k_tools", "train", "task.train_path")]
)
def test_an_uncached_hub_dataset_offline_is_one_line_and_never_asks_datasets(
    task, split, key, empty_caches, monkeypatch
):
    fake = FakeDatasets([{"question": "1+1?", "answer": "#### 2"}])
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.raises(TaskDataError) as info:
        load_examples(compose_config([f"task={task}"]).task, split)
    message = str(info.value)
    assert "openai/gsm8k is not in the local cache and HF_HUB_OFFLINE is set" in message
    assert message.endswith(f"pass a local JSONL file with {key}=...") and "\n" not in message
    assert fake.calls == []


def test_a_cached_copy_or_being_online_lets_datasets_load_it(empty_caches, monkeypatch):
    fake = FakeDatasets([{"question": "1+1?", "answer": "#### 2"}])
    monkeypatch.setitem(sys.modules, "datasets", fake)
    (empty_caches / "hub" / "datasets--openai--gsm8k").mkdir(parents=True)  # the hub's snapshot layout
    assert hub_dataset_cached("openai/gsm8k")
    assert [e.ground_truth for e in load_examples(compose_config(["task=gsm8k"]).task, "eval")] == ["2"]
    (empty_caches / "hub" / "datasets--openai--gsm8k").rmdir()
    (empty_caches / "datasets" / "openai___gsm8k").mkdir(parents=True)  # datasets' own cache layout
    assert hub_dataset_cached("openai/gsm8k")
    (empty_caches / "datasets" / "openai___gsm8k").rmdir()
    assert not hub_dataset_cached("openai/gsm8k")
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    load_examples(compose_config(["task=gsm8k"]).task, "eval")  # online: datasets decides
    assert len(fake.calls) == 2
