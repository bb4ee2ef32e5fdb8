"""Rollouts on the policy model itself (so there are no weights to sync): by the decode loop of `engines.decode`
where `engines.hf_internals` supports the model and the loop's greedy tokens on it equal generate()'s
(`engines.loop_check`, at the engine's first call), else by `model.generate` with the same sampling
(`engines.hf_generate`), said in one log line."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

import grpo_cli.engines.hf_internals as hf_internals
from grpo_cli.engines.base import RolloutBatch, SamplingSettings, context_room
from grpo_cli.engines.decode import Decoder
from grpo_cli.engines.hf_generate import GenerateDecoder
from grpo_cli.engines.loop_check import CHECK_TOKENS, loop_disagreement
from grpo_cli.engines.stopping import decoded, stop_length

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)
_LOGGED: set[str] = set()  # each line once per process (training and evaluation engines share it)


def _log_once(level: int, message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        log.log(level, message)


def fall_back(problem: str) -> None:
    """The one line that says the engine samples through generate(), and why."""
    _log_once(
        logging.WARNING, f"rollout: {problem}; sampling with transformers' generate() instead (same samples, slower)"
    )


def make_decoder(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    eos_ids: set[int],
    compile: str = "auto",
    decoder: str = "auto",
) -> Decoder | GenerateDecoder:
    """The decode loop where it may run `model` here (not yet checked against generate(): the engine does that at
    its first call), else generate() with the loop's sampling (one log line). decoder="generate": generate()."""
    if decoder == "generate":
        _log_once(logging.INFO, "rollout: sampling with transformers' generate() (rollout.decoder=generate)")
        return GenerateDecoder(model, tokenizer, eos_ids)
    device = next(model.parameters()).device
    problem = hf_internals.fast_path_problem(model, device)
    if problem is None:
        return Decoder(model, tokenizer, eos_ids, compile_setting=compile)
    fall_back(problem)
    return GenerateDecoder(model, tokenizer, eos_ids)


def cut_completion(
    ids: list[int], eos_ids: set[int], stop: tuple[str, ...], tokenizer: PreTrainedTokenizerBase, min_tokens: int = 0
) -> tuple[list[int], bool]:
    """Cut sampled ids after the first EOS token or the first completed stop string (both kept); a stop string
    counts only where it ends after the first `min_tokens` ids' text (vLLM's rule, `engines.stopping`).

    Returns (ids, finished); finished is False when neither occurred (the completion was truncated).
    Whatever a row sampled after its end (the batch decodes on until every row has ended) is dropped here.
    """
    for i, token in enumerate(ids):
        if token in eos_ids:
            ids, eos_at = ids[: i + 1], i
            break
    else:
        eos_at = None
    length = stop_length(tokenizer, ids, stop, min_tokens)
    if length is not None:
        return ids[:length], True
    return ids, eos_at is not None


