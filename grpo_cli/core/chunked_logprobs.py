"""Label log-probs and entropies from the last hidden states, the LM head run a chunk of tokens at a time.

The (tokens x vocabulary) logits of a microbatch are the largest tensors of a step: 8 completions x 512 tokens
at Qwen2.5's 151,936-token vocabulary are 2.5 GB per float32 copy, and the log-softmax, the entropy and their
gradients make several. Here the head, the model's head semantics, the temperature and the float32 log-softmax
run on `chunk_tokens` rows at a time, so no tensor larger than (chunk_tokens x vocabulary) exists:

- forward: each chunk's logits are freed (or, for a plain ``nn.Linear`` head, overwritten by the next chunk's in
  one reused float32 buffer) once its log-probs, log-normalizers log Z and entropies are read off them;
- backward, for a plain ``nn.Linear`` head (tied or not; :func:`linear_head_label_log_probs`): a hand-written
  backward starts with the last chunk, whose softmax the forward left in its buffer (none recomputed when the
  batch is one chunk), then recomputes each other chunk's logits into that buffer, turns them into
  d log p / d logits in place with the forward's log Z (softmax = exp(logits - log Z): no max or sum pass) and
  adds each chunk's weight gradient into one buffer in place: one (chunk x vocabulary) float32 tensor at a time;
- backward, for any other head (a LoRA-wrapped `lm_head`; :func:`chunked_label_log_probs`): each chunk runs under
  `torch.utils.checkpoint` (non-reentrant), which keeps only the chunk's hidden states and recomputes its logits
  when the backward pass reaches it, restoring autocast and the RNG state, and autograd differentiates the head.

Equal to the unchunked path up to float rounding (tests/unit/core/test_chunked_logprobs.py: log-probs,
entropies and every
parameter's gradient); the memory and time it saves are in docs/memory.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# Head = hidden states (n, H) -> next-token logits (n, V) as the model's own forward would give them.
Head = Callable[[torch.Tensor], torch.Tensor]
ChunkScorer = Callable[[torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor | None]]

# Response tokens per chunk when the caller names none (train.logits_chunk_tokens sets the trainer's): why this
# value is in docs/memory.md.
LOGITS_CHUNK_TOKENS = 1024


def chunked_label_log_probs(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    score_chunk: ChunkScorer,
    chunk_tokens: int,
    return_token_entropy: bool = False,
) -> dict[str, torch.Tensor]:
    """Score `labels` from `hidden` a chunk of `chunk_tokens` rows at a time.

    Args:
        hidden (torch.Tensor): last hidden states at the scored positions, (N, H).
        labels (torch.Tensor): the token each row predicts, (N,), long.
        score_chunk: (hidden (n, H), labels (n,), want_entropy) -> (log-probs (n,), entropies (n,) or None):
            the unchunked computation on n rows; it must compute its entropies after its log-probs and without
            grad, so the recomputation in backward stops once the log-probs' saved tensors are back.
        chunk_tokens (int): rows per chunk, >= 1.
        return_token_entropy (bool): also return each row's entropy (detached).

    Returns:
        dict[str, torch.Tensor]: "log_probs" (N,) float32, differentiable when grad is enabled, and
        "token_entropy" (N,) when asked.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    # Gradients need recomputation only when something upstream (hidden states or the head) is trained.
    recompute = torch.is_grad_enabled()
    log_probs, entropies = [], []
    # An empty batch still runs one empty chunk, so the head stays in the graph (a zero gradient, as unchunked).
    for start in range(0, max(hidden.shape[0], 1), chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        if recompute:
            chunk_log_probs, chunk_entropy = checkpoint(
                score_chunk, hidden[rows], labels[rows], return_token_entropy, use_reentrant=False
            )
        else:
            chunk_log_probs, chunk_entropy = score_chunk(hidden[rows], labels[rows], return_token_entropy)
        log_probs.append(chunk_log_probs)
        entropies.append(chunk_entropy)
    result = {"log_probs": torch.cat(log_probs)}
    if return_token_entropy:
        result["token_entropy"] = torch.cat(entropies)
    return result


@dataclass(frozen=True)
class LogitTransform:
    """What turns a plain Linear head's output z into the scored logits: ``multiplier * cap * tanh(z / cap)``
    (soft-capping when `softcap` is set, else ``multiplier * z``); `multiplier` folds Cohere's `logit_scale`,
    1 / Granite's `logits_scaling`, Falcon-H1's `lm_head_multiplier` and 1 / the sampling temperature into one
    number."""

    softcap: float | None = None
    multiplier: float = 1.0


def linear_head_label_log_probs(
    hidden: torch.Tensor,
    head: nn.Linear,
    labels: torch.Tensor,
    transform: LogitTransform,
    chunk_tokens: int,
    return_token_entropy: bool = False,
) -> dict[str, torch.Tensor]:
    """:func:`chunked_label_log_probs` for a plain ``nn.Linear`` head (tied or not), with a hand-written backward.

    Autograd's backward of one chunk holds ~4 (chunk x vocabulary) float32 tensors and a fresh (vocabulary x
    hidden) weight gradient per chunk; this one holds one (two in the forward when entropies are asked) and adds
    each chunk's weight gradient into one buffer in place. Matmuls run in the autocast dtype when autocast is on
    (as ``nn.Linear`` under autocast would), the softmax in float32.

    Args: as :func:`chunked_label_log_probs`; `head` computes ``hidden @ weight.T + bias`` and `transform` turns
    its output into the scored logits.

    Returns:
        dict[str, torch.Tensor]: "log_probs" (N,) float32 and, when asked, "token_entropy" (N,) (detached).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    device_type = hidden.device.type
    compute_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    # Keep the last chunk's softmax for backward only when one can follow (inside the Function grad mode is off).
    trained = [t for t in (hidden, head.weight, head.bias) if t is not None and t.requires_grad]
    keep_softmax = torch.is_grad_enabled() and bool(trained) and transform.softcap is None
    log_probs, entropy = _LinearHeadLogProbs.apply(
        hidden,
        head.weight,
        head.bias,
        labels,
        transform,
        chunk_tokens,
        compute_dtype,
        return_token_entropy,
        keep_softmax,
    )
    result = {"log_probs": log_probs}
    if return_token_entropy:
        result["token_entropy"] = entropy
    return result


def _chunk_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    transform: LogitTransform,
    out: torch.Tensor,
    keep_tanh: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scored float32 logits (n, V), tanh(z / cap) (n, V) when `keep_tanh` and soft-capping, else None), with
    as few (n, V) tensors as possible: the logits are written into `out`'s first n rows, a float32 buffer reused
    by every chunk (a fresh (n, V) tensor per chunk costs page faults on a CPU and allocator churn on a GPU)."""
    logits = out[: hidden.shape[0]]
    if hidden.dtype == weight.dtype == out.dtype:
        if bias is None:
            torch.mm(hidden, weight.t(), out=logits)
        else:
            torch.addmm(bias.to(out.dtype), hidden, weight.t(), out=logits)
    else:  # a half-precision matmul (autocast or half weights), its output widened into the buffer
        logits.copy_(torch.nn.functional.linear(hidden, weight, bias))
    capped = None
    if transform.softcap is not None:
        capped = logits.div_(transform.softcap).tanh_()  # in place: z is not needed again
        if not keep_tanh:
            return capped.mul_(transform.softcap * transform.multiplier), None
        logits = capped * (transform.softcap * transform.multiplier)
    elif transform.multiplier != 1.0:
        logits.mul_(transform.multiplier)
    return logits, capped


class _LinearHeadLogProbs(torch.autograd.Function):
    # ctx: Any, as torch.autograd.Function declares it: this function keeps its own attributes on it.
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        transform: LogitTransform,
        chunk_tokens: int,
        compute_dtype: torch.dtype | None,
        want_entropy: bool,
        keep_softmax: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.transform, ctx.chunk_tokens, ctx.compute_dtype = transform, chunk_tokens, compute_dtype
        ctx.kept_softmax = None
        cast_hidden, cast_weight, cast_bias = _cast(compute_dtype, hidden, weight, bias)  # weight cast once
        count = hidden.shape[0]
        log_probs = torch.empty(count, dtype=torch.float32, device=hidden.device)
        # Each row's log Z, kept for backward: softmax = exp(logits - log Z) there needs no max or sum pass.
        log_normalizer = torch.empty(count, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros(count if want_entropy else 0, dtype=torch.float32, device=hidden.device)
        logits_buffer = _chunk_buffer(hidden, weight, chunk_tokens)
        exp_buffer = _chunk_buffer(hidden, weight, chunk_tokens) if want_entropy else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, count, chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                logits, _ = _chunk_logits(cast_hidden[rows], cast_weight, cast_bias, transform, logits_buffer)
                label_logits = logits.gather(1, labels[rows, None]).squeeze(1)  # (n,)
                # log Z = max + log sum exp(logits - max); shifting in place keeps exp() finite and adds no tensor.
                shift = logits.amax(dim=-1, keepdim=True)
                shifted = logits.sub_(shift)
                # exp_buffer: want_entropy's. H = log Z - sum p z = log S - (sum e^s s) / S, s = shifted, S = sum e^s
                if exp_buffer is not None:
                    unnormalized = torch.exp(shifted, out=exp_buffer[: shifted.shape[0]])
                    total = unnormalized.sum(dim=-1, keepdim=True).squeeze(1)
                    weighted = torch.einsum("nv,nv->n", unnormalized, shifted)
                    entropy[rows] = total.log() - weighted / total
                    exponentials, buffer = unnormalized, exp_buffer
                else:
                    total = shifted.exp_().sum(dim=-1)  # the shifted logits are not needed again
                    exponentials, buffer = shifted, logits_buffer
                log_normalizer[rows] = shift.squeeze(1) + total.log()
                log_probs[rows] = label_logits - log_normalizer[rows]
                if keep_softmax and start + chunk_tokens >= count:
                    # The last chunk's softmax stays in its buffer and the backward starts with it: one chunk
                    # fewer to recompute (none when the batch is one chunk), and no more peak memory, since the
                    # backward needs a chunk-sized buffer anyway and reuses this one.
                    exponentials.div_(total[:, None])
                    ctx.kept_softmax = buffer
                del logits, shifted, exponentials, buffer
        ctx.save_for_backward(hidden, weight, bias, labels, log_normalizer)
        ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx: Any, grad_log_probs: torch.Tensor, _grad_entropy: torch.Tensor) -> tuple:
        hidden, weight, bias, labels, log_normalizer = ctx.saved_tensors
        transform, compute_dtype = ctx.transform, ctx.compute_dtype
        cast_hidden, cast_weight, cast_bias = _cast(compute_dtype, hidden, weight, bias)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None  # every row is written once
        grad_weight = None
        if need_weight:  # the first chunk writes it, later ones add: no (V, H) zero fill unless there is no chunk
            grad_weight = (torch.empty_like if hidden.shape[0] else torch.zeros_like)(weight, dtype=torch.float32)
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias else None
        # The forward's kept softmax serves once: a second backward through a retained graph recomputes.
        kept_softmax, ctx.kept_softmax = ctx.kept_softmax, None
        buffer = kept_softmax if kept_softmax is not None else _chunk_buffer(hidden, weight, ctx.chunk_tokens)
        starts = range(0, hidden.shape[0], ctx.chunk_tokens)
        for order, start in enumerate(reversed(starts)):  # the last chunk first: its softmax may be kept
            rows, first = slice(start, start + ctx.chunk_tokens), order == 0
            if first and kept_softmax is not None:
                grad_logits, capped = kept_softmax[: hidden.shape[0] - start], None  # no soft-capping when kept
            else:
                logits, capped = _chunk_logits(
                    cast_hidden[rows], cast_weight, cast_bias, transform, buffer, keep_tanh=True
                )
                # softmax from the forward's log Z, in place
                grad_logits = logits.sub_(log_normalizer[rows, None]).exp_()
                del logits
            # d log p(y) / d logits = onehot(y) - softmax(logits), times the incoming gradient g (and the logit
            # multiplier): -g p everywhere, +g at the label; in place.
            scale = grad_log_probs[rows] * transform.multiplier  # (n,)
            grad_logits.mul_(scale.neg()[:, None])
            grad_logits[torch.arange(grad_logits.shape[0], device=grad_logits.device), labels[rows]] += scale
            if capped is not None:  # d(cap tanh(z / cap)) / dz = 1 - tanh^2
                grad_logits.mul_(capped.square_().neg_().add_(1))
                del capped
            # The gradient's matmuls in the forward's matmul dtype: the autocast dtype, or the weight's own
            # (half-precision weights without autocast, model.dtype=bfloat16).
            grad_z = grad_logits.to(cast_weight.dtype)  # (n, V); no copy when float32
            if grad_hidden is not None:
                grad_hidden[rows] = grad_z @ cast_weight
            # grad_weight, grad_hidden, grad_bias: None where no gradient is needed (ctx.needs_input_grad).
            if grad_weight is not None and grad_z.dtype == torch.float32:  # in place: no (V, H) temporary
                grad_weight.addmm_(grad_z.T, cast_hidden[rows], beta=0 if first else 1)
            elif grad_weight is not None:  # a half-precision (V, H) product, summed in fp32
                product = grad_z.T @ cast_hidden[rows]
                grad_weight.copy_(product) if first else grad_weight.add_(product)
            if grad_bias is not None:
                grad_bias.add_(grad_z.sum(dim=0))
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def _chunk_buffer(hidden: torch.Tensor, weight: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """An uninitialized float32 (min(chunk, rows), vocabulary) buffer for one chunk's logits."""
    return torch.empty(min(chunk_tokens, hidden.shape[0]), weight.shape[0], dtype=torch.float32, device=hidden.device)


def _cast(
    dtype: torch.dtype | None, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if dtype is None:
        return hidden, weight, bias
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
