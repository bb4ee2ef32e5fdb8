"""Peak memory and time of one GRPO train step, chunked log-probs against the unchunked path, side by side.

    python benchmarks/logits_memory.py                           # Qwen2.5-1.5B's head, 2 layers; chunks 0 and 1024
    python benchmarks/logits_memory.py --chunks 0 512 1024 2048 --rounds 2 --out logits.json

The model is Qwen2.5-1.5B's shape (vocabulary 151,936, hidden 1,536, MLP 8,960, 12 heads, 2 KV heads, tied
embeddings) cut to `--layers` decoder layers, randomly initialised in the script (nothing is downloaded), fp32
on the CPU. The batch is one GRPO group: `--completions` completions of `--response-tokens` tokens each after
one `--prompt-tokens`-token prompt. A train step is the learner's: response log-probs and entropies
(grpo_cli.core.response_log_probs, prompt sharing on, temperature 1), the GRPO-Clip loss and its backward
(grpo_cli.core.grpo_microbatch_train_step), gradient clipping at 1.0 and a fused AdamW step.

Each variant (`train.logits_chunk_tokens` = 0 for unchunked, else tokens per chunk; `--checkpointed` sizes also
through the path other heads take, autograd through torch.utils.checkpoint per chunk) runs in a fresh process, so
its peak resident memory (`resource.getrusage(...).ru_maxrss`, what `/usr/bin/time -v` reports as "Maximum
resident set size") is its own: the process's peak over model building and `--steps` steps. Beside it, the
resident memory once the model and the AdamW state exist (after the first step, read from /proc/self/statm) and
the step's own peak above that. With `--rounds` > 1 the variants alternate, so a machine whose load drifts biases
none; the step time reported is the median over every round's steps after the first of each process, in wall
seconds and in the process's CPU seconds (user + system, all threads), which a machine shared with other work
disturbs far less than the wall clock.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

GIB = 1024**3
CHECKPOINTED = "checkpointed:"  # a variant's prefix: the autograd path with torch.utils.checkpoint per chunk


def resident_bytes() -> int:
    """Resident memory of this process now (Linux: /proc/self/statm's second field, in pages)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def peak_resident_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure_one(args: argparse.Namespace, variant: str) -> dict:
    """Build the model and batch, run `args.steps` train steps as `variant` says; this process's figures."""
    import torch
    import transformers

    from grpo_cli.core import grpo_microbatch_train_step, logprobs, response_log_probs, tokenize_prompt_and_output_ids

    chunk_tokens = int(variant.removeprefix(CHECKPOINTED))
    if variant.startswith(CHECKPOINTED):  # what any non-Linear head takes: autograd through checkpointed chunks
        logprobs.linear_head = lambda model: None

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prompt_tokens + args.response_tokens + 1,
        tie_word_embeddings=True,
    )
    model = transformers.Qwen2ForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, args.vocab, (args.prompt_tokens,), generator=generator).tolist()
    completions = [
        torch.randint(1, args.vocab, (args.response_tokens,), generator=generator).tolist()
        for _ in range(args.completions)
    ]
    batch = tokenize_prompt_and_output_ids([prompt] * args.completions, completions, pad_token_id=0)
    mask = batch["response_mask"]
    advantages = torch.linspace(-1, 1, args.completions).unsqueeze(1)  # (B, 1)
    step_seconds, step_cpu_seconds, resident_after_first = [], [], 0
    for step in range(args.steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        out = response_log_probs(
            model,
            batch["input_ids"],
            batch["labels"],
            mask,
            return_token_entropy=True,
            share_prompts=True,
            logits_chunk_tokens=chunk_tokens,
        )
        grpo_microbatch_train_step(
            out["log_probs"],
            mask,
            gradient_accumulation_steps=1,
            loss_type="grpo_clip",
            advantages=advantages,
            old_log_probs=out["log_probs"].detach(),
            cliprange=0.2,
        )
        del out
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_seconds.append(time.perf_counter() - start)
        step_cpu_seconds.append(time.process_time() - cpu_start)
        if step == 0:
            resident_after_first = resident_bytes()  # weights + AdamW state, between steps
    peak = peak_resident_bytes()
    return {
        "variant": variant,
        "step_s": step_seconds,
        "step_cpu_s": step_cpu_seconds,
        "peak_rss_gib": peak / GIB,
        "rss_between_steps_gib": resident_after_first / GIB,
        "step_peak_above_gib": (peak - resident_after_first) / GIB,
    }


def time_head_only(args: argparse.Namespace) -> dict:
    """CPU seconds of the LM head's log-probs and entropies, forward and backward, for `args.head_tokens` tokens:
    the unchunked path against each `args.chunks` size, alternating `args.rounds` times in this one process. Only
    the code chunking changed runs (no decoder, no optimizer), so the comparison fits a machine with little free
    memory and a few minutes."""
    import torch

    from grpo_cli.core.chunked_logprobs import LogitTransform, linear_head_label_log_probs
    from grpo_cli.core.logprobs import get_response_log_probs_from_logits

    torch.manual_seed(0)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False)
    hidden = torch.randn(args.head_tokens, args.hidden, requires_grad=True)
    labels = torch.randint(0, args.vocab, (args.head_tokens,))
    weights = torch.randn(args.head_tokens)  # any loss that weighs tokens differently

    def step(chunk: int) -> float:
        start = time.process_time()
        if chunk == 0:
            out = get_response_log_probs_from_logits(head(hidden), labels, return_token_entropy=True)
        else:
            out = linear_head_label_log_probs(hidden, head, labels, LogitTransform(), chunk, True)
        (out["log_probs"] * weights).sum().backward()
        hidden.grad, head.weight.grad = None, None
        return time.process_time() - start

    seconds: dict[str, list[float]] = {str(chunk): [] for chunk in args.chunks}
    for _ in range(args.rounds):
        for chunk in args.chunks:
            seconds[str(chunk)].append(step(chunk))
            print(json.dumps({"chunk": chunk, "cpu_s": seconds[str(chunk)][-1]}), flush=True)
    medians = {chunk: statistics.median(values) for chunk, values in seconds.items()}
    return {"head_tokens": args.head_tokens, "cpu_s": seconds, "median_cpu_s": medians}


