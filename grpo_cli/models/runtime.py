"""Where and how the numbers run: device, dtype, autocast, seeding, threads, and phase timings.

Every component (learner, rollout worker, jobs) asks these functions rather than deciding on its own, so one
run makes one decision about precision and placement.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import numpy as np
import torch

from grpo_cli.errors import UserFacingError

# Spellings of model.dtype; the schema declares the allowed values, these are what they mean.
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(device: str) -> torch.device:
    """Turn `model.device` (auto | cpu | cuda | cuda:N) into a torch device.

    "auto" picks CUDA when available, else the CPU. Asking for CUDA on a machine without it is an error rather
    than a silent fallback: a run that was meant for a GPU would otherwise crawl along on the CPU.
    """
    name = device.strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(name)
    except RuntimeError:
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise UserFacingError(f"model.device={device!r} is not a supported device: use auto, cpu or cuda")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise UserFacingError(
                f"model.device={device!r} but no CUDA device is available: use model.device=cpu or auto"
            )
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise UserFacingError(
                f"model.device={device!r} but only {torch.cuda.device_count()} CUDA device(s) exist: "
                "use model.device=cuda"
            )
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """Turn `model.dtype` (auto | float32 | bfloat16 | float16) into the dtype the weights are stored in.

    "auto" is float32 on every device: the weights are the optimizer's master copy, and AdamW's state follows
    them. In bf16 an lr-1e-5 step on a weight near 1.0 (a norm) is below half a bf16 ulp and rounds away, and
    about 16% of the steps on std-0.02 weights do. The speed of bf16 comes from autocast instead
    (`model.mixed_precision`, see `compute_dtype`). Pure half-precision weights only when asked for by name.
    """
    name = dtype.strip().lower()
    if name == "auto":
        return torch.float32
    if name not in DTYPES:
        raise UserFacingError(f"model.dtype={dtype!r} is not supported: use auto, float32, bfloat16 or float16")
    return DTYPES[name]


def pure_half_precision_warning(dtype: str) -> str | None:
    """The one warning line for half-precision weights (and so half-precision AdamW state), or None."""
    if DTYPES.get(dtype.strip().lower(), torch.float32) == torch.float32:
        return None
    return (
        f"model.dtype={dtype} stores the weights and AdamW's state in half precision, where small updates round "
        "away (lr 1e-5 on a weight near 1.0 is below half a bf16 step): use model.dtype=auto for fp32 master "
        "weights with bf16 autocast compute"
    )


def has_fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls run at least as fast as fp32 here: CUDA with bf16, or a CPU with AVX-512 BF16/AMX.

    Without those instructions (e.g. AVX2-only CPUs) PyTorch emulates bf16 matmuls, ~500x slower than fp32 on
    this project's AMD EPYC (0.3 vs 175 GFLOP/s), so `auto` keeps fp32 there.
    """
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(getattr(torch.cpu, name, lambda: False)() for name in checks)
    return False


def compute_dtype(device: torch.device, mixed_precision: str) -> torch.dtype | None:
    """The dtype forward passes autocast to (None: no autocast, compute in the weights' dtype).

    `model.mixed_precision`: bf16 | no | auto, where auto is bf16 where bf16 is fast (CUDA with bf16 support, a
    CPU with AVX-512 BF16 or AMX) and no elsewhere.
    """
    if mixed_precision == "auto":
        return torch.bfloat16 if has_fast_bf16(device) else None
    return torch.bfloat16 if mixed_precision == "bf16" else None


def autocast_factory(device: torch.device, mixed_precision: str) -> Callable[[], AbstractContextManager]:
    """A factory of the context that forward passes run in: bf16 autocast, or nothing."""
    dtype = compute_dtype(device, mixed_precision)
    if dtype is None:
        return nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed)


def limit_threads(threads: int) -> None:
    """Cap this process's intra-op threads (0: leave PyTorch's default). Two Ray actors on one machine must not
    each claim every core."""
    if threads:
        torch.set_num_threads(threads)


@contextmanager
def timed(metrics: dict[str, float], key: str) -> Iterator[None]:
    """Add the wall time of the block to `metrics[key]` (adds up when the block runs several times a step)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - start
