"""The RolloutEngine interface: prompts in, sampled completions (text + token ids) out.

Every engine returns the same contract, so the trainer cannot tell them apart: for each completion the
prompt token ids it was sampled from and the sampled token ids themselves, cut after the first EOS token or
stop string (both kept). The trainer scores exactly these ids, so the response mask lines up with what was
sampled rather than with a re-tokenization of the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

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

    @property
    def n_generated_tokens(self) -> int:
        return sum(len(ids) for ids in self.completion_ids)


class RolloutEngine(Protocol):
    def generate(self, prompt_ids: list[list[int]], settings: SamplingSettings) -> RolloutBatch:
        """Sample settings.n completions for every prompt."""
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
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            # The template already holds the special tokens; adding BOS again would duplicate it.
            rendered.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return rendered
