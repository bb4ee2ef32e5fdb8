"""The accounting of an update (learner.Learner.update): each optimizer step's totals, the divisors of every
microbatch's share of its loss; the tokens the masked importance correction rejects before the step; what the
forward passes processed (perf/*); and the train step's diagnostics, gathered per microbatch and reduced to the
step's metrics over microbatches, optimizer steps and ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from grpo_cli.batch.plan import loss_tokens
from grpo_cli.batch.rollout_data import RolloutData
from grpo_cli.core import LossSettings, compute_importance_weights
from grpo_cli.distributed import parallel

# The train step's diagnostics logged as train/<name> (means over microbatches and steps; *_max the largest).
# train/kl is apart: the mean over every response in the loss (`kl_over_responses`).
LOGGED_STEP_METRICS = (
    "clip_fraction",
    "clip_fraction_low",
    "clip_fraction_high",
    "clip_fraction_dual",
    "ratio_mean",
    "sampler_kl",
    "importance_weight_mean",
    "importance_weight_max",
    "importance_truncated_frac",
    "importance_masked_frac",
    "behaviour_capped_frac",
)


def rejected_token_counts(data: RolloutData, loss: LossSettings) -> list[int] | None:
    """Per completion, how many of its tokens `loss.importance_correction == "masked"` rejects, where that is known
    before the step: the batch has old log-probs (the learner's side of the ratio). None otherwise: without them
    the learner's side is the current policy, known only in each microbatch's forward, after the step's totals."""
    if loss.importance_correction != "masked" or data.old_log_probs is None or data.sampler_log_probs is None:
        return None
    counts = []
    for i, (old, sampler) in enumerate(zip(data.old_log_probs, data.sampler_log_probs, strict=True)):
        # float32, as make_microbatch hands them to the train step, which decides on the same numbers
        old_row, sampler_row = old.float().unsqueeze(0), sampler.float().unsqueeze(0)
        # An episode's tool/environment tokens are not the sampler's: never rejected, never counted.
        sampled = data.token_masks[i].bool().unsqueeze(0) if data.token_masks is not None else None
        _, importance = compute_importance_weights(
            old_row,
            sampler_row,
            sampled if sampled is not None else torch.ones_like(old_row, dtype=torch.bool),
            "masked",
            loss.importance_level,
            loss.importance_threshold,
            loss.importance_threshold_low,
        )
        counts.append(int(importance["masked"].sum()))
    return counts


def optimizer_step_totals(
    data: RolloutData, batch_indices: list[int], rejected: list[int] | None = None
) -> tuple[float, float]:
    """The optimizer step's responses and loss tokens, the divisors of each microbatch's share of the step's loss
    (core.aggregate_token_loss): summed over all ranks and divided by their number, because DDP / FSDP average
    the ranks' gradients; so R ranks with microbatches of any sizes give the gradient of one process with the
    whole batch. `batch_indices`: this rank's completions in the step. Tokens of a completion left out of the
    loss (train.mask_truncated) do not count, nor do the tokens `rejected` counts per completion (importance
    correction "masked", rejected_token_counts), nor an episode's tool/environment tokens (model tokens only);
    the completion itself does (as in sequence_mean's batch mean)."""
    tokens = loss_tokens(data, batch_indices, rejected)
    sequences, tokens = parallel.sum_over_ranks([float(len(batch_indices)), tokens])
    ranks = parallel.world().size
    # A step whose every token is left out still needs a positive divisor (its loss is 0 anyway).
    return sequences / ranks, max(tokens, 1.0) / ranks


# The empty-step rule (docs/algorithm.md#a-step-with-nothing-to-train; decided by batch.plan.UpdatePlan.settle,
# one sum over the ranks, so every rank skips the step or none does): an optimizer step whose rows hold no token in
# the loss (every episode skipped under task.on_reward_error=skip, every completion left out by
# train.mask_truncated, every token rejected by the masked correction, or no row at all) takes no optimizer step: no
# forward, no backward, no AdamW update, so the parameters, the moments and AdamW's step count stay as they were
# (AdamW on a zero gradient would still move every parameter through its momentum and weight decay). Logged as
# train/empty_steps; train.max_empty_steps such updates in a row stop the run.
EMPTY_STEPS = "train/empty_steps"
# The same rule for a step whose tokens in the loss all have loss weight 0 (flat groups) and no KL term: its
# gradient is exactly 0. Logged as train/flat_steps; not counted by train.max_empty_steps (a solved or a too-hard
# batch says nothing is broken; docs/algorithm.md#a-step-with-nothing-to-train says why).
FLAT_STEPS = "train/flat_steps"


def update_was_empty(metrics: dict[str, float]) -> bool:
    """Whether an update's every optimizer step had nothing to train (the steps train.max_empty_steps counts)."""
    return int(metrics.get(EMPTY_STEPS, 0)) > 0 and not metrics.get("train/optimizer_steps", 0)


def empty_step_note(step: int, metrics: dict[str, float]) -> str | None:
    """The console's line for a step whose update had an optimizer step with nothing to train, or one whose every
    row's loss weight was 0 (a flat step), else None."""
    empty, flat = int(metrics.get(EMPTY_STEPS, 0)), int(metrics.get(FLAT_STEPS, 0))
    if not empty and not flat:
        return None
    taken = int(metrics.get("train/optimizer_steps", 0)) + int(metrics.get("train/nonfinite_skipped", 0))
    steps = empty + flat + taken

    def which(count: int) -> str:
        return "its update" if count == steps else f"{count} of its {steps} optimizer steps"

    why, keys = [], []
    if empty:
        why.append(
            f"nothing to train in {which(empty)} (no token in the loss: every episode skipped under "
            "task.on_reward_error=skip, or left out of the loss)"
        )
        keys.append(EMPTY_STEPS)
    if flat:
        why.append(
            f"every row's loss weight is 0 in {which(flat)} (flat groups: each prompt's completions got one reward, "
            "so no gradient)"
        )
        keys.append(FLAT_STEPS)
    return (
        f"step {step}: {'; '.join(why)}: no optimizer step, the weights and the optimizer's state unchanged "
        f"({', '.join(keys)})"
    )


# Per microbatch: its KL summed over its responses in the loss, and their number (update() pops both).
_KL_SUM, _KL_RESPONSES = "kl_sum", "kl_responses"
# Per microbatch: its token entropy summed over the model's tokens, and their number (update() pops both).
_ENTROPY_SUM, _ENTROPY_TOKENS = "entropy_sum", "entropy_tokens"


@dataclass
class PaddingTotals:
    """What the update's forward passes processed on this rank (perf/* metrics): positions (padding included) and
    the real tokens among them, microbatches (dummies left out) and the largest, each optimizer step's positions
    per rank's imbalance, and the time spent waiting for the other ranks."""

    positions: int = 0
    real: int = 0
    microbatches: int = 0
    largest: int = 0
    imbalances: list[float] = field(default_factory=list)
    idle_s: float = 0.0

    def metrics(self) -> dict[str, float]:
        """perf/*: the padding fraction and the mean microbatch of every rank's microbatches together; the largest
        microbatch, this rank's idle time (combined over ranks by parallel.reduce_metrics). Every rank calls it."""
        positions, real, microbatches = parallel.sum_over_ranks(
            [float(self.positions), float(self.real), float(self.microbatches)]
        )
        return {
            "perf/padding_frac": 1.0 - real / positions if positions else 0.0,
            "perf/microbatch_tokens_mean": positions / microbatches if microbatches else 0.0,
            "perf/microbatch_tokens_max": float(self.largest),
            "perf/rank_token_imbalance": sum(self.imbalances) / len(self.imbalances) if self.imbalances else 1.0,
            "perf/rank_idle_s": self.idle_s,
            "perf/rank_idle_s_max": self.idle_s,
        }


def kl_over_responses(kl_sum: float, responses: float) -> float | None:
    """train/kl: the mean, over every response in the loss on every rank, of its token-mean KL to the reference.
    Summed before dividing, so microbatches and ranks holding different numbers of responses in the loss
    (train.mask_truncated) weigh by them; None when no response is in the loss. Every rank calls it."""
    kl_sum, responses = parallel.sum_over_ranks([kl_sum, responses])
    return kl_sum / responses if responses > 0 else None


def record_value(totals: dict[str, list[float]], key: str, value: float | torch.Tensor) -> None:
    """One more value of metric `key` (one per microbatch or optimizer step; step_means reduces them)."""
    totals.setdefault(key, []).append(float(value))


def record_microbatch(
    totals: dict[str, list[float]],
    meta: dict[str, torch.Tensor],
    token_entropy: torch.Tensor,
    mask: torch.Tensor,
    loss_mask: torch.Tensor,
) -> None:
    """One microbatch's train-step diagnostics `meta` and entropy sums into `totals`: `mask` the model's own
    tokens (entropy), `loss_mask` those in the loss (the responses the KL is averaged over)."""
    record_value(totals, _ENTROPY_SUM, float((token_entropy.detach() * mask).sum()))
    record_value(totals, _ENTROPY_TOKENS, float(mask.sum()))
    for key in LOGGED_STEP_METRICS:
        if key in meta and bool(torch.isfinite(meta[key])):  # nan: every completion here was left out
            record_value(totals, f"train/{key}", meta[key])
    if "kl" in meta:  # meta's kl: the mean over this microbatch's responses in the loss (nan: none)
        responses = float((loss_mask.sum(dim=-1) > 0).sum())
        record_value(totals, _KL_SUM, float(meta["kl"]) * responses if responses else 0.0)
        record_value(totals, _KL_RESPONSES, responses)


def step_means(totals: dict[str, list[float]]) -> dict[str, float]:
    """The update's metrics from what its microbatches and steps recorded in `totals` (popping the entropy and KL
    sums): means over the optimizer steps (and microbatches) of every rank, except maxima, which stay maxima;
    train/entropy and train/kl over every token / response on every rank. Every rank calls it (collective) and gets
    the same keys and values: a rank whose rows were all skipped (loss weight 0: batch/plan.py) ran only dummy
    microbatches and recorded no train-step diagnostics, so the ranks' own keys can differ."""
    keys = sorted({key for rank in parallel.all_gather_objects(sorted(totals)) for key in rank})
    metrics: dict[str, float] = {}
    entropy_sum, entropy_tokens = parallel.sum_over_ranks(
        [sum(totals.pop(_ENTROPY_SUM, [])), sum(totals.pop(_ENTROPY_TOKENS, []))]
    )
    if entropy_tokens:  # the mean over every token of the model's in the update, on every rank
        metrics["train/entropy"] = entropy_sum / entropy_tokens
    if _KL_RESPONSES in keys:  # the reference is measured (on every rank alike: the sums are collective)
        kl = kl_over_responses(sum(totals.pop(_KL_SUM, [])), sum(totals.pop(_KL_RESPONSES, [])))
        if kl is not None:
            metrics["train/kl"] = kl
    names = [key for key in keys if key not in (_ENTROPY_SUM, _ENTROPY_TOKENS, _KL_SUM, _KL_RESPONSES)]
    sums = parallel.sum_over_ranks(
        [sum(totals.get(key, [])) for key in names] + [float(len(totals.get(key, []))) for key in names]
    )
    largest = parallel.all_gather_objects([max(totals.get(key, []), default=-math.inf) for key in names])
    for i, key in enumerate(names):
        count = sums[len(names) + i]
        if count:  # a key some rank recorded
            metrics[key] = max(rank[i] for rank in largest) if key.endswith("_max") else sums[i] / count
    return metrics
