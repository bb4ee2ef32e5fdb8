"""`job=benchmark`: seconds per GRPO step and where they go, per rollout engine, against the machine's limits.

For each engine (`job.engines`; `auto` = transformers, plus vLLM when it is installed) the job builds the
real trainer for the configured setting in this fresh process and runs `job.steps` steps through the same
`train_step` a run uses (`job.warmup_steps` more first, left out of the figures; 0 by default, so the median
includes the first step's warm-up and any compilation, as a run pays them), then prints one table:

- seconds per step (median, min) and the breakdown the trainer logs (generation, scoring, old/reference
  log-probs, forward+backward, optimizer, weight sync and its probe); for rollout=hf generation is split into
  prefill, decode steps and sampling, and the decode step's time sits beside its floor: the same matmuls
  (every linear layer of the model at the step's rows) timed alone on this device;
- rollout-only generation speed on one fixed batch with every completion forced to `rollout.max_tokens`
  (identical token counts for every engine), measured after the steps, and generation tokens/s inside the steps;
- training tokens/s and achieved training GFLOP/s (FLOPs of forward+backward over the tokens the model really
  processed — a prompt shared by its G completions counts once — 6 x non-embedding parameters per token +
  6 x vocab x hidden per scored response token) beside the
  measured peak of a large matmul on this device, so the distance from the physical limit is visible.

`job.scaling=true` adds how the cost grows: seconds per step and tokens/s as the rollout batch grows
(`job.scaling_batches`, at rollout.max_tokens) and as the completion length grows (`job.scaling_max_tokens`, at
train.rollout_batch_size), every completion forced to max_tokens so the work is what the axis says; a table and
`scaling.png`.

Figures are medians over the measured steps and land in `benchmark.json` beside the table. This is a
measuring tool, not a test: run it on a quiet machine.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import math
import multiprocessing
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from rich.table import Table

from grpo_cli.config import allowed_values, rollout_config_for
from grpo_cli.drivers.local import InProcessExecutor
from grpo_cli.drivers.prompts import PromptSampler
from grpo_cli.engines.decode import SkinnyLinear
from grpo_cli.errors import UserFacingError
from grpo_cli.models.runtime import compute_dtype, has_fast_bf16, resolve_device, resolve_dtype, timed
from grpo_cli.rollout import render_prompts
from grpo_cli.rollout.worker import sampling_settings
from grpo_cli.tasks import load_examples

if TYPE_CHECKING:
    from rich.console import Console
    from transformers import PreTrainedModel

    from grpo_cli.config.schemas import GRPOConfig
    from grpo_cli.engines.base import RolloutEngine

# Breakdown rows: (label, metric key). forward+backward and optimizer split the trainer's training time.
BREAKDOWN = (
    ("generation", "time/generation_s"),
    ("scoring", "time/scoring_s"),
    ("old log-probs", "time/old_log_probs_s"),
    ("reference log-probs", "time/ref_log_probs_s"),
    ("forward+backward", "time/forward_backward_s"),
    ("optimizer", "time/optimizer_s"),
    ("weight sync", "time/sync_s"),
    ("weight sync probe", "time/sync_probe_s"),
)
# rollout=hf only: the generation time by phase (the engine's decoder times its last call).
GENERATION_PHASES = (("prefill", "prefill_s"), ("decode steps", "forward_s"), ("sampling", "sampling_s"))


def resolve_engines(requested: list[str]) -> list[str]:
    """`auto` means every engine that can run here; unknown names are a one-line error."""
    engines: list[str] = []
    for name in requested:
        if name == "auto":
            engines += ["hf"] + (["vllm"] if importlib.util.find_spec("vllm") is not None else [])
        elif name in allowed_values("rollout.engine"):
            engines.append(name)
        else:
            engines_text = ", ".join(allowed_values("rollout.engine"))
            raise UserFacingError(f"job.engines contains {name!r}: use {engines_text} or auto")
    return list(dict.fromkeys(engines))


def resolve_precisions(requested: list[str], device: torch.device) -> tuple[list[str], str | None]:
    """The model.mixed_precision values to measure, and why bf16 is not among them when `auto` left it out.

    `auto` stands for both precisions where bf16 is fast here (the precision every GPU user trains in, and the
    fp32 it replaces) and for `no` alone where it is not: an AVX2-only CPU emulates bf16 matmuls, hundreds of
    times slower, so its figure would time the emulation, not the change under test."""
    precisions: list[str] = []
    note = None
    for name in requested:
        if name != "auto":
            precisions.append(name)
        elif has_fast_bf16(device):
            precisions += ["bf16", "no"]
        else:
            precisions.append("no")
            note = (
                f"bf16 not measured: {device} has no fast bf16 (a CPU without AVX-512 BF16 or AMX emulates its "
                "matmuls); job.precisions=[bf16,no] measures it anyway"
            )
    return list(dict.fromkeys(precisions)), note


def matmul_peak_gflops(device: torch.device, dtype: torch.dtype, size: int = 2048, seconds: float = 1.0) -> float:
    """Best observed GFLOP/s of a size x size matmul on `device` in `dtype` (a practical compute ceiling)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = 0.0
    for _ in range(2):  # warm-up: thread pools, kernel selection
        a @ b
    deadline = time.perf_counter() + seconds
    runs = 0
    while runs < 3 or time.perf_counter() < deadline:
        runs += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 2 * size**3 / (time.perf_counter() - started) / 1e9)
    return best


