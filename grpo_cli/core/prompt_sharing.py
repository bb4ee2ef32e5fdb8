"""Scoring G completions of one prompt with the prompt's forward pass computed once, not G times.

A GRPO microbatch holds each prompt G times (once per completion). The plain forward runs every copy of the
prompt through the model; here each distinct prompt runs once with `use_cache=True`, its keys and values are
indexed out to the completions that share it (`Cache.batch_select_indices`, a differentiable gather, so the
gradients of all G completions flow back into the one prompt pass), and the completions run on top of that
cache. The result is the same log-probs and the same gradients as the plain forward (tested), with the prompt
tokens' share of the training FLOPs divided by G — on the keyword task's 43-token prompts and <= 48-token
completions that is ~40% of the step's training compute.

Layout: prompts are left-padded to the longest distinct prompt, with an attention mask hiding the padding and
position ids counting each prompt's own tokens; the completions follow in the same columns for every row, their
position ids continuing from each prompt's real length. So every completion sees exactly its own prompt, at the
positions the plain forward would give it, and the distance between two real tokens in the cache is their true
distance. Sliding-window attention (Mistral, Qwen2/3 with `use_sliding_window`, Gemma-2/3, Phi-3, GPT-OSS, ...)
measures distance in cache columns: right-padded prompts put padding inside the window, and a sliding cache
keeping the last window's columns kept padding instead of the prompt (up to 3.7 nats off, before this layout).

What it serves (:func:`prompt_sharing_problem`): models whose every layer is full, sliding-window or chunked
attention over a per-token key/value cache; transformers builds the chunked mask from the left padding, so the
chunks start at each prompt's first token (tested). A linear-attention, convolution or SSM layer (Qwen3-Next,
Qwen3.5, LFM2, Mamba and its hybrids: Jamba, Bamba, Falcon-H1, Zamba, ...) carries a recurrent state instead:
the prompt pass would run it through the left padding and `batch_select_indices` cannot hand it to the
completions; indexed (DeepSeek-V3.2) and compressed (DeepSeek-V4) attention keep caches of their own. Those
models get the plain forward, whose right padding comes after every real token.
"""

from __future__ import annotations

import torch

from grpo_cli.core.causal_lm import as_causal_lm, cache_keyword

# The layer kinds the shared layout is proven for (tests/unit/core/test_sliding_window_logprobs.py,
# tests/unit/core/test_prompt_sharing_architectures.py). "attention" is transformers 4's name for full attention
# beside "mamba" / "recurrent" blocks (`layers_block_type`, `block_types`), which refuse such a model anyway.
SERVED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})


def prompt_sharing_problem(model: torch.nn.Module) -> str | None:
    """Why the shared-prompt forward cannot score `model` exactly (one clause naming the model type), or None
    when it can. Read from the model's (text) config and class, never from a batch: one model, one answer.

    Refused: a layer kind outside SERVED_LAYER_TYPES in `layer_types` (or transformers 4's `layers_block_type`,
    RecurrentGemma's `block_types`), and a model transformers marks as keeping a recurrent state or a cache of
    its own (`_is_stateful`, `_supports_default_dynamic_cache`: Mamba, RWKV, xLSTM, MiniMax, transformers 4's
    Jamba / Bamba / Falcon-H1 / Zamba, ... whatever their config says).
    """
    config = as_causal_lm(model).config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text_config, "model_type", None) or type(model).__name__
    kinds: set[str] = set()
    for key in ("layer_types", "layers_block_type", "block_types"):
        listed = getattr(text_config, key, None)
        if isinstance(listed, list | tuple):
            kinds.update(str(kind) for kind in listed)
    unserved = sorted(kinds - SERVED_LAYER_TYPES)
    if unserved:
        return f"{model_type} has {'/'.join(unserved)} layers"
    if getattr(model, "_is_stateful", False):
        return f"{model_type} keeps a recurrent state"
    supports_dynamic_cache = getattr(model, "_supports_default_dynamic_cache", None)
    if callable(supports_dynamic_cache) and not supports_dynamic_cache():
        return f"{model_type} needs a cache class of its own"
    return None


def distinct_prompts(
    input_ids: torch.Tensor, response_mask: torch.Tensor
) -> tuple[list[list[int]], list[int], list[int]]:
    """Read each row's prompt from a right-padded (input_ids, response_mask) batch and deduplicate them.

    Returns (distinct prompts, index of each row's prompt among them, each row's prompt length). A row's
    prompt is its input tokens before the first response label position + 1 (labels are shifted by one).
    """
    first_response = response_mask.int().argmax(dim=1).tolist()
    prompts: list[list[int]] = []
    where: dict[tuple[int, ...], int] = {}
    row_to_prompt, lengths = [], []
    for row, start in enumerate(first_response):
        prompt = input_ids[row, : start + 1].tolist()
        key = tuple(prompt)
        if key not in where:
            where[key] = len(prompts)
            prompts.append(prompt)
        row_to_prompt.append(where[key])
        lengths.append(len(prompt))
    return prompts, row_to_prompt, lengths


