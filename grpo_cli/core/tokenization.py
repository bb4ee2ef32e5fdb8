"""Build the (input_ids, labels, response_mask) batch that the log-prob and loss functions score.

Prompt and output are tokenized separately and concatenated, so the response mask marks exactly the output
tokens even when a tokenizer would merge characters across the prompt/output boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def tokenize_prompt_and_output_ids(
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """Concatenate already-tokenized prompts and outputs into a shifted, right-padded training batch.

    The trainer calls this with the ids straight from generation, so that the tokens it scores are exactly
    the tokens that were sampled (re-tokenizing decoded text can give different ids).

    Args:
        prompt_ids (Sequence[Sequence[int]]): token ids of each prompt, length ``batch``.
        output_ids (Sequence[Sequence[int]]): token ids of each output, length ``batch``.
        pad_token_id (int): id written into the padding positions.

    Returns:
        dict[str, torch.Tensor]: with ``L = max(len(prompt) + len(output))`` over the batch,

        - "input_ids": (batch, L - 1) long, the concatenated sequences without their last token.
        - "labels": (batch, L - 1) long, the concatenated sequences without their first token.
        - "response_mask": (batch, L - 1) bool, True on the label positions that hold output tokens.

    Raises:
        ValueError: if the two lists differ in length or are empty.
    """
    if len(prompt_ids) != len(output_ids):
        raise ValueError(f"got {len(prompt_ids)} prompts but {len(output_ids)} outputs; pass one output per prompt")
    if len(prompt_ids) == 0:
        raise ValueError("got an empty batch; pass at least one prompt and output")

    sequences = [list(prompt) + list(output) for prompt, output in zip(prompt_ids, output_ids, strict=True)]
    max_len = max(len(sequence) for sequence in sequences)
    full_ids = torch.full((len(sequences), max_len), pad_token_id, dtype=torch.long)  # (B, L)
    full_response_mask = torch.zeros((len(sequences), max_len), dtype=torch.bool)  # (B, L)
    for row, (prompt, sequence) in enumerate(zip(prompt_ids, sequences, strict=True)):
        full_ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        full_response_mask[row, len(prompt) : len(sequence)] = True

    return {
        "input_ids": full_ids[:, :-1],  # (B, L - 1)
        "labels": full_ids[:, 1:],  # (B, L - 1)
        "response_mask": full_response_mask[:, 1:],  # (B, L - 1), aligned with labels
    }


def tokenize_prompt_and_output(
    prompt_strs: Sequence[str],
    output_strs: Sequence[str],
    tokenizer: PreTrainedTokenizerBase,
) -> dict[str, torch.Tensor]:
    """Tokenize prompts and outputs separately, concatenate them, and build a shifted training batch.

    Neither side gets special tokens (``add_special_tokens=False``): the prompt strings are expected to carry
    their own template. Padding uses ``tokenizer.pad_token_id``, or ``eos_token_id`` when there is none.

    Args:
        prompt_strs (Sequence[str]): the prompts, length ``batch``.
        output_strs (Sequence[str]): the outputs, length ``batch``.
        tokenizer (PreTrainedTokenizerBase): a Hugging Face tokenizer, or anything whose
            ``tokenizer(list_of_str, add_special_tokens=False)["input_ids"]`` returns lists of ids and that
            has ``pad_token_id`` / ``eos_token_id``.

    Returns:
        dict[str, torch.Tensor]: "input_ids", "labels", "response_mask", each (batch, L - 1) with
        ``L = max(len(prompt tokens) + len(output tokens))``; see :func:`tokenize_prompt_and_output_ids`.

    Raises:
        ValueError: if the lists differ in length or are empty, or the tokenizer has neither a pad nor an eos
            token.
    """
    pad_token_id = tokenizer.pad_token_id
    if pad_token_id is None:
        pad_token_id = tokenizer.eos_token_id
    if pad_token_id is None:
        raise ValueError("the tokenizer has neither pad_token_id nor eos_token_id; set one to pad with")
    if len(prompt_strs) != len(output_strs):
        raise ValueError(f"got {len(prompt_strs)} prompts but {len(output_strs)} outputs; pass one output per prompt")
    if len(prompt_strs) == 0:
        raise ValueError("got an empty batch; pass at least one prompt and output")

    prompt_ids = tokenizer(list(prompt_strs), add_special_tokens=False)["input_ids"]
    output_ids = tokenizer(list(output_strs), add_special_tokens=False)["input_ids"]
    return tokenize_prompt_and_output_ids(prompt_ids, output_ids, pad_token_id)