def base_model(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers causal LM of the policy, under peft's LoRA wrapper if there is one."""
    get_base_model = getattr(model, "get_base_model", None)
    # The policy is a PreTrainedModel, or a peft model around one (the trainer loads nothing else).
    return cast("PreTrainedModel", model if get_base_model is None else get_base_model())


def parameter_counts(model: torch.nn.Module) -> tuple[int, int, int]:
    """(non-embedding parameters, vocabulary size, hidden size) of a causal LM (peft-wrapped or not)."""
    base = base_model(model)
    # The embedding module's weight (a Parameter; nn.Module's attribute typing can only say Tensor | Module).
    embedding = cast(torch.Tensor, base.get_input_embeddings().weight)
    seen: set[int] = set()
    total = 0
    for parameter in base.parameters():
        if id(parameter) in seen or parameter is embedding:
            continue
        seen.add(id(parameter))
        total += parameter.numel()
    output = base.get_output_embeddings()
    if output is not None and output.weight is not embedding:
        total -= output.weight.numel()  # an untied head is counted with the response tokens below
    return total, embedding.shape[0], embedding.shape[1]


def training_flops(non_embedding: int, vocab: int, hidden: int, tokens: int, response_tokens: int) -> float:
    """Model FLOPs of one forward+backward pass (3 x the forward's 2 FLOPs per weight per token).

    The body sees every token; the output projection only scored response positions (the trainer computes
    logits nowhere else). Attention's sequence-length term is small at these lengths and left out.
    """
    return 6.0 * non_embedding * tokens + 6.0 * vocab * hidden * response_tokens


def decode_matmul_floor_s(model: torch.nn.Module, rows: int, device: torch.device, repeats: int = 3) -> float:
    """Seconds the matmuls of one decode step take alone: every linear layer of the model (the LM head included),
    in model order, applied to `rows` rows of one token, by the kernel the eager decode step uses on this device
    (engines/decode.py's SkinnyLinear on a CPU). The best of `repeats` passes; the weights are streamed as the
    real step streams them."""
    base = base_model(model)
    weights = [m.weight for m in base.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], device=device, dtype=w.dtype) for w in weights}
    best = float("inf")
    skinny = SkinnyLinear() if device.type == "cpu" else contextlib.nullcontext()
    with torch.no_grad(), skinny:
        for _ in range(repeats + 1):  # the first pass warms up
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            for weight in weights:
                torch.nn.functional.linear(inputs[weight.shape[1]], weight)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - started)
    return best


