"""The decode loop checked against transformers' own generate() on the loaded model, before it samples anything.

The loop (`engines.decode`) reaches into transformers internals that any release may change without notice
(`engines.hf_internals`). A list of the releases its tests passed on cannot say whether the next release breaks
it, and a list that lags behind sends every fresh install (which resolves the newest transformers) to the slow
path. So the HF engine checks the loop on the model it is about to sample from, at its first call, on that call's
own prompts and in its own context (device, dtype, autocast): greedy decoding of CHECK_TOKENS tokens for the
shortest and the longest prompt, CHECK_ROWS rows each (so left padding, and the prefill copied to several rows, are
exercised), by the loop and by `model.generate`. The loop passes when every row's tokens are generate()'s and each
token's log-prob is within a tolerance of generate()'s; at a step where the two picked different tokens whose
log-probs are within the tolerance of each other (a near tie, which rounding may break either way), the row is
compared up to there. Anything else, or the loop raising, is a disagreement: the engine samples through generate()
instead and says why in one line (`engines.hf`).

Errors of the kind a release could cause stand out by orders of magnitude in full precision, even subtle ones
(SmolLM2-135M, 8 tokens, measured against the 1e-3 tolerance): the last prompt position's keys overwritten in the
cache, 0.50 nats; decode positions shifted by one, 0.33 nats; a cache argument the model no longer reads, a
shape error. Healthy, the two paths are 5e-6 apart.
"""

from __future__ import annotations

import torch

import grpo_cli.engines.hf_internals as hf_internals
from grpo_cli.engines.base import SamplingSettings
from grpo_cli.engines.decode import Decoder, left_pad
from grpo_cli.engines.hf_generate import plain_generation_config

CHECK_TOKENS = 8
CHECK_ROWS = 2  # rows per checked prompt (the loop prefills once and copies the keys/values to each)
# Largest |log p_loop - log p_generate| of a greedy token. Full precision: both paths compute the same sums in a
# different order (grouped attention, (W x^T)^T linears): 5e-6 apart on SmolLM2-135M. Half precision (bf16/fp16
# weights or autocast): each path rounds its intermediates to bf16 in different places: 0.04-0.09 apart on
# SmolLM2-135M over 8-16 tokens; 0.5 is also the vLLM weight-sync probe's bf16 tolerance.
TOLERANCE_FULL = 1e-3
TOLERANCE_HALF = 0.5


def check_prompts(prompt_ids: list[list[int]]) -> list[list[int]]:
    """The prompts the check runs on: the call's shortest and longest (one if they are equally long)."""
    shortest = min(prompt_ids, key=len)
    longest = max(prompt_ids, key=len)
    return [shortest] if len(shortest) == len(longest) else [shortest, longest]


def reference_greedy(
    model: torch.nn.Module, prompt_ids: list[list[int]], rows: int, max_tokens: int, eos_ids: list[int], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own greedy generate(): the tokens (B, T) and each step's log-softmax (B, T, V), B = prompts
    x rows, prompt-major; rows that ended early are padded with pad_id. Only the EOS and pad ids of the
    checkpoint's generation_config apply (no repetition penalty or the like)."""
    input_ids, mask = left_pad(prompt_ids, pad_id)  # (P, W)
    device = next(model.parameters()).device
    input_ids = input_ids.repeat_interleave(rows, 0).to(device)
    mask = mask.repeat_interleave(rows, 0).to(device)
    with plain_generation_config(model, eos_ids, pad_id) as config:
        config.do_sample = False
        config.max_new_tokens = max_tokens
        config.output_logits = True
        config.return_dict_in_generate = True
        out = hf_internals.generate(model, input_ids=input_ids, attention_mask=mask, generation_config=config)
    if isinstance(out, torch.Tensor) or out.logits is None:  # asked for a dict with the logits: never so
        raise TypeError(f"generate() returned {type(out).__name__} without logits despite output_logits=True")
    tokens = out.sequences[:, input_ids.shape[1] :]  # (B, T)
    log_softmax = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)  # (B, T, V)
    return tokens, log_softmax


