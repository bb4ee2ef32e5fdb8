"""Data parallelism through torch.distributed: the process group, the model wrappers (DDP, FSDP2) and the few
collectives a GRPO step needs. No communication of our own: every exchange is a torch.distributed call.

A rank knows who it is from the environment torch's launchers set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), whether `grpo-run` started the ranks itself (grpo_cli/distributed/launch.py) or torchrun / srun did.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

# How each metric combines across ranks; anything not listed is a mean (ranks hold equal shares).
_SUMMED_SUFFIXES = (
    "reward_errors",
    "reward_timeouts",
    "n_tokens",
    "/train_tokens",
    "/response_tokens",
    "/groups_dropped",
    "/groups_trained",
    "/groups_short",
)


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def world() -> World:
    """This process's place in the data-parallel group (rank 0 of 1 outside one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return World()
    return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))


def launched_as_rank() -> bool:
    """Whether a launcher (ours, torchrun, srun) started this process as one rank of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def resolve_backend(backend: str, device_type: str) -> str:
    """distributed.backend=auto: NCCL between CUDA devices, gloo on CPU."""
    if backend != "auto":
        return backend
    return "nccl" if device_type == "cuda" else "gloo"


def init_process_group(backend: str, device_type: str, timeout_min: float) -> World:
    """Join the group the launcher described in the environment; on CUDA each rank takes its LOCAL_RANK's GPU."""
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group(backend=resolve_backend(backend, device_type), timeout=timedelta(minutes=timeout_min))
    return world()


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def broadcast_object(value: T, src: int = 0) -> T:
    """Rank src's value on every rank (e.g. the run directory rank 0 picked)."""
    if not world().distributed:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def barrier() -> None:
    if world().distributed:
        dist.barrier()


def any_rank(flag: bool) -> bool:
    """True on every rank when the flag is set on any rank (a signal, a non-finite gradient): the ranks must
    take the same branch, or the next collective waits forever."""
    if not world().distributed:
        return flag
    value = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def all_gather_objects(value: T) -> list[T]:
    """Every rank's `value`, in rank order (picklable objects: a rollout batch, log-probs by row); [value] outside
    a process group."""
    if not world().distributed:
        return [value]
    gathered: list[object] = [None] * world().size
    dist.all_gather_object(gathered, value)
    return gathered  # type: ignore[return-value]


def all_gather_tensors(values: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's 1-D `values` (lengths may differ), in rank order, as float32 on `values`' device; [values]
    outside a process group. Two all_gathers: the lengths, then the values padded to the longest (on the device
    the backend communicates on: CUDA under NCCL, the CPU under gloo)."""
    values = values.detach().reshape(-1).float()
    if not world().distributed:
        return [values]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world().size)]
    dist.all_gather(lengths, torch.tensor([values.numel()], dtype=torch.int64, device=device))
    counts = [int(n.item()) for n in lengths]
    padded = torch.zeros(max(counts), dtype=torch.float32, device=device)
    padded[: values.numel()] = values.to(device)
    gathered = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(gathered, padded)
    return [row[:n].to(values.device) for row, n in zip(gathered, counts, strict=True)]


def wait_for_ranks() -> float:
    """Seconds this rank waits for the slowest one at a barrier (0 outside a process group): its idle time before
    a synchronizing step."""
    if not world().distributed:
        return 0.0
    started = time.perf_counter()
    dist.barrier()
    return time.perf_counter() - started


def sum_over_ranks(values: list[float]) -> list[float]:
    """Each value summed over every rank (a step's token count); the values themselves outside a process group."""
    if not world().distributed:
        return list(values)
    summed = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    return summed.tolist()


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's value (the groups every rank can train on)."""
    if not world().distributed:
        return value
    smallest = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    return int(smallest.item())


def reduce_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """One step's metrics over all ranks: counts and token totals add up, times and maxima take the largest (the
    slowest rank sets the pace), everything else is the mean of the ranks' equal shares. Every rank must call it
    with the same keys (they run the same code on equal shares)."""
    if not world().distributed:
        return metrics
    keys = sorted(metrics)
    gathered: list[object] = [None] * world().size
    dist.all_gather_object(gathered, keys)
    if any(other != keys for other in gathered):
        raise RuntimeError("ranks logged different metric names in one step: they are not running the same step")
    values = torch.tensor([float(metrics[key]) for key in keys], dtype=torch.float64)
    summed, largest = values.clone(), values.clone()
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    reduced = {}
    for index, key in enumerate(keys):
        if key.endswith(_SUMMED_SUFFIXES):
            reduced[key] = summed[index].item()
        elif key.startswith("time/") or key.endswith("_max"):
            reduced[key] = largest[index].item()
        else:
            reduced[key] = summed[index].item() / world().size
    return reduced


def reduce_std(values: torch.Tensor) -> float:
    """The standard deviation of the concatenation of every rank's `values` (sample std, like torch.std)."""
    if not world().distributed:
        return values.std().item() if len(values) > 1 else 0.0
    stats = torch.tensor([len(values), values.sum().item(), (values.double() ** 2).sum().item()], dtype=torch.float64)
    dist.all_reduce(stats)
    n, total, squares = stats.tolist()
    if n < 2:
        return 0.0
    variance = (squares - total * total / n) / (n - 1)
    return max(variance, 0.0) ** 0.5


def wrap_for_training(
    scorer: torch.nn.Module, strategy: str, device: torch.device, compute_dtype: torch.dtype | None
) -> torch.nn.Module:
    """The learner's scoring module under DDP or FSDP2 (unchanged without a process group).

    `scorer` wraps the policy and runs the training forward (grpo_cli/learner/learner.py), so the wrapper's hooks see
    exactly the computation training runs. FSDP2 shards each decoder layer, then the root (embeddings, final
    norm, head); its mixed-precision policy follows model.mixed_precision (bf16 compute, fp32 gradient
    reduction and fp32 master weights).
    """
    if not world().distributed or strategy == "none":
        return scorer
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if device.type != "cuda":
            return DistributedDataParallel(scorer)
        return DistributedDataParallel(scorer, device_ids=[device.index or torch.cuda.current_device()])
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # Without autocast, MixedPrecisionPolicy() is fully_shard's own default: no casting.
    policy = (
        MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        if compute_dtype
        else MixedPrecisionPolicy()
    )
    for layer in decoder_layers(scorer):
        fully_shard(layer, mp_policy=policy)
    fully_shard(scorer, mp_policy=policy)
    return scorer


def decoder_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks (the `layers` / `h` ModuleList of a Hugging Face decoder): FSDP2's units."""
    for name, child in module.named_modules():
        if isinstance(child, torch.nn.ModuleList) and name.split(".")[-1] in ("layers", "h", "blocks") and len(child):
            return list(child)
    raise ValueError("found no decoder layers to shard (a ModuleList named layers, h or blocks)")


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) parameter or optimizer state gathered whole on every rank; a plain tensor as is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` laid out as `like` is (its DTensor shard on this rank), or `full` itself for a plain tensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(like, DTensor):
        return distribute_tensor(full.to(like.device, like.dtype), like.device_mesh, like.placements)
    return full