def run_variants(args: argparse.Namespace) -> dict:
    """Every variant in a fresh process, alternating over `args.rounds` rounds; the figures and a summary."""
    variants = [str(chunk) for chunk in args.chunks] + [f"{CHECKPOINTED}{chunk}" for chunk in args.checkpointed]
    runs: dict[str, list[dict]] = {variant: [] for variant in variants}
    for _ in range(args.rounds):
        for variant in variants:
            command = [sys.executable, __file__, "--one", variant, *forwarded(args)]
            load_before = os.getloadavg()[0]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:  # e.g. killed for memory (-9): the other variants' figures still count
                print(f"the variant {variant} failed (exit {done.returncode}):\n{done.stderr[-2000:]}", flush=True)
                continue
            result = json.loads(done.stdout.strip().splitlines()[-1])
            result["load_before"], result["load_after"] = load_before, os.getloadavg()[0]
            runs[variant].append(result)
            print(json.dumps(result), flush=True)
    summary = {}
    for variant, results in runs.items():
        if not results:
            continue

        def median_after_first(key: str, results: list[dict] = results) -> float:
            return statistics.median([s for r in results for s in r[key][1:]] or [s for r in results for s in r[key]])

        summary[variant] = {
            "median_step_s": median_after_first("step_s"),
            "median_step_cpu_s": median_after_first("step_cpu_s"),
            "peak_rss_gib": max(r["peak_rss_gib"] for r in results),
            "step_peak_above_gib": max(r["step_peak_above_gib"] for r in results),
        }
    base = summary.get("0")
    if base is not None:
        for figures in summary.values():
            figures["peak_vs_unchunked"] = figures["peak_rss_gib"] / base["peak_rss_gib"]
            figures["step_peak_above_vs_unchunked"] = figures["step_peak_above_gib"] / base["step_peak_above_gib"]
            figures["time_vs_unchunked"] = figures["median_step_s"] / base["median_step_s"]
            figures["cpu_time_vs_unchunked"] = figures["median_step_cpu_s"] / base["median_step_cpu_s"]
    setting = {name: getattr(args, name) for name in (*SHAPE_FLAGS, "chunks", "checkpointed", "rounds")}
    return {"setting": setting | {"machine": machine()}, "runs": runs, "summary": summary}


def machine() -> str:
    cpu = platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return f"{cpu}, {os.cpu_count()} cores, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / GIB:.0f} GiB"


SHAPE_FLAGS = (
    "vocab",
    "hidden",
    "intermediate",
    "layers",
    "heads",
    "kv_heads",
    "completions",
    "response_tokens",
    "prompt_tokens",
    "steps",
)


def forwarded(args: argparse.Namespace) -> list[str]:
    return [item for name in SHAPE_FLAGS for item in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=1_536)
    parser.add_argument("--intermediate", type=int, default=8_960)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--completions", type=int, default=8)
    parser.add_argument("--response-tokens", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="train steps per process (the first is not timed)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 1024], help="0 = unchunked")
    parser.add_argument(
        "--checkpointed", type=int, nargs="*", default=[], help="chunk sizes also measured on the checkpointed path"
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write every figure here as JSON")
    parser.add_argument(
        "--head-only", action="store_true", help="time only the LM head's log-probs, in CPU seconds (time_head_only)"
    )
    parser.add_argument("--head-tokens", type=int, default=1024, help="tokens scored with --head-only")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process's variant
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure_one(args, args.one)))
        return None
    report = time_head_only(args) if args.head_only else run_variants(args)
    print(json.dumps(report.get("summary", report.get("median_cpu_s")), indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
