"""Label log-probs and entropies from the last hidden states, the LM head run a chunk of tokens at a time.

The (tokens x vocabulary) logits of a microbatch are the largest tensors of a step: 8 completions x 512 tokens
at Qwen2.5's 151,936-token vocabulary are 2.5 GB per float32 copy, and the log-softmax, the entropy and their
gradients make several. Here the head, the model's head semantics, the temperature and the float32 log-softmax
run on `chunk_tokens` rows at a time, so no tensor larger than (chunk_tokens x vocabulary) exists:

- forward: each chunk's logits are freed as soon as its log-probs (and entropies) are read off them;
- backward: each chunk runs under `torch.utils.checkpoint` (non-reentrant), which keeps only the chunk's hidden
  states and recomputes its logits when the backward pass reaches it, restoring autocast and the RNG state.
  Whatever the head is (a plain or tied Linear, a LoRA-wrapped one) autograd differentiates it, and the
  gradients of the head's weight from every chunk sum into one buffer.

Equal to the unchunked path up to float rounding (tests/test_chunked_logprobs.py: log-probs, entropies and every
parameter's gradient); the memory and time it saves are in docs/memory.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
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