def worth_sharing(input_ids: torch.Tensor, response_mask: torch.Tensor) -> bool:
    """True when some prompt occurs more than once in the batch (otherwise sharing saves nothing)."""
    prompts, _, _ = distinct_prompts(input_ids, response_mask)
    return len(prompts) < input_ids.shape[0]


def shared_prompt_response_hidden(
    decoder: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, response_mask: torch.Tensor, pad_id: int
) -> torch.Tensor:
    """Hidden states at the response label positions, (N, H) in row-major order of `response_mask`.

    Equal (up to float rounding) to `decoder(input_ids).last_hidden_state[response_mask]`.
    """
    device = input_ids.device
    prompts, row_to_prompt, prompt_lengths = distinct_prompts(input_ids, response_mask)
    completion_lengths = response_mask.sum(dim=1).tolist()
    batch = input_ids.shape[0]
    width = max(len(p) for p in prompts)
    # 1. Each distinct prompt once, left-padded: its last token in column width - 1 for every prompt.
    prompt_batch = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    prompt_mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for i, prompt in enumerate(prompts):
        prompt_batch[i, width - len(prompt) :] = torch.tensor(prompt, device=device)
        prompt_mask[i, width - len(prompt) :] = 1
    # Padding columns get position 0 (they are masked; any in-range value would do).
    prompt_positions = (prompt_mask.cumsum(dim=1) - 1).clamp_min(0)
    # Our own cache, every layer keeping all its keys: the model's default may keep only a sliding layer's last
    # window (fine here, but transformers 4.57's Qwen2-MoE then masks the wrong columns) or, for Gemma-2/3 and
    # Cohere-2 on 4.57, be no cache at all in train mode. The attention masks apply the windows.
    from transformers import DynamicCache  # here, not at import: grpo_cli.core imports torch only

    cache = DynamicCache()
    # `cache` or `past_key_values`, whichever this transformers takes: the forward accepts **kwargs, so a name it
    # no longer reads would be dropped silently and the completions scored without their prompt.
    cache_argument = {cache_keyword(decoder): cache}
    prefix = decoder(
        input_ids=prompt_batch,
        attention_mask=prompt_mask,
        position_ids=prompt_positions,
        use_cache=True,
        **cache_argument,
    )
    rows = torch.tensor(row_to_prompt, device=device)
    cache.batch_select_indices(rows)  # (distinct, ...) -> (batch, ...): differentiable indexing
    # 2. The completions on top, in columns width.. for every row. The first response token is predicted from
    #    the prompt's last position, so the completion pass only needs the response tokens except the last.
    suffix_len = max(max(completion_lengths) - 1, 0)
    last_prompt_hidden = prefix.last_hidden_state[rows, width - 1]  # (B, H)
    if suffix_len == 0:
        return last_prompt_hidden
    completion_ids = torch.full((batch, suffix_len), pad_id, dtype=torch.long, device=device)
    attention_mask = torch.cat(
        [prompt_mask[rows], torch.zeros((batch, suffix_len), dtype=torch.long, device=device)], dim=1
    )  # (B, width + S)
    positions = torch.zeros((batch, suffix_len), dtype=torch.long, device=device)
    for row in range(batch):
        n_inputs = max(completion_lengths[row] - 1, 0)  # an empty completion has no inputs (and no scores)
        tokens = labels[row][response_mask[row]][:n_inputs]
        completion_ids[row, :n_inputs] = tokens
        attention_mask[row, width : width + n_inputs] = 1
        # Padding rows continue counting too: harmless, and it keeps positions inside the model's range.
        positions[row] = prompt_lengths[row] + torch.arange(suffix_len, device=device)
    suffix = decoder(
        input_ids=completion_ids, attention_mask=attention_mask, position_ids=positions, **cache_argument
    ).last_hidden_state  # (B, S, H)
    # Hidden state predicting response token k: the prompt's last position for k = 0, else suffix[k - 1].
    per_row = torch.cat([last_prompt_hidden[:, None, :], suffix], dim=1)  # (B, S + 1, H)
    compact_mask = (
        torch.arange(suffix_len + 1, device=device)[None, :] < torch.tensor(completion_lengths, device=device)[:, None]
    )
    return per_row[compact_mask]
