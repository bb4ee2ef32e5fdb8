"""Offline (HF_HUB_OFFLINE, or no network), a hub dataset or model in no local cache is one line at once: neither
`datasets` nor huggingface_hub is asked (asked without a network they spend their retries first:
`experiment=gsm8k_tools job=check_reward` waited ~45 s through 20 retry warnings, each printed twice)."""

import socket
import sys
import time

import pytest

from grpo_cli.models import ModelLoadError, check_model_source
from grpo_cli.tasks import TaskDataError, hub, load_examples
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
    _online(monkeypatch, unreachable=None)
    load_examples(compose_config(["task=gsm8k"]).task, "eval")  # online: datasets decides
    assert len(fake.calls) == 2


def _online(monkeypatch, unreachable):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hub, "hub_unreachable", lambda: unreachable)


def test_without_a_network_an_uncached_dataset_or_model_is_one_line_at_once(empty_caches, monkeypatch):
    fake = FakeDatasets([])
    monkeypatch.setitem(sys.modules, "datasets", fake)
    _online(monkeypatch, unreachable="the hub (huggingface.co) cannot be reached (Name or service not known)")
    with pytest.raises(TaskDataError, match=r"openai/gsm8k is not in the local cache and the hub \(huggingface.co\) "):
        load_examples(compose_config(["task=gsm8k"]).task, "eval")
    assert fake.calls == []
    with pytest.raises(ModelLoadError) as info:
        check_model_source("grpo-cli-test/no-such-model")
    assert str(info.value) == (
        "model.name_or_path='grpo-cli-test/no-such-model' is not in the local Hugging Face cache and the hub "
        "(huggingface.co) cannot be reached (Name or service not known): download it where the hub is reachable, "
        "or point to a local directory"
    )


def test_the_probe_sees_a_closed_port_at_once_and_leaves_a_proxy_alone(monkeypatch):
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as sock:  # a port nobody listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{sock.getsockname()[1]}")
        hub.hub_unreachable.cache_clear()
        started = time.monotonic()
        why = hub.hub_unreachable()
    assert why is not None and why.startswith("the hub (127.0.0.1) cannot be reached (")
    assert time.monotonic() - started < 3
    hub.hub_unreachable.cache_clear()
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    assert hub.hub_unreachable() is None
    hub.hub_unreachable.cache_clear()