def run(cfg: GRPOConfig, output_dir: Path, console: Console) -> dict[str, Any]:
    if cfg.job.length_profile != "none":  # the learner's microbatch layouts, no generation
        from grpo_cli.jobs.benchmark_layouts import compare_layouts, layouts_table

        figures = compare_layouts(cfg, output_dir, console)
        (output_dir / "benchmark.json").write_text(json.dumps({"layouts": figures}, indent=2) + "\n")
        console.print(layouts_table(figures, cfg))
        console.print(f"wrote {output_dir / 'benchmark.json'}", highlight=False)
        return {"layouts": figures}
    engines = resolve_engines(list(cfg.job.engines))
    if cfg.sync.strategy not in ("on_policy", "multi_epoch"):
        raise UserFacingError(
            f"job=benchmark measures the in-process strategies (on_policy, multi_epoch), not sync={cfg.sync.strategy}:"
            " compare the time/* columns of job=report for it"
        )
    device = resolve_device(cfg.model.device)
    precisions, note = resolve_precisions(list(cfg.job.precisions), device)
    if note:
        console.print(note, highlight=False, markup=False)
    by_precision: dict[str, dict[str, Any]] = {}
    for precision in precisions:
        dtype = compute_dtype(device, precision) or resolve_dtype(cfg.model.dtype, device)
        peak = matmul_peak_gflops(device, dtype)
        label = precision_label(dtype)
        console.print(f"matmul peak on {device} ({label}): {peak:.0f} GFLOP/s", highlight=False, markup=False)
        measured: dict[str, Any] = {"compute_dtype": label, "matmul_peak_gflops": peak, "engines": {}}
        for engine in engines:
            run_cfg = _with_engine(cfg, engine, cfg.job.warmup_steps + cfg.job.steps)
            run_cfg.model.mixed_precision = precision
            engine_dir = output_dir / (engine if len(precisions) == 1 else f"{engine}-{label}")
            engine_dir.mkdir(parents=True, exist_ok=True)
            console.print(f"rollout={engine} ({label}): starting the trainer ...", highlight=False, markup=False)
            measured["engines"][engine] = _measure_engine(run_cfg, engine_dir, console, peak)
        by_precision[precision] = measured
    # `engines` (and the peak) at the precision model.mixed_precision runs at here, as before the precision axis.
    configured = compute_dtype(device, cfg.model.mixed_precision) or resolve_dtype(cfg.model.dtype, device)
    headline = next(
        (m for m in by_precision.values() if m["compute_dtype"] == precision_label(configured)),
        next(iter(by_precision.values())),
    )
    results: dict[str, Any] = {
        "device": str(device),
        "matmul_peak_gflops": headline["matmul_peak_gflops"],
        "engines": headline["engines"],
        "precisions": by_precision,
        "precision_note": note,
    }
    (output_dir / "benchmark.json").write_text(json.dumps(results, indent=2) + "\n")
    console.print(benchmark_table(results, cfg))
    if cfg.job.scaling:
        results["scaling"] = {
            engine: _scaling_runs(cfg, engine, output_dir / f"scaling-{engine}", console) for engine in engines
        }
        (output_dir / "benchmark.json").write_text(json.dumps(results, indent=2) + "\n")
        console.print(scaling_table(results["scaling"], cfg))
        plot_scaling(results["scaling"], cfg, output_dir / "scaling.png")
        console.print(f"wrote {output_dir / 'scaling.png'}", highlight=False)
    console.print(f"wrote {output_dir / 'benchmark.json'}", highlight=False)
    return results


def _with_engine(cfg: GRPOConfig, engine: str, steps: int) -> GRPOConfig:
    run_cfg = copy.deepcopy(cfg)
    run_cfg.rollout = rollout_config_for(cfg.rollout, engine)
    run_cfg.train.steps = steps
    run_cfg.logger.backend = "none"  # a benchmark's steps are not an experiment
    return run_cfg


def _generation_phases(engine: RolloutEngine) -> dict[str, float] | None:
    """The HF engine's decoder timings of its last generate() call, None for engines without them."""
    decoder = getattr(engine, "decoder", None)
    if decoder is None:
        return None
    timings = decoder.timings
    return {key: getattr(timings, key) for _label, key in GENERATION_PHASES} | {"decode_steps": float(timings.steps)}


