"""Per-token log-probabilities of the labels and the policy's per-token entropy.

Both read a (batch, seq, vocab) logits tensor, the largest tensor in a training step, so each function keeps
the number of full-vocab temporaries small: log-probs gather the label logit and subtract a logsumexp rather
than building a whole log_softmax.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from grpo_cli.core.causal_lm import as_causal_lm
from grpo_cli.core.chunked_logprobs import (
    LOGITS_CHUNK_TOKENS,
    ChunkScorer,
    Head,
    LogitTransform,
    chunked_label_log_probs,
    linear_head_label_log_probs,
)
from grpo_cli.core.packing import pack_rows, packed_row_tokens, packing_beats_sharing, sequence_lengths, unpack_at
from grpo_cli.core.prompt_sharing import (
    distinct_prompts,
    prompt_sharing_problem,
    shared_prompt_response_hidden,
    worth_sharing,
)
from grpo_cli.core.prompt_tree import prompt_tree_hidden


def _in_float32(fn: Callable[..., torch.Tensor], logits: torch.Tensor, *per_row: torch.Tensor) -> torch.Tensor:
    """Apply ``fn(logits, *per_row)`` at float32 precision or better.

    Half-precision logits are upcast because log-probs and entropies are small differences of large numbers.
    A (batch, seq, vocab) batch is upcast one sequence at a time so the float32 copy stays one sequence long.
    """
    if logits.dtype in (torch.float32, torch.float64):
        return fn(logits, *per_row)
    if logits.dim() < 3:
        return fn(logits.float(), *per_row)
    return torch.stack([fn(row.float(), *(t[i] for t in per_row)) for i, row in enumerate(logits)])


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    # Subtracting the max makes every shifted logit <= 0, so exp() cannot overflow (logits of 1e4 are fine);
    # clamping -inf (a masked vocab entry) to the lowest finite value keeps 0 * -inf from turning into nan.
    shifted = (logits - logits.amax(dim=-1, keepdim=True).detach()).clamp_min(torch.finfo(logits.dtype).min)
    log_normalizer = torch.logsumexp(shifted, dim=-1, keepdim=True)  # (..., 1)
    probs = torch.exp(shifted - log_normalizer)  # (..., V)
    # H = -sum p log p = -sum p (shifted - log Z) = log Z - sum p * shifted
    return log_normalizer.squeeze(-1) - (probs * shifted).sum(dim=-1)


def _label_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    label_logits = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)  # (..., )
    return label_logits - torch.logsumexp(logits, dim=-1)  # log softmax(logits)[label]


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution over the last (vocab) dimension.

    Computed as ``logsumexp(z) - sum(softmax(z) * z)`` on max-shifted logits ``z``, which stays finite for
    huge logits and for -inf entries. Half-precision logits are computed in float32. Differentiable.

    Args:
        logits (torch.Tensor): unnormalized scores, shape (..., vocab_size), e.g. (batch, seq, vocab_size).

    Returns:
        torch.Tensor: entropy in nats, shape (...), e.g. (batch, seq); float32 for half-precision input.
    """
    return _in_float32(_entropy, logits)


def get_response_log_probs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    return_token_entropy: bool = False,
) -> dict[str, torch.Tensor]:
    """Log-probability of each label under already-computed next-token logits.

    Args:
        logits (torch.Tensor): next-token logits, shape (batch, seq, vocab_size); position t predicts
            ``labels[:, t]``.
        labels (torch.Tensor): token ids, shape (batch, seq), long, each in [0, vocab_size).
        return_token_entropy (bool): also return the entropy of each position's distribution.

    Returns:
        dict[str, torch.Tensor]:

        - "log_probs": (batch, seq), ``log softmax(logits)[label]``, differentiable; nothing is masked.
          float32 for half-precision logits.
        - "token_entropy": (batch, seq), only when ``return_token_entropy``; detached (it is for monitoring,
          and keeping it in the graph would hold extra full-vocab tensors until backward).

    Raises:
        ValueError: if ``labels`` is not shaped like ``logits`` without its last dimension.
    """
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels have shape {tuple(labels.shape)} but logits {tuple(logits.shape)}; "
            "labels must be shaped like logits without the vocab dimension"
        )
    result = {"log_probs": _in_float32(_label_log_probs, logits, labels)}  # (B, T)
    if return_token_entropy:
        with torch.no_grad():
            result["token_entropy"] = compute_entropy(logits)  # (B, T)
    return result


