"""The scored rollout batch: what the rollout worker hands the learner, and how it is cut into microbatches.

Both sides use it (the worker also computes behaviour log-probs for the Ray strategies), so it sits below both.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from grpo_cli.core import response_log_probs, tokenize_prompt_and_output_ids
from grpo_cli.core.packing import packing_beats_sharing, packing_problem
from grpo_cli.core.prompt_sharing import prompt_sharing_problem
from grpo_cli.learner.microbatches import TokenCounts, fixed_microbatches, token_microbatches

log = logging.getLogger(__name__)
_REFUSALS_LOGGED: set[str] = set()  # each reason once per process
T = TypeVar("T")


@dataclass(frozen=True)
class ScoringSettings:
    """How completions are scored (their response tokens' log-probs under a policy), the same for every pass
    that scores them: the learner's training forward, its old and reference passes, and the generator's
    behaviour log-probs. Built once from the config (grpo_cli.learner.settings.scoring_settings)."""

    # Tokens were sampled from softmax(logits / T): ratios, KL and entropy must be of that distribution.
    temperature: float
    # Run each distinct prompt of a microbatch once and share its keys/values among its completions
    # (train.share_prompt_forward, where the model and the distributed strategy allow it).
    share_prompts: bool
    # Response tokens per LM-head chunk (train.logits_chunk_tokens; 0: unchunked).
    logits_chunk_tokens: int
    # Completions per forward pass of the no-grad passes (the training microbatch).
    microbatch_size: int
    pad_token_id: int
    # Positions per forward pass of the no-grad passes instead (train.microbatch_tokens; None: microbatch_size rows).
    microbatch_tokens: int | None = None
    # Run a microbatch's sequences packed into a few rows, without padding (train.pack_sequences, where the
    # model's probe passed: packs_sequences).
    pack_sequences: bool = False


@dataclass
class RolloutData:
    """One scored rollout batch, per completion, ready to be cut into microbatches."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    raw_rewards: torch.Tensor  # (n,)
    advantages: torch.Tensor  # (n,)
    old_log_probs: list[torch.Tensor] | None = None  # per completion, (len_i,)
    ref_log_probs: list[torch.Tensor] | None = None
    # The rollout engine's own log-probs of the sampled tokens (softmax(logits / T) over the full vocabulary), per
    # completion (len_i,): the sampler side of the importance correction; None when the engine gives none.
    sampler_log_probs: list[torch.Tensor] | None = None
    # (n,) 1.0: the completion counts in the loss, 0.0: left out (train.mask_truncated, a skipped episode); None:
    # all count.
    loss_mask: torch.Tensor | None = None
    # Multi-turn episodes: per completion (len_i,), 1.0 at the model's sampled tokens, 0.0 at the tool/environment
    # tokens between its turns (the holes: scored as context, never in the loss or its token totals); None: every
    # completion token is the model's (single-turn). The log-prob fields above cover every completion token.
    token_masks: list[torch.Tensor] | None = None
    # Multi-turn episodes: one transcript per episode (rollout.episode_rollout.transcript), for the run's logs.
    transcripts: list[dict[str, Any]] | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # rollout statistics and the producer's timings
    policy_version: int = 0
    # (n,) bool: True the completion's reward is in its group's advantage statistics, False it has none (an episode
    # skipped under task.on_reward_error=skip: compute_advantages' keep); None: every one has a reward.
    scored: torch.Tensor | None = None  # the version of the weights that sampled it (the oldest, for a replay sample)


def make_microbatch(
    data: RolloutData, indices: list[int], pad_token_id: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """The rows `indices` of `data` as right-padded tensors on `device`: input_ids, labels, response_mask (B, T),
    old/reference/sampler log-probs (B, T) when the batch has them, raw_rewards and advantages (B, 1), loss_mask
    (B, 1) when some completions are left out of the loss, and token_mask (B, T) for multi-turn episodes (1.0 at
    model tokens, 0.0 at tool/environment tokens and off the response). response_mask stays every completion
    token (what is scored: the shared-prompt forward reads each row's prompt and completion from it); the loss
    and its totals take `model_token_mask`."""
    batch = tokenize_prompt_and_output_ids(
        [data.prompt_ids[i] for i in indices], [data.completion_ids[i] for i in indices], pad_token_id
    )
    batch = {k: v.to(device) for k, v in batch.items()}
    mask = batch["response_mask"].bool()
    for name in ("old_log_probs", "ref_log_probs", "sampler_log_probs"):
        per_sample = getattr(data, name)
        if per_sample is not None:
            # Row-major order of mask positions == per-completion order of the stored token log-probs.
            full = torch.zeros(mask.shape, dtype=torch.float32, device=device)
            full[mask] = torch.cat([per_sample[i] for i in indices]).to(device)
            batch[name] = full
    if data.token_masks is not None:
        holes = torch.zeros(mask.shape, dtype=torch.float32, device=device)
        holes[mask] = torch.cat([data.token_masks[i] for i in indices]).to(device=device, dtype=torch.float32)
        batch["token_mask"] = holes
    batch["raw_rewards"] = data.raw_rewards[indices].unsqueeze(1).to(device)  # (B, 1)
    batch["advantages"] = data.advantages[indices].unsqueeze(1).to(device)  # (B, 1)
    if data.loss_mask is not None:
        batch["loss_mask"] = data.loss_mask[indices].unsqueeze(1).to(device)  # (B, 1)
    return batch


def model_token_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """make_microbatch's (B, T) mask of the tokens the model sampled: response_mask, with the holes of multi-turn
    episodes (tool/environment tokens) zeroed. The loss, its normalizers, entropy and the old-policy KL read it."""
    mask = batch["response_mask"]
    return mask * batch["token_mask"].to(mask.dtype) if "token_mask" in batch else mask


def model_tokens(data: RolloutData, index: int) -> int:
    """The tokens of completion `index` the model sampled (all of them, but an episode's tool/environment ones)."""
    if data.token_masks is None:
        return len(data.completion_ids[index])
    return int(data.token_masks[index].sum())


def shares_prompts(model: torch.nn.Module, wanted: bool) -> bool:
    """Whether the learner's forward passes (training, old and reference log-probs, and their token counts)
    share prompts: `train.share_prompt_forward` asked for it and the shared forward can score `model` exactly
    (core.prompt_sharing.prompt_sharing_problem); a model it cannot gets the plain forward, said in one log line."""
    if not wanted:
        return False
    problem = prompt_sharing_problem(model)
    if problem is None:
        return True
    _say_refusal_once(
        problem,
        "train: no shared-prompt forward for this model (%s); every completion runs with its own copy of its "
        "prompt (train.share_prompt_forward: same log-probs, more compute)",
    )
    return False


def _say_refusal_once(problem: str, message: str) -> None:
    """One warning line per refusal reason and process (`message` %-formatted with `problem`)."""
    if problem not in _REFUSALS_LOGGED:
        _REFUSALS_LOGGED.add(problem)
        log.warning(message, problem)


def packs_sequences(
    model: torch.nn.Module, wanted: bool, temperature: float = 1.0, logits_chunk_tokens: int = 0
) -> bool:
    """Whether the forward passes run packed rows: `train.pack_sequences` asked for it and the probe
    (core.packing.packing_problem: packed against separate log-probs, through response_log_probs as scored here)
    passed on `model`; a model it fails keeps the padded layout, said in one log line."""
    if not wanted:
        return False

    def score(input_ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, packed: bool) -> torch.Tensor:
        return response_log_probs(
            model,
            input_ids,
            labels,
            mask,
            temperature=temperature,
            logits_chunk_tokens=logits_chunk_tokens,
            pack_sequences=packed,
        )["log_probs"][mask]

    problem = packing_problem(model, score)
    if problem is None:
        return True
    _say_refusal_once(
        problem,
        "train: no packed rows for this model (%s); its microbatches stay padded (train.pack_sequences: same "
        "log-probs, more compute)",
    )
    return False


def shares_in_forward(data: RolloutData, indices: list[int], share_prompts: bool, pack_sequences: bool) -> bool:
    """Whether the forward over the microbatch `indices` takes the shared-prompt layout, as response_log_probs
    decides: some prompt repeats, and packing (when on) would not process fewer positions
    (core.packing.packing_beats_sharing)."""
    if not share_prompts:
        return False
    distinct = {tuple(data.prompt_ids[i]) for i in indices}
    packs = pack_sequences and packing_beats_sharing(
        [len(data.prompt_ids[i]) for i in indices],
        [len(data.completion_ids[i]) for i in indices],
        [len(p) for p in distinct],
    )
    return len(distinct) < len(indices) and not packs


def tokens_through_model(
    data: RolloutData, indices: list[int], share_prompts: bool, pack_sequences: bool = False
) -> int:
    """Tokens one forward pass over the microbatch `indices` processes (without padding): a shared prompt once,
    unless packing processes fewer positions (shares_in_forward)."""
    completions = sum(len(data.completion_ids[i]) for i in indices)
    if shares_in_forward(data, indices, share_prompts, pack_sequences):
        return completions + sum(len(p) for p in {tuple(data.prompt_ids[i]) for i in indices})
    return completions + sum(len(data.prompt_ids[i]) for i in indices)


def scoring_microbatches(data: RolloutData, scoring: ScoringSettings) -> list[list[int]]:
    """The microbatches (row indices) the no-grad passes score `data` in: runs of scoring.microbatch_size rows, or
    with scoring.microbatch_tokens token-budget microbatches (learner.microbatches.token_microbatches)."""
    rows = list(range(len(data.completion_ids)))
    if scoring.microbatch_tokens is None:
        return fixed_microbatches(rows, scoring.microbatch_size)
    counts = TokenCounts.of(data.prompt_ids, data.completion_ids)
    return token_microbatches(
        counts, rows, scoring.microbatch_tokens, scoring.share_prompts, packed=scoring.pack_sequences
    ).microbatches


def per_completion_log_probs(
    model: torch.nn.Module, data: RolloutData, device: torch.device, scoring: ScoringSettings
) -> list[torch.Tensor]:
    """Response-token log-probs of every completion under `model` (old or reference policy), no grad, scored as
    `scoring` says (at the sampling temperature, in scoring_microbatches)."""
    rows = log_probs_of_rows(model, data, device, scoring, scoring_microbatches(data, scoring))
    return [rows[i] for i in range(len(data.completion_ids))]


@torch.inference_mode()
def log_probs_of_rows(
    model: torch.nn.Module,
    data: RolloutData,
    device: torch.device,
    scoring: ScoringSettings,
    microbatches: list[list[int]],
) -> dict[int, torch.Tensor]:
    """per_completion_log_probs of the rows of `microbatches` only (an empty one runs a dummy row), by row.
    Eval mode for the pass: these are fixed targets, not samples of dropout noise."""

    def score(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return score_microbatch(model, batch, scoring, return_token_entropy=False)["log_probs"]

    return per_completion_rows(score, model, data, microbatches, scoring.pad_token_id, device)


def score_microbatch(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    scoring: ScoringSettings,
    return_token_entropy: bool = True,
) -> dict[str, torch.Tensor]:
    """make_microbatch's `batch` scored under `model` as `scoring` says: response-token "log_probs" (B, T) (and
    "token_entropy" (B, T)). The one call every scoring pass makes, with or without grad."""
    return response_log_probs(
        model,
        batch["input_ids"],
        batch["labels"],
        batch["response_mask"].bool(),
        return_token_entropy=return_token_entropy,
        temperature=scoring.temperature,
        share_prompts=scoring.share_prompts,
        logits_chunk_tokens=scoring.logits_chunk_tokens,
        pack_sequences=scoring.pack_sequences,
    )


def shortest_row(data: RolloutData) -> int:
    """The completion whose forward is cheapest: what a dummy microbatch runs."""
    return min(range(len(data.completion_ids)), key=lambda i: len(data.prompt_ids[i]) + len(data.completion_ids[i]))


def per_completion_rows(
    score: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    model: torch.nn.Module,
    data: RolloutData,
    microbatches: list[list[int]],
    pad_token_id: int,
    device: torch.device,
) -> dict[int, torch.Tensor]:
    """`score`'s (B, T) values of each microbatch of `data` (make_microbatch's tensors of each list of row indices
    of `microbatches`), cut back into one (len_i,) tensor of response tokens per completion, on the CPU, by row. An
    empty microbatch runs `score` on one dummy row and keeps nothing (under FSDP every rank makes as many calls).
    `model`, the module `score` runs, is in eval mode meanwhile. The caller picks the grad mode (no_grad, or
    inference_mode where nothing reuses the module's tensors in autograd later)."""
    result: dict[int, torch.Tensor] = {}
    was_training = model.training
    model.eval()
    try:
        for indices in microbatches:
            batch = make_microbatch(data, indices or [shortest_row(data)], pad_token_id, device)
            mask = batch["response_mask"].bool()
            values = score(batch)
            for row, values_row, row_mask in zip(indices, values, mask, strict=False):
                result[row] = values_row[row_mask].cpu()
    finally:
        model.train(was_training)
    return result


def select_completions(data: RolloutData, indices: list[int]) -> RolloutData:
    """The completions `indices` of `data` (every per-completion field; metrics and version kept)."""

    def rows(values: list[T]) -> list[T]:
        return [values[i] for i in indices]

    def rows_if_any(values: list[T] | None) -> list[T] | None:
        return None if values is None else rows(values)

    index = torch.tensor(indices, dtype=torch.long)
    return RolloutData(
        prompt_ids=rows(data.prompt_ids),
        completion_ids=rows(data.completion_ids),
        raw_rewards=data.raw_rewards[index],
        advantages=data.advantages[index],
        old_log_probs=rows_if_any(data.old_log_probs),
        ref_log_probs=rows_if_any(data.ref_log_probs),
        sampler_log_probs=rows_if_any(data.sampler_log_probs),
        loss_mask=None if data.loss_mask is None else data.loss_mask[index],
        token_masks=rows_if_any(data.token_masks),
        transcripts=rows_if_any(data.transcripts),
        metrics=dict(data.metrics),
        policy_version=data.policy_version,
        scored=None if data.scored is None else data.scored[index],
    )


def concat_rollouts(parts: list[RolloutData]) -> RolloutData:
    """One RolloutData of several, in order (a per-completion field present in only some parts is dropped, except
    loss_mask, whose missing rows count). Metrics are the first part's; the version is the oldest."""

    def joined(name: str) -> list | None:
        values = [getattr(part, name) for part in parts]
        return None if any(v is None for v in values) else [row for v in values for row in v]

    masks = [p.loss_mask if p.loss_mask is not None else torch.ones(len(p.completion_ids)) for p in parts]
    # A part without token masks is single-turn: every completion token is the model's.
    token_masks = [
        p.token_masks if p.token_masks is not None else [torch.ones(len(ids)) for ids in p.completion_ids]
        for p in parts
    ]
    return RolloutData(
        prompt_ids=[row for part in parts for row in part.prompt_ids],
        completion_ids=[row for part in parts for row in part.completion_ids],
        raw_rewards=torch.cat([part.raw_rewards for part in parts]),
        advantages=torch.cat([part.advantages for part in parts]),
        old_log_probs=joined("old_log_probs"),
        ref_log_probs=joined("ref_log_probs"),
        sampler_log_probs=joined("sampler_log_probs"),
        loss_mask=None if all(p.loss_mask is None for p in parts) else torch.cat(masks),
        token_masks=None if all(p.token_masks is None for p in parts) else [m for part in token_masks for m in part],
        transcripts=joined("transcripts"),
        metrics=dict(parts[0].metrics),
        policy_version=min(part.policy_version for part in parts),
        scored=None
        if all(p.scored is None for p in parts)
        else torch.cat(
            [p.scored if p.scored is not None else torch.ones(len(p.completion_ids), dtype=torch.bool) for p in parts]
        ),
    )