def _measure_engine(cfg: GRPOConfig, output_dir: Path, console: Console, peak: float) -> dict[str, Any]:
    """The real in-process executor a run uses, its steps timed exactly as a run logs them."""
    started = time.perf_counter()
    examples = load_examples(cfg.task, "train")
    executor = InProcessExecutor(cfg, output_dir, PromptSampler(examples, seed=cfg.seed))
    startup_s = time.perf_counter() - started
    try:
        non_embedding, vocab, hidden = parameter_counts(executor.learner.model)
        shape = executor.learner.shape
        engine = executor.worker.engine
        steps, phases = [], []
        for step in range(1, cfg.train.steps + 1):
            metrics, _nonfinite = executor.step(step)
            if step > cfg.job.warmup_steps:
                steps.append(metrics)
                phases.append(_generation_phases(engine))
            console.print(
                f"rollout={cfg.rollout.engine}: step {step}{' (warm-up)' if step <= cfg.job.warmup_steps else ''} "
                f"{metrics['time/step_s']:.2f}s",
                highlight=False,
                markup=False,
            )

        # Rollout only, after the steps (they are measured from a fresh process): one fixed batch, every
        # completion forced to max_tokens, so engines generate equal work.
        prompt_ids = render_prompts(
            [e.prompt for e in examples[: shape.prompts_per_rollout_batch]], executor.worker.tokenizer
        )
        fixed = replace(
            sampling_settings(cfg, shape.group_size, seed=cfg.seed), min_tokens=cfg.rollout.max_tokens, stop=()
        )
        timings: dict[str, float] = {}
        with timed(timings, "rollout_s"), executor.worker.autocast():
            fixed_batch = engine.generate(prompt_ids, fixed)
        rollout_s = timings["rollout_s"]
        rows = shape.completions_per_rollout_batch
        floor_s = decode_matmul_floor_s(executor.worker.model, rows, executor.worker.device)
    finally:
        executor.close()

    def median(key: str) -> float:
        return statistics.median(m.get(key, 0.0) for m in steps)

    train_tokens = median("throughput/train_tokens")
    response_tokens = median("throughput/response_tokens")
    # Both token counts already cover every epoch of the step.
    flops = training_flops(non_embedding, vocab, hidden, int(train_tokens), int(response_tokens))
    fwd_bwd_s = median("time/forward_backward_s")
    generation: dict[str, float] | None = None
    measured_phases = [p for p in phases if p is not None]
    if len(measured_phases) == len(phases):  # an engine with phase timings (rollout=hf)
        generation = {key: statistics.median(p[key] for p in measured_phases) for p in measured_phases[:1] for key in p}
        decode_calls = max(generation["decode_steps"] - 1, 1)  # the first token comes from the prefill
        generation["decode_step_ms"] = 1e3 * generation["forward_s"] / decode_calls
    return {
        "startup_s": startup_s,
        "step_s_median": median("time/step_s"),
        "step_s_min": min(m["time/step_s"] for m in steps),
        "breakdown_s": {label: median(key) for label, key in BREAKDOWN},
        "generation_phases": generation,
        "decode_matmul_floor_ms": 1e3 * floor_s,
        "rollout_only_tokens": fixed_batch.n_generated_tokens,
        "rollout_only_tokens_per_s": fixed_batch.n_generated_tokens / rollout_s,
        "generation_tokens_per_s": median("throughput/generation_tokens_per_s"),
        "training_tokens_per_s": train_tokens / max(fwd_bwd_s, 1e-9),
        "training_gflops": flops / max(fwd_bwd_s, 1e-9) / 1e9,
        "training_gflop_per_step": flops / 1e9,
        "matmul_peak_gflops": peak,
        "steps": steps,
    }


def precision_label(dtype: torch.dtype) -> str:
    """bf16 / fp32 / fp16: the compute dtype as the table and benchmark.json name it."""
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, str(dtype))


def benchmark_table(results: dict[str, Any], cfg: GRPOConfig) -> Table:
    """One column per engine and precision measured (the precision named in the header where several were)."""
    by_precision = results.get("precisions") or {"": {"compute_dtype": "", "engines": results["engines"]}}
    several = len(by_precision) > 1
    engines = {
        f"rollout={name}" + (f" {measured['compute_dtype']}" if several else ""): figures
        for measured in by_precision.values()
        for name, figures in measured["engines"].items()
    }
    measured = f"{cfg.job.steps} steps" + (f" after {cfg.job.warmup_steps} warm-up" if cfg.job.warmup_steps else "")
    table = Table(
        title=(
            f"GRPO step benchmark: {cfg.model.name}, {cfg.task.name}, {cfg.train.rollout_batch_size} completions "
            f"x <= {cfg.rollout.max_tokens} tokens, {measured} in a fresh process"
        )
    )
    table.add_column("")
    for name in engines:
        table.add_column(name, justify="right")

    def row(label: str, fmt: str, values: list[float | None]) -> None:
        table.add_row(label, *("-" if v is None else format(v, fmt) for v in values))

    def phase(engine: dict, key: str) -> float | None:
        return None if engine["generation_phases"] is None else engine["generation_phases"][key]

    row("seconds per step, median", ".2f", [e["step_s_median"] for e in engines.values()])
    row("seconds per step, min", ".2f", [e["step_s_min"] for e in engines.values()])
    for label, _key in BREAKDOWN:
        row(f"  {label} (s)", ".2f", [e["breakdown_s"][label] for e in engines.values()])
        if label == "generation":
            for phase_label, key in GENERATION_PHASES:
                row(f"    {phase_label} (s)", ".2f", [phase(e, key) for e in engines.values()])
    row("decode step (ms)", ".0f", [phase(e, "decode_step_ms") for e in engines.values()])
    row("decode step's matmuls alone (ms)", ".0f", [e["decode_matmul_floor_ms"] for e in engines.values()])
    row("rollout only, tokens/s (fixed batch)", ".0f", [e["rollout_only_tokens_per_s"] for e in engines.values()])
    row("generation tokens/s (in steps)", ".0f", [e["generation_tokens_per_s"] for e in engines.values()])
    row("training tokens/s", ".0f", [e["training_tokens_per_s"] for e in engines.values()])
    row("training GFLOP/s achieved", ".1f", [e["training_gflops"] for e in engines.values()])
    row("matmul peak GFLOP/s (measured)", ".1f", [e["matmul_peak_gflops"] for e in engines.values()])
    row("engine + trainer start (s)", ".1f", [e["startup_s"] for e in engines.values()])
    return table


