"""Packed rows against the padded layouts: one training microbatch's forward + backward (response log-probs through
grpo_cli.core.response_log_probs, a non-uniform loss of them, backward), on a long-tailed batch, each layout in
turn, alternating their order every round (the first round is a warm-up and not counted).

    python benchmarks/packed_rows.py [--model embedded:smollm2-135m-instruct] [--rounds 3] [--prompt 60]
        [--layers N] [--layouts padded,packed]

Layouts: padded (one row per completion, right-padded), padded+shared (train.share_prompt_forward's shared
prompt pass, the default), packed (train.pack_sequences: rows as wide as core.packing.row_width prices cheapest
for the model's hidden size), packed longest (rows as wide as the longest sequence, the first rule), packed one
row (the whole microbatch in one row, flash-attention's layout), and the resolution of pack + share
(core.packing.packing_beats_sharing picks per microbatch). Completion lengths: a truncated power law (Zipf-like,
exponent 1) from 16 to 512 tokens at evenly spaced quantiles, so every run has the same batch: 2 prompts x G = 4.
Prints each layout's median and minimum seconds, the positions it computes, and its largest log-prob difference
from the padded layout's.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

import grpo_cli.core.logprobs as logprobs
import grpo_cli.core.packing as packing
from grpo_cli.core import response_log_probs, tokenize_prompt_and_output_ids
from grpo_cli.models.loading import load_policy


def long_tail_lengths(count: int, low: int = 16, high: int = 512) -> list[int]:
    """Quantiles (i / (count - 1)) of a power law p(n) ~ 1 / n^2 truncated to [low, high]: many short, one longest."""
    return [round(low / (1 - (i / (count - 1)) * (1 - low / high))) for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=60, help="prompt tokens")
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--layers", type=int, default=0, help="keep the model's first N layers (0: all)")
    parser.add_argument(
        "--layouts",
        default="padded,padded+shared,packed,packed longest,packed one row,pack+share",
        help="comma-separated",
    )
    args = parser.parse_args()
    model, _ = load_policy(args.model, torch.device("cpu"), torch.float32)
    if args.layers:  # every layer costs the same per position in every layout: fewer layers, the same ratios
        model.model.layers = model.model.layers[: args.layers]
        model.config.num_hidden_layers = args.layers
    model.train()
    rng = random.Random(0)
    lengths = long_tail_lengths(2 * args.group)
    rng.shuffle(lengths)
    prompts = [[rng.randrange(100, 20000) for _ in range(args.prompt)] for _ in range(2)]
    prompt_ids = [prompts[i // args.group] for i in range(len(lengths))]
    completions = [[rng.randrange(100, 20000) for _ in range(n)] for n in lengths]
    batch = tokenize_prompt_and_output_ids(prompt_ids, completions, pad_token_id=0)
    mask = batch["response_mask"].bool()
    weights = torch.linspace(-1, 1, int(mask.sum()))
    sequence = packing.sequence_lengths(mask)
    width = packing.packed_row_tokens(model, sequence)
    packed_positions = packing.pack_rows(batch["input_ids"], mask, width).input_ids.numel()
    longest_positions = packing.pack_rows(batch["input_ids"], mask, max(sequence)).input_ids.numel()
    shared_positions = 2 * args.prompt + len(lengths) * (max(lengths) - 1)
    layouts = {
        "padded": (dict(), batch["input_ids"].numel()),
        "padded+shared": (dict(share_prompts=True), shared_positions),
        "packed": (dict(pack_sequences=True), packed_positions),
        "packed longest": (dict(pack_sequences=True, row_tokens=max), longest_positions),
        "packed one row": (dict(pack_sequences=True, one_row=True), sum(sequence)),
        "pack+share": (dict(pack_sequences=True, share_prompts=True), None),
    }
    layouts = {name: layouts[name] for name in args.layouts.split(",")}
    print(f"completion lengths {lengths}, prompts {args.prompt} tokens, {torch.get_num_threads()} threads")
    print(f"packed rows {width} wide ({packed_positions} positions); rows of the longest sequence", end=" ")
    print(f"{max(sequence)} wide ({longest_positions} positions)")
    # The scoring path reads the width through the name core/logprobs.py imported: forced layouts replace it there.
    row_tokens = logprobs.packed_row_tokens

    def run(options: dict) -> tuple[float, torch.Tensor]:
        options = dict(options)
        if options.pop("one_row", False):
            logprobs.packed_row_tokens = lambda model, lengths: None  # type: ignore[assignment]
        forced_width = options.pop("row_tokens", None)
        if forced_width is not None:
            logprobs.packed_row_tokens = lambda model, lengths: forced_width(lengths)  # type: ignore[assignment]
        try:
            start = time.perf_counter()
            log_probs = response_log_probs(model, batch["input_ids"], batch["labels"], mask, **options)["log_probs"]
            (log_probs[mask] * weights).sum().backward()
            seconds = time.perf_counter() - start
        finally:
            logprobs.packed_row_tokens = row_tokens
            model.zero_grad(set_to_none=True)
        return seconds, log_probs.detach()

    times: dict[str, list[float]] = {name: [] for name in layouts}
    reference, worst = None, dict.fromkeys(layouts, 0.0)
    for round_ in range(args.rounds + 1):
        order = list(layouts) if round_ % 2 == 0 else list(reversed(layouts))
        for name in order:
            seconds, log_probs = run(layouts[name][0])
            reference = log_probs if reference is None else reference
            worst[name] = max(worst[name], float((log_probs - reference).abs().max()))
            if round_ > 0:
                times[name].append(seconds)
            print(f"round {round_} {name:15s} {seconds:6.2f} s", flush=True)
    print("\n| layout | positions computed | median s | min s | max log-prob diff vs padded |\n|---|---|---|---|---|")
    for name, values in times.items():
        values.sort()
        positions = layouts[name][1]
        print(
            f"| {name} | {positions if positions is not None else '(per batch)'} | {values[len(values) // 2]:.2f} "
            f"| {values[0]:.2f} | {worst[name]:.1e} |"
        )


if __name__ == "__main__":
    main()
