"""The scored rollout batch: what the rollout worker hands the learner, and how rows of it become the tensors of a
microbatch.

The rollout worker builds it and the learner trains on it, so it sits below both (grpo_cli/batch/, beside the one
scoring forward that both run over it: forward.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from grpo_cli.core import tokenize_prompt_and_output_ids

T = TypeVar("T")


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
    policy_version: int = 0  # the version of the weights that sampled it (the oldest, for a replay sample)
    # sync=async: per completion (len_i,), the policy version that sampled each token (engines.stream; -1 at an
    # episode's tool/environment tokens); None: every token is `policy_version`'s.
    token_versions: list[list[int]] | None = None
    # (n,) bool: True the completion's reward is in its group's advantage statistics, False it has none (an episode
    # skipped under task.on_reward_error=skip: compute_advantages' keep); None: every one has a reward.
    scored: torch.Tensor | None = None


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
        token_versions=rows_if_any(data.token_versions),
        scored=None if data.scored is None else data.scored[index],
    )


def concat_rollouts(parts: list[RolloutData]) -> RolloutData:
    """One RolloutData of several, in order. A per-completion field present in only some parts is dropped, except
    loss_mask (whose missing rows count), sampler_log_probs (a part without them gets NaN rows, so that the learner
    sees the missing behaviour log-probs instead of training uncorrected: missing_behaviour) and token_versions
    (ValueError: a sample without the versions that sampled it cannot be checked against the bound). Metrics are
    the first part's; the version is the oldest."""

    def joined(name: str) -> list | None:
        values = [getattr(part, name) for part in parts]
        return None if any(v is None for v in values) else [row for v in values for row in v]

    versions = [part.token_versions is not None for part in parts]
    if any(versions) and not all(versions):
        raise ValueError(
            f"{versions.count(False)} of {len(parts)} rollout parts carry no token versions while the others do: "
            "a sample's behaviour policy would be unknown"
        )
    sampler = None
    if any(part.sampler_log_probs is not None for part in parts):
        sampler = [
            row
            for part in parts
            for row in (
                part.sampler_log_probs
                if part.sampler_log_probs is not None
                else [torch.full((len(ids),), math.nan) for ids in part.completion_ids]
            )
        ]

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
        sampler_log_probs=sampler,
        loss_mask=None if all(p.loss_mask is None for p in parts) else torch.cat(masks),
        token_masks=None if all(p.token_masks is None for p in parts) else [m for part in token_masks for m in part],
        transcripts=joined("transcripts"),
        metrics=dict(parts[0].metrics),
        policy_version=min(part.policy_version for part in parts),
        token_versions=joined("token_versions"),
        scored=None
        if all(p.scored is None for p in parts)
        else torch.cat(
            [p.scored if p.scored is not None else torch.ones(len(p.completion_ids), dtype=torch.bool) for p in parts]
        ),
    )


def missing_behaviour(data: RolloutData) -> str | None:
    """What `data` lacks of the behaviour policy's log-probs at the model's sampled tokens, in a few words (None:
    nothing): none at all, or NaN where a turn (episode_batch) or a part of the batch (concat_rollouts) had none."""
    if data.sampler_log_probs is None:
        return "no sampler (behaviour) log-probs"
    for i, row in enumerate(data.sampler_log_probs):
        model = row if data.token_masks is None else row[data.token_masks[i].bool()]
        if bool(torch.isnan(model).any()):
            return f"no sampler (behaviour) log-probs for {int(torch.isnan(model).sum())} tokens of completion {i}"
    return None