# --- how the cost grows ---------------------------------------------------------------------------------------


def scaling_points(cfg: GRPOConfig) -> list[tuple[str, int, int]]:
    """(axis, rollout batch, max_tokens) of every scaling run: the batch axis at rollout.max_tokens, the length
    axis at train.rollout_batch_size."""
    points = [("batch", batch, cfg.rollout.max_tokens) for batch in cfg.job.scaling_batches]
    points += [("max_tokens", cfg.train.rollout_batch_size, tokens) for tokens in cfg.job.scaling_max_tokens]
    return points


def _scaling_config(cfg: GRPOConfig, engine: str, batch: int, max_tokens: int) -> GRPOConfig:
    """The benchmark setting at another rollout batch and length: one optimizer step per batch in microbatches of
    at most the base setting's, every completion exactly max_tokens long."""
    run_cfg = _with_engine(cfg, engine, cfg.job.scaling_steps)
    group = cfg.train.group_size
    if batch % group:
        raise UserFacingError(f"job.scaling_batches holds {batch}, not a multiple of train.group_size={group}")
    microbatch = cfg.train.train_batch_size // cfg.train.gradient_accumulation_steps
    run_cfg.train.rollout_batch_size = run_cfg.train.train_batch_size = batch
    run_cfg.train.gradient_accumulation_steps = batch // math.gcd(batch, microbatch)
    run_cfg.rollout.max_tokens = run_cfg.rollout.min_tokens = max_tokens
    run_cfg.rollout.stop = []
    if hasattr(run_cfg.task, "stop"):
        run_cfg.task.stop = []
    return run_cfg


