"""The RolloutEngine interface: prompts in, sampled completions (text + token ids) out.

Every engine returns the same contract, so the trainer cannot tell them apart: for each completion the
prompt token ids it was sampled from and the sampled token ids themselves, cut after the first EOS token or
stop string (both kept). The trainer scores exactly these ids, so the response mask lines up with what was
sampled rather than with a re-tokenization of the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from grpo_cli.episodes.chat_roles import renderable
from grpo_cli.errors import UserFacingError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from grpo_cli.tasks.base import Prompt


class WeightSyncError(UserFacingError):
    """An engine's weights could not be brought in line with the policy (timeout, failure, log-prob mismatch)."""


@dataclass(frozen=True)
class SamplingSettings:
    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    min_tokens: int = 0
    max_tokens: int = 48
    stop: tuple[str, ...] = ()  # stop strings, kept in the output
    seed: int = 0
    # The index, within the whole step's prompt list, of the first prompt of this generate() call (a data-parallel
    # rank passes its share's offset): each completion's random stream depends on (seed, prompt index,
    # completion index) only, so neither the split across ranks nor the batch composition changes it.
    first_prompt_index: int = 0
    # Explicit stream indices, one per prompt of this call, replacing first_prompt_index + i (None: those). A
    # multi-turn round passes its unfinished episodes' own indices (rollout/episode_rollout.py), so an episode's turn is
    # sampled from the same stream whichever other episodes are still running.
    prompt_indices: tuple[int, ...] | None = None

    def prompt_index(self, i: int) -> int:
        """The stream index of this call's i-th prompt (its index in the step's prompt list, or the explicit one)."""
        return self.prompt_indices[i] if self.prompt_indices is not None else self.first_prompt_index + i

    def chunk(self, start: int, stop: int) -> SamplingSettings:
        """The settings of prompts [start, stop) of this call sampled on their own (same streams)."""
        if self.prompt_indices is not None:
            return replace(self, prompt_indices=self.prompt_indices[start:stop])
        return replace(self, first_prompt_index=self.first_prompt_index + start)


@dataclass
class RolloutBatch:
    """Completions in prompt-major order: the n completions of prompt 0, then of prompt 1, ..."""

    prompt_ids: list[list[int]]  # (n_prompts * n) prompt token ids, repeated per completion
    completion_ids: list[list[int]]  # (n_prompts * n) sampled ids, incl. the final EOS / stop tokens
    texts: list[str]  # decoded completions without special tokens
    truncated: list[bool]  # True when max_tokens was reached before EOS or a stop string
    # Per completion, one per completion id: log-prob of the sampled token under the sampler's softmax(logits / T)
    # over the full vocabulary (before top-p truncation).
    sampler_log_probs: list[list[float]] | None = None
    # Per completion: True when it was cut because its prompt and it filled the model's context (then truncated too);
    # empty when no completion was (engines fill it only then).
    context_limited: list[bool] = field(default_factory=list)

    @property
    def n_generated_tokens(self) -> int:
        return sum(len(ids) for ids in self.completion_ids)

    @property
    def n_context_limited(self) -> int:
        return sum(self.context_limited)


class RolloutEngine(Protocol):
    @property
    def context_length(self) -> int | None:
        """The most tokens a sequence (its prompt and its completion together) may hold on this engine: vLLM's
        max_model_len, the transformers model's max_position_embeddings; None when the model does not say. No
        completion is sampled past it: each row's new tokens are at most context_length - its prompt's length."""
        ...

    def generate(self, prompt_ids: list[list[int]], settings: SamplingSettings) -> RolloutBatch:
        """Sample settings.n completions for every prompt, each at most settings.max_tokens tokens and never past
        `context_length` (a completion cut there is truncated and marked in `context_limited`; a prompt that fills
        the context gets empty completions)."""
        ...

    def sync_weights(self, version: int | None = None) -> dict[str, float]:
        """Make the engine sample from the policy's current weights (`version`: the policy version they are,
        i.e. the learner's step; engines with a probe schedule use it).

        Returns metrics to log: at least `time/sync_s`; engines with their own copy of the weights also
        report `sync/logprob_max_diff` from a probe that compares their log-probs with the policy's.
        """
        ...

    def close(self) -> None: ...


def render_prompts(prompts: Sequence[Prompt], tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Token ids of each prompt: chat messages through the tokenizer's chat template, text as is."""
    rendered = []
    for prompt in prompts:
        if isinstance(prompt, str):
            rendered.append(tokenizer(prompt, add_special_tokens=True)["input_ids"])
        else:
            messages = renderable(tokenizer, prompt)  # the system text in the first user turn if it must be
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            # The template already holds the special tokens; adding BOS again would duplicate it.
            rendered.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return rendered


def context_room(prompt_ids: Sequence[Sequence[int]], max_tokens: int, context_length: int | None) -> list[int]:
    """Per prompt, the most tokens a completion may have: `max_tokens`, or what the context leaves after the prompt
    (context_length - its length, at least 0) when that is less."""
    if context_length is None:
        return [max_tokens] * len(prompt_ids)
    return [max(0, min(max_tokens, context_length - len(ids))) for ids in prompt_ids]


def first_prompt_past_context(
    prompts: Sequence[Prompt], tokenizer: PreTrainedTokenizerBase, context_length: int
) -> tuple[int, int] | None:
    """(index, token count) of the first prompt whose tokens (as `render_prompts` makes them) leave no room in a
    context of `context_length` tokens for one sampled token; None when every prompt fits. A prompt rendered to
    fewer UTF-8 bytes than the context is not tokenized (a token holds at least one byte; one BOS may be added)."""
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            text, extra = prompt, 1
        else:
            messages = renderable(tokenizer, prompt)
            text, extra = str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)), 0
        if len(text.encode()) + extra < context_length:
            continue
        length = len(render_prompts([prompt], tokenizer)[0])
        if length >= context_length:
            return index, length
    return None