def first_disagreement(
    loop_tokens: list[list[int]],
    loop_log_probs: list[list[float]],
    reference_tokens: torch.Tensor,
    reference_log_softmax: torch.Tensor,
    eos_ids: set[int],
    tolerance: float,
) -> str | None:
    """Where the loop's greedy decoding first departs from generate()'s, in a few words; None when it does not.

    loop_tokens, loop_log_probs: per row, the loop's tokens and their log-probs; reference_tokens (B, T) and
    reference_log_softmax (B, T, V): generate()'s. Each row is compared up to its first EOS (inclusive), and only
    up to a step where the two picked different tokens that are within `tolerance` of each other (a near tie)."""
    for row, (tokens, log_probs) in enumerate(zip(loop_tokens, loop_log_probs, strict=True)):
        theirs = reference_tokens[row].tolist()
        for step in range(min(len(tokens), len(theirs))):
            ours, reference = tokens[step], theirs[step]
            distribution = reference_log_softmax[row, step]  # (V,)
            if ours != reference:
                gap = float(distribution[reference] - distribution[ours])
                if gap <= tolerance:
                    break  # a near tie: what follows is conditioned on different text
                return f"row {row}, token {step}: the loop picked {ours}, generate() {reference} ({gap:.3g} nats apart)"
            difference = abs(log_probs[step] - float(distribution[ours]))
            if difference > tolerance:
                return f"row {row}, token {step}: log-probs {difference:.3g} apart (tolerance {tolerance:g})"
            if ours in eos_ids:
                break
        else:
            if len(tokens) != len(theirs):
                return f"row {row}: the loop stopped after {len(tokens)} tokens, generate() after {len(theirs)}"
    return None


def half_weights(model: torch.nn.Module) -> bool:
    return next(model.parameters()).dtype in (torch.bfloat16, torch.float16)


def _compare(
    decoder: Decoder, model: torch.nn.Module, prompts: list[list[int]], tolerance: float, static: bool
) -> str | None:
    """One run of the loop (eager, on the static cache or not) and of generate() on `prompts`, compared."""
    settings = SamplingSettings(n=CHECK_ROWS, temperature=0.0, max_tokens=CHECK_TOKENS)
    saved = decoder.compile, decoder.static
    decoder.compile, decoder.static = False, decoder.static and static
    try:
        sampled = decoder.sample(prompts, settings)
    except Exception as error:  # noqa: BLE001 - any failure of the loop (a changed internal) means generate()
        message = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        return f"the decode loop failed on this model ({type(error).__name__}{': ' + message if message else ''})"
    finally:
        decoder.compile, decoder.static = saved
        decoder.forget_caches()
    tokens, log_softmax = reference_greedy(model, prompts, CHECK_ROWS, CHECK_TOKENS, decoder.eos_ids, decoder.pad_id)
    where = first_disagreement(
        sampled.token_ids, sampled.log_probs, tokens, log_softmax, set(decoder.eos_ids), tolerance
    )
    return (
        None if where is None else f"the decode loop's greedy tokens differ from generate()'s on this model ({where})"
    )


def loop_disagreement(decoder: Decoder, model: torch.nn.Module, prompt_ids: list[list[int]]) -> str | None:
    """Why the decode loop must not sample from `model` (it disagrees with generate() on `prompt_ids`, or it
    failed), in a few words; None when it agrees.

    Run in the caller's context (autocast or not), at the tolerance of its precision. Under bf16 autocast that
    tolerance is coarse (the two paths round differently), so the loop is compared once more in full precision
    (autocast off) on the path autocast takes (the dynamic cache), where a subtle error (positions off by one
    change greedy log-probs by ~0.3 nats on SmolLM2) stands out. Runs eagerly (a compiled step traces the same
    code) and leaves no cache behind."""
    prompts = check_prompts(prompt_ids)
    device_type = next(model.parameters()).device.type
    autocast = torch.is_autocast_enabled(device_type)
    half = half_weights(model) or autocast
    problem = _compare(decoder, model, prompts, TOLERANCE_HALF if half else TOLERANCE_FULL, static=True)
    if problem is None and autocast and not half_weights(model):
        with torch.autocast(device_type=device_type, enabled=False):
            problem = _compare(decoder, model, prompts, TOLERANCE_FULL, static=False)
    return problem