def _scaling_runs(
    cfg: GRPOConfig, engine: str, output_dir: Path, console: Console, point: Callable[..., dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Every scaling point of `engine`, each in a fresh process: an executor does not hand all its memory back
    when it closes (an in-process vLLM engine's CPU KV cache above all), and 16 points run in one process
    ran out of 24 GB at the last one (docs/results/2026-11-22-cpu-performance.md). `point`: what runs one point
    (scaling_point)."""
    rows: list[dict[str, Any]] = []
    spawn = multiprocessing.get_context("spawn")  # a fork would copy this process's torch and vLLM state
    for axis, batch, max_tokens in scaling_points(cfg):
        run_cfg = _scaling_config(cfg, engine, batch, max_tokens)
        run_dir = output_dir / f"b{batch}-t{max_tokens}"
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
            try:
                row = pool.submit(point or scaling_point, run_cfg, axis, run_dir).result()
            except BrokenProcessPool:
                done = ", ".join(f"{r['batch']}x{r['max_tokens']}" for r in rows) or "none"
                raise UserFacingError(
                    f"job.scaling: the process of rollout={engine} batch {batch} x {max_tokens} tokens died "
                    f"(killed by the system, most likely out of memory; points done: {done}): leave the point out of "
                    "job.scaling_batches / job.scaling_max_tokens"
                ) from None
        rows.append(row)
        console.print(
            f"rollout={engine} scaling: batch {batch} x {max_tokens} tokens: {row['step_s']:.2f}s per step "
            f"(generation {row['generation_s']:.2f}s, {row['generation_tokens_per_s']:.0f} tokens/s)",
            highlight=False,
            markup=False,
        )
    return rows


def scaling_point(run_cfg: GRPOConfig, axis: str, run_dir: Path) -> dict[str, Any]:
    """Run one scaling point's steps (`_scaling_config`'s setting) and return its row of medians."""
    run_dir.mkdir(parents=True, exist_ok=True)
    examples = load_examples(run_cfg.task, "train")
    executor = InProcessExecutor(run_cfg, run_dir, PromptSampler(examples, seed=run_cfg.seed))
    try:
        steps = [executor.step(step)[0] for step in range(1, run_cfg.train.steps + 1)]
    finally:
        executor.close()

    def median(key: str) -> float:
        return statistics.median(m.get(key, 0.0) for m in steps)

    return {
        "axis": axis,
        "batch": run_cfg.train.rollout_batch_size,
        "max_tokens": run_cfg.rollout.max_tokens,
        "step_s": median("time/step_s"),
        "generation_s": median("time/generation_s"),
        "training_s": median("time/forward_backward_s") + median("time/optimizer_s"),
        "sync_s": median("time/sync_s") + median("time/sync_probe_s"),
        "generation_tokens_per_s": median("throughput/generation_tokens_per_s"),
        "training_tokens_per_s": median("throughput/train_tokens") / max(median("time/forward_backward_s"), 1e-9),
    }


def scaling_table(scaling: dict[str, list[dict[str, Any]]], cfg: GRPOConfig) -> Table:
    table = Table(
        title=(
            f"How a step's cost grows: {cfg.model.name}, every completion forced to max_tokens, median of "
            f"{cfg.job.scaling_steps} steps"
        )
    )
    # Short headers: the table must fit an 80-column terminal.
    for column in ("engine", "batch", "tokens", "s/step", "gen s", "train s", "sync s", "gen tok/s", "train tok/s"):
        table.add_column(column, justify="left" if column == "engine" else "right")
    for engine, rows in scaling.items():
        for r in rows:
            table.add_row(
                engine,
                str(r["batch"]),
                str(r["max_tokens"]),
                f"{r['step_s']:.2f}",
                f"{r['generation_s']:.2f}",
                f"{r['training_s']:.2f}",
                f"{r['sync_s']:.2f}",
                f"{r['generation_tokens_per_s']:.0f}",
                f"{r['training_tokens_per_s']:.0f}",
            )
    return table


def plot_scaling(scaling: dict[str, list[dict[str, Any]]], cfg: GRPOConfig, path: Path) -> None:
    """One PNG: seconds per step (top) and generation / training tokens/s (bottom) against the rollout batch
    (left) and max_tokens (right), one colour per engine."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7.5), dpi=110)
    axes = fig.subplots(2, 2)
    for column, (axis, label) in enumerate((("batch", "rollout batch (completions)"), ("max_tokens", "max_tokens"))):
        for index, (engine, rows) in enumerate(scaling.items()):
            points = [r for r in rows if r["axis"] == axis]
            x = [r[axis] for r in points]
            style = {"color": f"C{index}"}
            top, bottom = axes[0, column], axes[1, column]
            top.plot(x, [r["step_s"] for r in points], "o-", **style, label=f"rollout={engine}: step")
            top.plot(x, [r["generation_s"] for r in points], "s--", **style, alpha=0.6, label=f"{engine}: generation")
            bottom.plot(x, [r["generation_tokens_per_s"] for r in points], "o-", **style, label=f"{engine}: generation")
            bottom.plot(x, [r["training_tokens_per_s"] for r in points], "^:", **style, label=f"{engine}: training")
        ticks = sorted({r[axis] for rows in scaling.values() for r in rows if r["axis"] == axis})
        for row, ylabel in enumerate(("seconds per step", "tokens/s")):
            ax = axes[row, column]
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.set_ylim(bottom=0)
            ax.set_xlabel(label)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fixed = f"at max_tokens={cfg.rollout.max_tokens}", f"at {cfg.train.rollout_batch_size} completions"
    axes[0, 0].set_title(f"growing the rollout batch ({fixed[0]})")
    axes[0, 1].set_title(f"growing the completion length ({fixed[1]})")
    fig.suptitle(f"{cfg.model.name}: cost per GRPO step as it grows")
    fig.savefig(path, bbox_inches="tight")
