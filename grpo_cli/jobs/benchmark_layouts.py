"""`job=benchmark job.length_profile=long_tail`: the learner's microbatch layouts timed side by side on one forced
rollout batch (no generation), so every layout trains on exactly the same tokens.

The batch: train.rollout_batch_size completions of the task's first prompts (train.group_size each), their lengths
drawn once from a Zipf-like law on [16, 512] tokens (p(L) ~ 1/L: many short completions, a few long ones, as
reasoning RL produces), their token ids random. Measured, `job.steps` updates each (the optimizer steps run):

- `today`: train.gradient_accumulation_steps runs of equal row counts, each padded to its longest row;
- `token budget`: train.microbatch_tokens' microbatches (null: at most today's largest microbatch's positions on
  this batch, i.e. no more memory than today), with the ranks balanced by tokens under distributed=ddp|fsdp;
- `packed`: the token budget's microbatches with train.pack_sequences (a second learner, the same weights: each
  microbatch's sequences concatenated into rows without padding, where the model's probe lets it pack; where not,
  the padded token budget again, said in the log);
- `equal lengths`: today's layout on the same prompts with every completion of the mean length (the same tokens
  summed, no padding): what the step would cost without a tail.

With distributed=ddp|fsdp and distributed.nproc_per_node=N the comparison runs on N gloo ranks of this machine
(torch.multiprocessing, CPU): each rank takes its share of the prompts in `today`, the token-balanced share in
`token budget`, and perf/rank_idle_s says how long a rank waited for the slowest.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import random
import socket
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from rich.table import Table

from grpo_cli.batch.microbatches import TokenCounts, fixed_microbatches, positions_processed
from grpo_cli.batch.rollout_data import RolloutData, select_completions
from grpo_cli.rollout import render_prompts
from grpo_cli.tasks import load_examples

if TYPE_CHECKING:
    from rich.console import Console

    from grpo_cli.config.schemas import GRPOConfig

SHORTEST, LONGEST = 16, 512  # the long-tail profile's completion lengths
LAYOUTS = ("today", "token budget", "packed", "equal lengths")


def long_tail_lengths(n: int, seed: int) -> list[int]:
    """`n` completion lengths from p(L) ~ 1/L on [SHORTEST, LONGEST] (log-uniform: Zipf's law with exponent 1)."""
    rng = random.Random(seed)
    return [min(LONGEST, int(SHORTEST * (LONGEST / SHORTEST) ** rng.random())) for _ in range(n)]


def equal_lengths(lengths: list[int]) -> list[int]:
    """As many lengths as `lengths`, as equal as integers allow, with the same sum."""
    mean, extra = divmod(sum(lengths), len(lengths))
    return [mean + (i < extra) for i in range(len(lengths))]


def forced_batch(prompt_ids: list[list[int]], lengths: list[int], vocab: int, seed: int) -> RolloutData:
    """A scored rollout batch of `prompt_ids` with random completions of `lengths` tokens and advantages of both
    signs (every completion in the loss)."""
    generator = torch.Generator().manual_seed(seed)
    completions = [torch.randint(100, vocab, (n,), generator=generator).tolist() for n in lengths]
    advantages = torch.randn(len(lengths), generator=generator)
    return RolloutData(prompt_ids, completions, (advantages > 0).float(), advantages)


def prompts_of_batch(cfg: GRPOConfig, tokenizer: Any) -> list[list[int]]:
    """The rollout batch's prompt ids: the task's first prompts, each train.group_size times."""
    examples = load_examples(cfg.task, "train")[: cfg.train.rollout_batch_size // cfg.train.group_size]
    return [ids for ids in render_prompts([e.prompt for e in examples], tokenizer) for _ in range(cfg.train.group_size)]


def largest_fixed_microbatch(data: RolloutData, microbatch_size: int, share_prompts: bool) -> int:
    """The positions of today's largest microbatch of `data`: the token budget that needs no more memory."""
    counts = TokenCounts.of(data.prompt_ids, data.completion_ids)
    rows = list(range(len(data.completion_ids)))
    return max(positions_processed(counts, mb, share_prompts)[0] for mb in fixed_microbatches(rows, microbatch_size))


def measure_layouts(cfg: GRPOConfig, output_dir: Path) -> dict[str, Any]:
    """This process's (rank's) figures of every layout: median seconds per update and the perf/* metrics."""
    from grpo_cli.distributed import parallel
    from grpo_cli.learner.learner import Learner

    learner = Learner(cfg, output_dir)
    world = parallel.world()
    prompt_ids = prompts_of_batch(cfg, learner.tokenizer)
    lengths = long_tail_lengths(len(prompt_ids), cfg.seed)
    vocab = len(learner.tokenizer)
    batches = {
        "today": forced_batch(prompt_ids, lengths, vocab, cfg.seed),
        "equal lengths": forced_batch(prompt_ids, equal_lengths(lengths), vocab, cfg.seed),
    }
    batches["token budget"] = batches["packed"] = batches["today"]
    budget = cfg.train.microbatch_tokens or largest_fixed_microbatch(
        batches["today"], learner.shape.microbatch_size, learner.share_prompts
    )
    shape = learner.shape
    results: dict[str, Any] = {"budget": budget, "lengths": lengths, "ranks": world.size, "layouts": {}}
    learners = {name: learner for name in LAYOUTS}
    learners["packed"] = _packed_learner(cfg, learner, output_dir / "packed")
    for name in LAYOUTS:
        tokens = budget if name in ("token budget", "packed") else None
        learner = learners[name]
        learner.shape = dataclasses.replace(shape, microbatch_tokens=tokens)
        learner.scoring = dataclasses.replace(learner.scoring, microbatch_tokens=tokens)
        learner.balance_ranks = world.distributed and tokens is not None
        data = batches[name]
        if world.distributed and not learner.balance_ranks:  # today: this rank's share of the prompts
            share = len(data.completion_ids) // world.size
            data = select_completions(data, list(range(world.rank * share, (world.rank + 1) * share)))
        seconds, steps = [], []
        for step in range(1, cfg.job.steps + 1):
            parallel.barrier()
            started = time.perf_counter()
            metrics = learner.update(copy.copy(data), step)
            seconds.append(time.perf_counter() - started)
            steps.append(parallel.reduce_metrics(metrics))
        slowest = parallel.all_gather_objects(statistics.median(seconds))
        results["layouts"][name] = {
            "train_s": max(slowest),  # the slowest rank sets the step's pace
            **{key: statistics.median(m[key] for m in steps) for key in steps[0] if key.startswith("perf/")},
            "train_tokens": statistics.median(m["throughput/train_tokens"] for m in steps),
        }
    return results


def _packed_learner(cfg: GRPOConfig, learner: Any, output_dir: Path) -> Any:
    """A learner like `learner` (its weights copied) whose forward passes run packed rows (train.pack_sequences):
    the packed layout is decided once, when a learner is built (its probe), so it takes its own."""
    from omegaconf import OmegaConf

    from grpo_cli.learner.learner import Learner

    packed_cfg = copy.deepcopy(cfg)
    if OmegaConf.is_config(packed_cfg):
        OmegaConf.set_readonly(cast(Any, packed_cfg), False)
    packed_cfg.train.pack_sequences = True
    packed = Learner(packed_cfg, output_dir)
    packed.model.load_state_dict(learner.model.state_dict())
    return packed


def _rank(rank: int, size: int, port: int, cfg: GRPOConfig, output_dir: Path, results: dict) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        figures = measure_layouts(cfg, output_dir / f"rank{rank}")
        if rank == 0:
            results["figures"] = figures
    finally:
        dist.destroy_process_group()


def compare_layouts(cfg: GRPOConfig, output_dir: Path, console: Console) -> dict[str, Any]:
    """measure_layouts in this process, or on distributed.nproc_per_node gloo ranks under distributed=ddp|fsdp."""
    cfg = copy.deepcopy(cfg)
    cfg.logger.backend = "none"
    cfg.model.device = "cpu" if cfg.distributed.strategy != "none" else cfg.model.device
    ranks = cfg.distributed.nproc_per_node if cfg.distributed.strategy != "none" else 1
    console.print(f"length profile {cfg.job.length_profile}: {ranks} rank(s), {cfg.job.steps} updates per layout")
    if ranks == 1:
        figures = measure_layouts(cfg, output_dir)
    else:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with mp.Manager() as manager:
            shared = manager.dict()
            mp.spawn(_rank, args=(ranks, port, cfg, output_dir, shared), nprocs=ranks)
            figures = dict(shared)["figures"]
    return figures


def layouts_table(figures: dict[str, Any], cfg: GRPOConfig) -> Table:
    lengths = figures["lengths"]
    table = Table(
        title=(
            f"Microbatch layouts: {cfg.model.name}, {len(lengths)} completions of {min(lengths)}-{max(lengths)} "
            f"tokens (long tail, mean {statistics.mean(lengths):.0f}), {figures['ranks']} rank(s), token budget "
            f"{figures['budget']}, median of {cfg.job.steps} updates"
        )
    )
    table.add_column("")
    for name in LAYOUTS:
        table.add_column(name, justify="right")
    rows = (
        ("train seconds per update", "train_s", ".2f"),
        ("perf/padding_frac", "perf/padding_frac", ".3f"),
        ("positions per microbatch, mean", "perf/microbatch_tokens_mean", ".0f"),
        ("positions per microbatch, max", "perf/microbatch_tokens_max", ".0f"),
        ("rank token imbalance (max/mean)", "perf/rank_token_imbalance", ".2f"),
        ("rank idle seconds (mean)", "perf/rank_idle_s", ".2f"),
        ("rank idle seconds (max)", "perf/rank_idle_s_max", ".2f"),
    )
    layouts = figures["layouts"]
    for label, key, fmt in rows:
        table.add_row(label, *(format(layouts[name][key], fmt) for name in LAYOUTS))
    equal = layouts["equal lengths"]["train_s"]
    table.add_row("x the equal-length batch's time", *(f"{layouts[name]['train_s'] / equal:.2f}" for name in LAYOUTS))
    return table
