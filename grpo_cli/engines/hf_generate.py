"""The transformers engine's fallback: sampling through `model.generate`, with the decode loop's semantics.

Used where `hf_internals.fast_path_problem` rejects the decode loop (a transformers release it was not tested on,
an architecture, adapter, quantized layer or device it was not checked on). Only public transformers API is used
(`generate`, `LogitsProcessor`, `StoppingCriteria`, `GenerationConfig`), so a transformers upgrade may cost speed
here, never a crash. The samples are the decode loop's, not generate()'s own sampler's:

- one LogitsProcessor (`RowSampler`) sees each step's raw logits, draws every row's token with the project's one
  sampling function (`engines.sampling`: temperature, top-p, min_tokens holding EOS back, row r from its own
  generator seeded by (seed, prompt index, completion index)) and forces it (every other logit -inf), and generate
  runs greedy, so it takes exactly that token;
- EOS ends a row (generate's own check), stop strings that count past min_tokens every STOP_CHECK_EVERY tokens
  (`StopStrings`, `engines.stopping`), and the completion is cut at its first EOS or such stop string afterwards
  (`engines.hf.cut_completion`), as in the loop;
- nothing of the checkpoint's generation_config (repetition_penalty, top_k, ...) applies: generate runs with a
  config holding only the EOS and pad ids.

Each completion is prefilled separately (generate has no prompt sharing), so this path is slower than the loop.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from grpo_cli.engines.base import SamplingSettings
from grpo_cli.engines.decode import STOP_CHECK_EVERY, DecodeTimings, Sampled, left_pad
from grpo_cli.engines.hf_internals import base_model, generate
from grpo_cli.engines.sampling import row_generators, sample_next_tokens, sampler_log_probs, suppress_tokens_
from grpo_cli.engines.stopping import stopped

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class RowSampler(LogitsProcessor):
    """Draws each row's next token with `engines.sampling` and forces it; records the tokens and their log-probs
    under the sampler's softmax(logits / T) (before top-p and min_tokens), one (B,) tensor per step."""

    def __init__(self, settings: SamplingSettings, generators: list[torch.Generator], eos: torch.Tensor) -> None:
        self.settings = settings
        self.generators = generators
        self.eos = eos
        self.tokens: list[torch.Tensor] = []
        self.log_probs: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logits = scores.clone()  # (B, V) the model's raw logits of this step (no other processor runs)
        log_softmax = sampler_log_probs(logits, self.settings.temperature)
        if len(self.tokens) < self.settings.min_tokens:
            suppress_tokens_(logits, self.eos)
        tokens = sample_next_tokens(logits, self.settings.temperature, self.settings.top_p, self.generators)  # (B,)
        self.tokens.append(tokens)
        self.log_probs.append(log_softmax.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
        forced = torch.full_like(scores, float("-inf"))
        # Greedy decoding picks exactly `tokens` (transformers types its tensors with the legacy FloatTensor).
        return cast(torch.FloatTensor, forced.scatter_(-1, tokens.unsqueeze(-1), 0.0))


class StopStrings(StoppingCriteria):
    """Ends rows whose generated text holds a stop string that counts (past min_tokens, `engines.stopping`),
    checked every STOP_CHECK_EVERY tokens as in the loop."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...], prompt_width: int, min_tokens: int = 0
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.prompt_width = prompt_width
        self.min_tokens = min_tokens

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        generated = input_ids[:, self.prompt_width :]  # (B, steps)
        hit = cast(torch.BoolTensor, torch.zeros(len(input_ids), dtype=torch.bool, device=input_ids.device))
        if generated.shape[1] % STOP_CHECK_EVERY:
            return hit
        for row, ids in enumerate(generated.tolist()):
            hit[row] = stopped(self.tokenizer, ids, self.stop, self.min_tokens)
        return hit


@contextmanager
def plain_generation_config(model: torch.nn.Module, eos_ids: list[int], pad_id: int) -> Iterator[GenerationConfig]:
    """The model's generation_config replaced, for one call, by one holding only EOS and pad: generate() fills
    unset fields from the model's own config, which would bring a checkpoint's repetition_penalty or top_k in."""
    base = base_model(model)
    saved = base.generation_config
    plain = GenerationConfig(eos_token_id=eos_ids, pad_token_id=pad_id)
    base.generation_config = plain
    try:
        yield plain
    finally:
        base.generation_config = saved


class GenerateDecoder:
    """The `engines.decode.Decoder` interface (sample, timings) on top of `model.generate`."""

    def __init__(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, eos_ids: set[int]) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = sorted(eos_ids)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.device = next(model.parameters()).device
        self.compile = False
        self.timings = DecodeTimings()

    @torch.no_grad()
    def sample(self, prompt_ids: list[list[int]], settings: SamplingSettings) -> Sampled:
        started = time.perf_counter()
        n = settings.n
        input_ids, mask = left_pad(prompt_ids, self.pad_id)  # (P, W)
        width = input_ids.shape[1]
        input_ids = input_ids.repeat_interleave(n, 0).to(self.device)  # (B, W), prompt-major rows
        mask = mask.repeat_interleave(n, 0).to(self.device)
        generators = []
        if settings.temperature > 0:
            generators = row_generators(
                settings.seed, settings.first_prompt_index, len(prompt_ids), n, self.device, settings.prompt_indices
            )
        eos = torch.tensor(self.eos_ids, dtype=torch.long, device=self.device)
        sampler = RowSampler(settings, generators, eos)
        stop = [StopStrings(self.tokenizer, settings.stop, width, settings.min_tokens)] if settings.stop else []
        criteria = StoppingCriteriaList(stop)
        with plain_generation_config(self.model, self.eos_ids, self.pad_id) as config:
            config.do_sample = False
            config.max_new_tokens = settings.max_tokens
            generate(
                self.model,
                input_ids=input_ids,
                attention_mask=mask,
                generation_config=config,
                logits_processor=LogitsProcessorList([sampler]),
                stopping_criteria=criteria,
            )
        tokens = torch.stack(sampler.tokens, dim=1)  # (B, steps): every row's own draws, also after its end
        log_probs = torch.stack(sampler.log_probs, dim=1)
        self.timings = DecodeTimings(forward_s=time.perf_counter() - started, steps=tokens.shape[1])
        return Sampled(tokens.tolist(), log_probs.tolist())
