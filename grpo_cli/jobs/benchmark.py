"""`job=benchmark`: seconds per GRPO step and where they go, per rollout engine, against the machine's limits.

For each engine (`job.engines`; `auto` = transformers, plus vLLM when it is installed) the job builds the
real trainer for the configured setting, runs `job.warmup_steps` unmeasured steps and `job.steps` measured
ones through the same `train_step` a run uses, then prints one table:

- seconds per step (median, min) and the breakdown the trainer logs (generation, scoring, old/reference
  log-probs, forward+backward, optimizer, weight sync);
- rollout-only generation speed on one fixed batch with every completion forced to `rollout.max_tokens`
  (identical token counts for every engine), and generation tokens/s inside the steps;
- training tokens/s and achieved training GFLOP/s (FLOPs of forward+backward over the tokens the model really
  processed — a prompt shared by its G completions counts once — 6 x non-embedding parameters per token +
  6 x vocab x hidden per scored response token) beside the
  measured peak of a large matmul on this device, so the distance from the physical limit is visible.

Figures are medians over the measured steps and land in `benchmark.json` beside the table. This is a
measuring tool, not a test: run it on a quiet machine.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from grpo_cli.config import allowed_values, rollout_config_for
from grpo_cli.drivers.local import InProcessExecutor
from grpo_cli.drivers.prompts import PromptSampler
from grpo_cli.errors import UserFacingError
from grpo_cli.rollout import render_prompts
from grpo_cli.rollout.worker import sampling_settings
from grpo_cli.runtime import compute_dtype, resolve_device, resolve_dtype, timed
from grpo_cli.tasks import load_examples

# Breakdown rows: (label, metric key). forward+backward and optimizer split the trainer's training time.
BREAKDOWN = (
    ("generation", "time/generation_s"),
    ("scoring", "time/scoring_s"),
    ("old log-probs", "time/old_log_probs_s"),
    ("reference log-probs", "time/ref_log_probs_s"),
    ("forward+backward", "time/forward_backward_s"),
    ("optimizer", "time/optimizer_s"),
    ("weight sync", "time/sync_s"),
)


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


def parameter_counts(model: torch.nn.Module) -> tuple[int, int, int]:
    """(non-embedding parameters, vocabulary size, hidden size) of a causal LM (peft-wrapped or not)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    embedding = base.get_input_embeddings().weight
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


def run(cfg: Any, output_dir: Path, console: Any) -> dict[str, Any]:
    engines = resolve_engines(list(cfg.job.engines))
    if cfg.sync.strategy not in ("on_policy", "multi_epoch"):
        raise UserFacingError(
            f"job=benchmark measures the in-process strategies (on_policy, multi_epoch), not sync={cfg.sync.strategy}:"
            " compare the time/* columns of job=report for it"
        )
    if cfg.job.steps < 1:
        raise UserFacingError(f"job.steps={cfg.job.steps} must be >= 1 (measured steps per engine)")
    device = resolve_device(cfg.model.device)
    matmul_dtype = compute_dtype(device, cfg.model.mixed_precision) or resolve_dtype(cfg.model.dtype, device)
    peak = matmul_peak_gflops(device, matmul_dtype)
    console.print(f"matmul peak on {device} ({str(matmul_dtype).removeprefix('torch.')}): {peak:.0f} GFLOP/s")
    results: dict[str, Any] = {"device": str(device), "matmul_peak_gflops": peak, "engines": {}}
    for engine in engines:
        run_cfg = _with_engine(cfg, engine, cfg.job.warmup_steps + cfg.job.steps)
        engine_dir = output_dir / engine
        engine_dir.mkdir(parents=True, exist_ok=True)
        console.print(f"rollout={engine}: starting the trainer ...", highlight=False, markup=False)
        results["engines"][engine] = _measure_engine(run_cfg, engine_dir, console, peak)
    (output_dir / "benchmark.json").write_text(json.dumps(results, indent=2) + "\n")
    console.print(benchmark_table(results, cfg))
    console.print(f"wrote {output_dir / 'benchmark.json'}", highlight=False)
    return results


def _with_engine(cfg: Any, engine: str, steps: int) -> Any:
    run_cfg = copy.deepcopy(cfg)
    run_cfg.rollout = rollout_config_for(cfg.rollout, engine)
    run_cfg.train.steps = steps
    run_cfg.logger.backend = "none"  # a benchmark's steps are not an experiment
    return run_cfg