def get_response_log_probs(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    return_token_entropy: bool = False,
    attention_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Run a causal language model and return the log-probability of each label.

    Args:
        model (nn.Module): a Hugging Face causal LM (or anything whose ``model(input_ids).logits`` is
            (batch, seq, vocab_size)).
        input_ids (torch.Tensor): shape (batch, seq), long.
        labels (torch.Tensor): shape (batch, seq), long; ``labels[:, t]`` is the token that follows
            ``input_ids[:, : t + 1]`` (see :func:`tokenize_prompt_and_output`).
        return_token_entropy (bool): also return the per-position entropy of the next-token distribution.
        attention_mask (torch.Tensor | None): shape (batch, seq), passed to the model when given. Right
            padding does not need one: a causal model never attends from a real token to a later pad.

    Returns:
        dict[str, torch.Tensor]: "log_probs" (batch, seq) and, when asked, "token_entropy" (batch, seq); see
        :func:`get_response_log_probs_from_logits`. Nothing is masked.
    """
    return response_log_probs(
        model, input_ids, labels, return_token_entropy=return_token_entropy, attention_mask=attention_mask
    )


def response_log_probs(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    response_mask: torch.Tensor | None = None,
    return_token_entropy: bool = False,
    temperature: float = 1.0,
    share_prompts: bool = False,
    attention_mask: torch.Tensor | None = None,
    logits_chunk_tokens: int = LOGITS_CHUNK_TOKENS,
    pack_sequences: bool = False,
    prompt_tree: bool = False,
) -> dict[str, torch.Tensor]:
    """The one log-prob computation of the project: training, old and reference log-probs, evaluation and the
    vLLM sync probe all call it, so what the probe checks is what the trainer optimizes.

    Args:
        model (nn.Module): the causal LM (a peft-wrapped one too).
        input_ids, labels (torch.Tensor): (batch, seq), long, as :func:`tokenize_prompt_and_output_ids` builds.
        response_mask (torch.Tensor | None): (batch, seq); when given, the LM head and the log-softmax run only
            at these positions (over a 49k vocabulary they cost as much as the rest of the model, and prompt
            positions are never scored) and the result is 0 elsewhere, in float32. None: every position, through
            the model's own forward (the handout's :func:`get_response_log_probs`).
        return_token_entropy (bool): also return each position's entropy (detached; 0 outside the mask).
        temperature (float): score under softmax(logits / temperature), the distribution tokens were sampled
            from.
        share_prompts (bool): rows with the same prompt share one forward pass of it
            (grpo_cli/core/prompt_sharing.py: same numbers, fewer FLOPs).
        attention_mask (torch.Tensor | None): passed to the model's forward when no response_mask is given.
        logits_chunk_tokens (int): with a response_mask, run the LM head and the log-softmax on this many
            response tokens at a time, recomputing each chunk's logits in backward, so no (tokens x vocabulary)
            tensor of the whole batch exists (grpo_cli/core/chunked_logprobs.py; same numbers). 0: all response
            tokens at once (the unchunked path, kept for comparison).
        pack_sequences (bool): with a response_mask, run the rows' sequences packed, without their padding
            (grpo_cli/core/packing.py: same numbers where the model packs, which core.packing.packing_problem
            checks; the caller's decision). With share_prompts too, each batch takes the layout that processes
            fewer positions (core.packing.packing_beats_sharing): the two do not combine.
        prompt_tree (bool): with share_prompts, run the shared-prompt forward as one packed row of each prompt and
            its completions (grpo_cli/core/prompt_tree.py: no completion padding; where the model's probe passed,
            core.prompt_tree.prompt_tree_problem, the caller's decision). It beats packing, so it takes its place.

    Returns:
        dict[str, torch.Tensor]: "log_probs" (batch, seq) and, when asked, "token_entropy" (batch, seq).
    """
    if response_mask is None:
        if pack_sequences:
            raise ValueError("pack_sequences needs a response_mask (the positions scored)")
        kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
        logits = model(input_ids, **kwargs).logits  # (B, T, V)
        if temperature != 1.0:
            logits = logits / temperature
        return get_response_log_probs_from_logits(logits, labels, return_token_entropy=return_token_entropy)

    mask = response_mask.bool()
    hidden = _hidden_at(model, input_ids, labels, mask, share_prompts, pack_sequences, prompt_tree)  # (N, H)
    labels_at = labels[mask]  # (N,)
    plain_head = linear_head(model)
    if logits_chunk_tokens > 0 and plain_head is not None:
        transform = logit_transform(as_causal_lm(model).config, temperature)
        out = linear_head_label_log_probs(
            hidden, plain_head, labels_at, transform, logits_chunk_tokens, return_token_entropy
        )
    elif logits_chunk_tokens > 0:
        scorer = _chunk_scorer(_scaled_head(model, temperature))
        out = chunked_label_log_probs(hidden, labels_at, scorer, logits_chunk_tokens, return_token_entropy)
    else:
        logits = _scaled_head(model, temperature)(hidden)  # (N, V): every response token's at once
        out = get_response_log_probs_from_logits(logits, labels_at, return_token_entropy)
    result = {}
    for key, values in out.items():
        full = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
        full[mask] = values.float()
        result[key] = full
    return result


def _scaled_head(model: nn.Module, temperature: float) -> Head:
    """Hidden states (n, H) -> the logits the tokens were sampled from: the model's LM head, its head semantics,
    then the sampling temperature."""
    lm = as_causal_lm(model)
    output_embeddings, config = lm.get_output_embeddings(), lm.config

    def head(hidden: torch.Tensor) -> torch.Tensor:
        return apply_head_semantics(config, output_embeddings(hidden), temperature)  # (n, V)

    return head


def _chunk_scorer(head: Head) -> ChunkScorer:
    """The unchunked computation on one chunk of rows: log-probs first, then (without grad) entropies."""

    def score(
        hidden: torch.Tensor, labels: torch.Tensor, want_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = head(hidden)  # (n, V)
        log_probs = _in_float32(_label_log_probs, logits, labels)  # (n,)
        if not want_entropy:
            return log_probs, None
        with torch.no_grad():
            return log_probs, compute_entropy(logits)

    return score


def _hidden_at(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    share_prompts: bool,
    pack_sequences: bool = False,
    prompt_tree: bool = False,
) -> torch.Tensor:
    """Last hidden states at the masked positions only, (N, H), in the row-major order of `mask`. Right padding
    needs no attention mask: causal attention never lets a real token see the padding after it. Packed or as a
    prompt tree, the padding is not computed at all."""
    decoder = _decoder(model)
    # Gradient checkpointing turns the KV cache off, and the two-pass shared forward needs it (the prompt tree
    # does not: one forward, no cache). The model check is the learner's too (`shares_prompts`), so a model the
    # shared pass cannot serve gets the plain one from any caller.
    if (
        share_prompts
        and (prompt_tree or not _recomputes_activations(model))
        and prompt_sharing_problem(model) is None
        and worth_sharing(input_ids, mask)
        and (prompt_tree or not (pack_sequences and _packing_beats_sharing(input_ids, mask)))
    ):
        if prompt_tree:
            row_tokens = functools.partial(packed_row_tokens, model)
            return prompt_tree_hidden(model, decoder, input_ids, labels, mask, row_tokens)  # (N, H)
        return shared_prompt_response_hidden(decoder, input_ids, labels, mask, pad_id=0)  # (N, H)
    if pack_sequences:
        # Exactly attention_mask=None and use_cache=False: only then does transformers build each sequence's own
        # causal mask from the restarting position ids (core/packing.py); a mask or a cache mixes the sequences.
        packed = pack_rows(input_ids, mask, packed_row_tokens(model, sequence_lengths(mask)))
        hidden = decoder(
            input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None, use_cache=False
        ).last_hidden_state  # (R, L, H)
        return unpack_at(hidden, packed, mask)  # (N, H)
    return decoder(input_ids=input_ids).last_hidden_state[mask]  # (N, H)


def _packing_beats_sharing(input_ids: torch.Tensor, mask: torch.Tensor) -> bool:
    """core.packing.packing_beats_sharing on a right-padded batch: the layout that processes fewer positions."""
    prompts, _, prompt_lengths = distinct_prompts(input_ids, mask)
    completion_lengths = mask.sum(dim=1).tolist()
    return packing_beats_sharing(prompt_lengths, completion_lengths, [len(p) for p in prompts])


def _decoder(model: nn.Module) -> nn.Module:
    """The model's body, whose output has `last_hidden_state`. `get_decoder()` returns the LM itself, head and
    all, where it finds no attribute it knows: transformers 5's text-only Llama 4 (`base_model_prefix`
    `language_model`, body `.model`), transformers 4's Mamba / RWKV (bodies `.backbone`, `.rwkv`). The body is then
    the LM's `base_model`, else its `.model`."""
    decoder = as_causal_lm(model).get_decoder()
    if getattr(decoder, "get_output_embeddings", lambda: None)() is None:
        return decoder
    body = getattr(decoder, "base_model", decoder)
    return body if body is not decoder else getattr(decoder, "model", decoder)


def logit_transform(config: object, temperature: float = 1.0) -> LogitTransform:
    """What some architectures' forward does to the LM head's output before returning logits (the fast path
    above calls the head itself, so it must do the same): soft-capping (Gemma-2/3's `final_logit_softcapping`,
    RecurrentGemma's `logits_soft_cap`, xLSTM's `output_logit_soft_cap`), Cohere's `logit_scale`, Granite's
    `logits_scaling`, Falcon-H1's `lm_head_multiplier`, read from the model config where those forwards read
    them; then the sampling temperature."""
    multiplier = 1.0
    scale = getattr(config, "logit_scale", None)
    if isinstance(scale, int | float):
        multiplier *= scale
    scaling = getattr(config, "logits_scaling", None)
    if isinstance(scaling, int | float):
        multiplier /= scaling
    head_multiplier = getattr(config, "lm_head_multiplier", None)
    if isinstance(head_multiplier, int | float):
        multiplier *= head_multiplier
    softcap = None
    for key in ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap"):
        softcap = getattr(config, key, None) if softcap is None else softcap
    return LogitTransform(softcap=softcap, multiplier=multiplier / temperature)


def apply_head_semantics(config: object, logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The LM head's output `logits` -> the scored logits (:func:`logit_transform`), on a whole tensor."""
    transform = logit_transform(config, temperature)
    if transform.softcap is not None:
        logits = torch.tanh(logits / transform.softcap) * transform.softcap
    return logits * transform.multiplier if transform.multiplier != 1.0 else logits


def linear_head(model: nn.Module) -> nn.Linear | None:
    """The model's LM head when it is a plain ``nn.Linear`` (tied or not), which the hand-written chunked backward
    handles; None for anything else (a LoRA-wrapped or quantized head), which autograd differentiates."""
    head = as_causal_lm(model).get_output_embeddings()
    return head if type(head) is nn.Linear else None


def _recomputes_activations(model: nn.Module) -> bool:
    get_base_model = getattr(model, "get_base_model", None)  # a peft wrapper's
    base = get_base_model() if get_base_model is not None else model
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # the newer name first
        if hasattr(type(base), name):
            return bool(getattr(base, name))
    return False