class HFRolloutEngine:
    """Batched sampling on the policy itself with the static-cache loop of `engines.decode` (n completions per
    prompt from one prefill) or its generate() fallback, each completion from its own random stream
    (`engines.sampling`), with the sampler's log-prob of every sampled token."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        max_batch_prompts: int | None = None,
        compile: str = "auto",
        decoder: str = "auto",
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_prompts = max_batch_prompts
        eos = hf_internals.base_model(model).generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = {int(e) for e in eos if e is not None} | {tokenizer.eos_token_id}
        # Sampling reads SamplingSettings alone: nothing of the checkpoint's generation_config (repetition_penalty,
        # top_k, ...) reaches the loop, so completions come from the distribution the trainer scores.
        self.decoder: Decoder | GenerateDecoder = make_decoder(
            model, tokenizer, self.eos_ids, compile=compile, decoder=decoder
        )
        # Why the loop does not sample here, once its check has run (None: it does, or has not been checked yet).
        self.loop_problem: str | None = None
        self._loop_checked = False
        limit = getattr(hf_internals.base_model(model).config, "max_position_embeddings", None)
        self._context_length = limit if isinstance(limit, int) and limit > 0 else None

    @property
    def context_length(self) -> int | None:
        """The model's max_position_embeddings (None when its config has none): no row samples past it."""
        return self._context_length

    def sync_weights(self, version: int | None = None) -> dict[str, float]:
        return {"time/sync_s": 0.0}  # the loop runs on the trained model itself

    def close(self) -> None:
        # Drop the model and its decoder's caches so they can be freed; a closed engine samples no more.
        for name in ("model", "decoder"):
            if hasattr(self, name):
                delattr(self, name)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], settings: SamplingSettings) -> RolloutBatch:
        """settings.n completions per prompt; a prompt the model's context leaves fewer than settings.max_tokens
        tokens after is sampled apart, with what is left (prompts of one length together: positions past the
        context never run), and a prompt that fills the context gets empty completions (both context_limited)."""
        rooms = context_room(prompt_ids, settings.max_tokens, self.context_length)
        if all(room == settings.max_tokens for room in rooms):
            return self._generate_rows(prompt_ids, settings)
        by_room: dict[int, list[int]] = {}
        for index, room in enumerate(rooms):
            by_room.setdefault(room, []).append(index)
        n = settings.n
        parts: dict[int, tuple[RolloutBatch, int, bool]] = {}  # prompt index -> (its batch, its first row, limited)
        for room, indices in by_room.items():
            prompts = [prompt_ids[i] for i in indices]
            if room == 0:  # the prompt fills the context: nothing is sampled
                rows = [p for p in prompts for _ in range(n)]
                part = RolloutBatch(
                    rows, [[] for _ in rows], ["" for _ in rows], [True for _ in rows], [[] for _ in rows]
                )
            else:
                part = self._generate_rows(
                    prompts,
                    replace(
                        settings,
                        max_tokens=room,
                        min_tokens=min(settings.min_tokens, room),
                        prompt_indices=tuple(settings.prompt_index(i) for i in indices),
                    ),
                )
            for k, index in enumerate(indices):
                parts[index] = (part, k * n, room < settings.max_tokens)
        out = RolloutBatch([], [], [], [], sampler_log_probs=[], context_limited=[])
        for index in range(len(prompt_ids)):
            part, first, limited = parts[index]
            for row in range(first, first + n):
                out.prompt_ids.append(part.prompt_ids[row])
                out.completion_ids.append(part.completion_ids[row])
                out.texts.append(part.texts[row])
                out.truncated.append(part.truncated[row])
                out.sampler_log_probs.append(part.sampler_log_probs[row])  # type: ignore[union-attr, index]
                out.context_limited.append(limited and part.truncated[row])
        return out

    def _generate_rows(self, prompt_ids: list[list[int]], settings: SamplingSettings) -> RolloutBatch:
        chunk = self.max_batch_prompts or len(prompt_ids)
        out = RolloutBatch([], [], [], [], sampler_log_probs=[])
        was_training = self.model.training
        self.model.eval()
        try:
            if isinstance(self.decoder, Decoder) and not self._loop_checked and settings.max_tokens >= CHECK_TOKENS:
                self._check_loop(self.decoder, prompt_ids[:chunk])
            for start in range(0, len(prompt_ids), chunk):
                # Each completion's stream depends on its prompt's index in the step, so chunks change nothing.
                part_settings = settings.chunk(start, start + chunk)
                part = self._generate_chunk(prompt_ids[start : start + chunk], part_settings)
                for field in ("prompt_ids", "completion_ids", "texts", "truncated", "sampler_log_probs"):
                    getattr(out, field).extend(getattr(part, field))
        finally:
            self.model.train(was_training)
        return out

    @property
    def decode_loop_checked(self) -> bool:
        return self._loop_checked

    def check_decode_loop(self, prompt_ids: list[list[int]]) -> str | None:
        """Check the decode loop against generate() on these prompts now (once per engine; the asynchronous
        generator's stream runs the loop's model calls without `generate`); returns why it does not run here, or
        None."""
        if isinstance(self.decoder, Decoder) and not self._loop_checked:
            self._check_loop(self.decoder, prompt_ids)
        return self.loop_problem

    def _check_loop(self, decoder: Decoder, prompt_ids: list[list[int]]) -> None:
        """Keep the decode loop only if it agrees with generate() on this model, these prompts, in this context."""
        self._loop_checked = True
        problem = loop_disagreement(decoder, self.model, prompt_ids)
        if problem is None:
            version = hf_internals.transformers_version()
            _log_once(
                logging.INFO,
                f"rollout: sampling with the decode loop (its first {CHECK_TOKENS} greedy tokens on this model "
                f"equal generate()'s under transformers {version})",
            )
            return
        self.loop_problem = f"{problem} under transformers {hf_internals.transformers_version()}"
        fall_back(self.loop_problem)
        self.decoder = GenerateDecoder(self.model, self.tokenizer, self.eos_ids)

    def _generate_chunk(self, prompt_ids: list[list[int]], settings: SamplingSettings) -> RolloutBatch:
        sampled = self.decoder.sample(prompt_ids, settings)
        kept_log_probs: list[list[float]] = []
        batch = RolloutBatch([], [], [], [], sampler_log_probs=kept_log_probs)
        for row, (ids, log_probs) in enumerate(zip(sampled.token_ids, sampled.log_probs, strict=True)):
            ids, finished = cut_completion(ids, self.eos_ids, settings.stop, self.tokenizer, settings.min_tokens)
            batch.prompt_ids.append(prompt_ids[row // settings.n])
            batch.completion_ids.append(ids)
            kept_log_probs.append(log_probs[: len(ids)])
            batch.texts.append(decoded(self.tokenizer, ids, skip_special_tokens=True))
            batch.truncated.append(not finished)
        return batch