def _measure_engine(cfg: Any, output_dir: Path, console: Any, peak: float) -> dict:
    """The real in-process executor a run uses, its steps timed exactly as a run logs them."""
    started = time.perf_counter()
    examples = load_examples(cfg.task, "train")
    executor = InProcessExecutor(cfg, output_dir, PromptSampler(examples, seed=cfg.seed))
    startup_s = time.perf_counter() - started
    try:
        non_embedding, vocab, hidden = parameter_counts(executor.learner.model)
        shape = executor.learner.shape
        # Rollout only: one fixed batch, every completion forced to max_tokens, so engines generate equal work.
        prompt_ids = render_prompts(
            [e.prompt for e in examples[: shape.prompts_per_rollout_batch]], executor.worker.tokenizer
        )
        fixed = replace(
            sampling_settings(cfg, shape.group_size, seed=cfg.seed), min_tokens=cfg.rollout.max_tokens, stop=()
        )
        engine = executor.worker.engine
        engine.generate(prompt_ids, fixed)  # warm-up
        timings: dict[str, float] = {}
        with timed(timings, "rollout_s"):
            fixed_batch = engine.generate(prompt_ids, fixed)
        rollout_s = timings["rollout_s"]

        steps = []
        for step in range(1, cfg.train.steps + 1):
            metrics, _nonfinite = executor.step(step)
            if step > cfg.job.warmup_steps:
                steps.append(metrics)
            console.print(
                f"rollout={cfg.rollout.engine}: step {step}{' (warm-up)' if step <= cfg.job.warmup_steps else ''} "
                f"{metrics['time/step_s']:.2f}s",
                highlight=False,
                markup=False,
            )
    finally:
        executor.close()

    def median(key: str) -> float:
        return statistics.median(m.get(key, 0.0) for m in steps)

    train_tokens = median("throughput/train_tokens")
    response_tokens = median("throughput/response_tokens")
    # Both token counts already cover every epoch of the step.
    flops = training_flops(non_embedding, vocab, hidden, int(train_tokens), int(response_tokens))
    fwd_bwd_s = median("time/forward_backward_s")
    return {
        "startup_s": startup_s,
        "step_s_median": median("time/step_s"),
        "step_s_min": min(m["time/step_s"] for m in steps),
        "breakdown_s": {label: median(key) for label, key in BREAKDOWN},
        "rollout_only_tokens": fixed_batch.n_generated_tokens,
        "rollout_only_tokens_per_s": fixed_batch.n_generated_tokens / rollout_s,
        "generation_tokens_per_s": median("throughput/generation_tokens_per_s"),
        "training_tokens_per_s": train_tokens / max(fwd_bwd_s, 1e-9),
        "training_gflops": flops / max(fwd_bwd_s, 1e-9) / 1e9,
        "training_gflop_per_step": flops / 1e9,
        "matmul_peak_gflops": peak,
        "steps": steps,
    }


def benchmark_table(results: dict[str, Any], cfg: Any) -> Table:
    engines = results["engines"]
    table = Table(
        title=(
            f"GRPO step benchmark: {cfg.model.name}, {cfg.task.name}, {cfg.train.rollout_batch_size} completions "
            f"x <= {cfg.rollout.max_tokens} tokens, {cfg.job.steps} measured steps"
        )
    )
    table.add_column("")
    for name in engines:
        table.add_column(f"rollout={name}", justify="right")

    def row(label: str, fmt: str, values: list[float]) -> None:
        table.add_row(label, *(format(v, fmt) for v in values))

    row("seconds per step, median", ".2f", [e["step_s_median"] for e in engines.values()])
    row("seconds per step, min", ".2f", [e["step_s_min"] for e in engines.values()])
    for label, _key in BREAKDOWN:
        row(f"  {label} (s)", ".2f", [e["breakdown_s"][label] for e in engines.values()])
    row("rollout only, tokens/s (fixed batch)", ".0f", [e["rollout_only_tokens_per_s"] for e in engines.values()])
    row("generation tokens/s (in steps)", ".0f", [e["generation_tokens_per_s"] for e in engines.values()])
    row("training tokens/s", ".0f", [e["training_tokens_per_s"] for e in engines.values()])
    row("training GFLOP/s achieved", ".1f", [e["training_gflops"] for e in engines.values()])
    row("matmul peak GFLOP/s (measured)", ".1f", [e["matmul_peak_gflops"] for e in engines.values()])
    row("engine + trainer start (s)", ".1f", [e["startup_s"] for e in engines.values()])
    return table
