"""One plan per update: every layout decision of `Learner.update` (and of its old and reference passes), made once,
before any forward, from the batch's token counts and loss weights.

For each optimizer step (epochs x train batches, the shuffle included): this rank's microbatches (row indices;
the fixed layout or the token-budget one, packed rows, ranks balanced by tokens, dummies from `equalize`), the
positions each forward processes (perf/*), and, once the old log-probs are known (`UpdatePlan.settle`: the masked
correction's rejected tokens need them), the step's divisors and whether it trains at all. Plus the microbatches of
the old/proximal and reference passes: which rows each must score.

Rows whose loss weight is exactly 0 (`train.skip_zero_weight_rows`): the weight is the tensor the loss multiplies
every token's term by (core.losses.policy_gradient_loss: the advantage, or the raw reward for a loss that reads
raw rewards, "no_baseline"). Without a KL term nothing else in the loss touches the row, so its gradient is exactly
0: it is neither forwarded nor back-propagated, but it still counts in every divisor (the step's sequences and
tokens), so the update is the same (docs/algorithm.md#rows-whose-loss-weight-is-zero).

The collectives of the plan are here: one gather of every rank's microbatch counts at construction (fixed-layout
ranks each hold their own rows, whose computed rows differ) and one sum of every step's totals in `settle`. The
Learner walks the plan and computes no layout of its own.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch

from grpo_cli.batch.forward import ScoringSettings, shares_in_forward, tokens_through_model
from grpo_cli.batch.microbatches import (
    StepLayout,
    TokenCounts,
    equalize,
    fixed_microbatches,
    positions_processed,
    rank_shares,
    token_microbatches,
)
from grpo_cli.batch.rollout_data import RolloutData, model_tokens
from grpo_cli.config import BatchShape
from grpo_cli.config.schemas import GRPOConfig
from grpo_cli.core.loss_settings import LossSettings
from grpo_cli.core.losses import loss_spec
from grpo_cli.core.packing import assign_rows, packed_positions
from grpo_cli.core.prompt_tree import segment_lengths
from grpo_cli.distributed import parallel

log = logging.getLogger(__name__)
_LAYOUTS_LOGGED: set[bool] = set()  # train.microbatch_tokens: each layout choice once per process


@dataclass(frozen=True)
class PlanSettings:
    """What the plan reads besides the batch, fixed for a learner (Learner.__init__ builds it once)."""

    epochs: int  # passes over each rollout batch
    step_rows: int  # rows of `data` per optimizer step (this rank's, or the whole step's with balance_ranks)
    shuffle: bool  # several optimizer steps per rollout batch: the rows are shuffled each epoch
    seed: int
    microbatch_size: int
    microbatch_tokens: int | None
    share_prompts: bool
    pack_sequences: bool
    # The shared-prompt forward runs as a prompt tree (core/prompt_tree.py: no completion padding).
    prompt_tree: bool
    # train.microbatch_tokens under data parallelism: every rank holds the whole batch and each step's rows are
    # spread over the ranks by tokens; otherwise each rank holds its own rows.
    balance_ranks: bool
    fsdp: bool  # every forward is a collective, the no-grad passes' too
    # Rows of zero loss weight are not computed: train.skip_zero_weight_rows, and no KL term in the loss.
    skip_zero_weight: bool
    # The loss's weight: "raw_rewards" (no_baseline) or "advantages" (every baselined loss).
    weight: str
    # Whether a step whose every loss weight is 0 is a step with nothing to train (no KL term: its gradient is 0).
    flat_steps_train_nothing: bool
    old_pass_every_row: bool  # importance_correction=masked: every row's old log-probs (rejected_token_counts)
    reference_pass_every_row: bool  # kl.monitor: every row's reference log-probs
    # The packed row width of some sequence lengths (core.packing.packed_row_tokens of the model).
    packed_row_width: Callable[[list[int]], int | None] = field(default=lambda lengths: None, compare=False)


def loss_weight_name(loss_type: str) -> str:
    """The tensor loss `loss_type` weighs each row's token terms by, as core.losses.policy_gradient_loss picks it."""
    return "raw_rewards" if "raw_rewards" in loss_spec(loss_type).needs else "advantages"


def zero_weight_rows(data: RolloutData, weight: str) -> list[bool]:
    """Per row: its loss weight is exactly 0 (as float32, the dtype make_microbatch hands the loss)."""
    values: torch.Tensor = data.raw_rewards if weight == "raw_rewards" else data.advantages
    return (values.float() == 0).tolist()


@dataclass
class Microbatch:
    """One forward and backward: its rows (empty: a dummy, one row's forward with its loss x 0, so every rank makes
    as many collective calls), the positions it processes (padding included), the real tokens among them, and the
    tokens through the model (a shared prompt once: throughput/train_tokens)."""

    rows: list[int]
    positions: int = 0
    real: int = 0
    tokens: int = 0


@dataclass
class OptimizerStep:
    """One optimizer step on this rank: `rows` every row of the step that counts in its divisors (this rank's, or
    the whole step's with balance_ranks), `microbatches` the forwards that compute its gradient; after
    UpdatePlan.settle, the divisors (`sequences`, `tokens`: the step's totals over every rank / ranks) and whether
    it trains (`empty`: no token in the loss; `flat`: tokens in the loss, every weight 0)."""

    rows: list[int]
    microbatches: list[Microbatch]
    imbalance: float = 1.0  # the largest rank's positions over the mean (1 outside data parallelism)
    sequences: float = 0.0
    tokens: float = 1.0
    empty: bool = False
    flat: bool = False

    @property
    def trains(self) -> bool:
        return not (self.empty or self.flat)

    @property
    def computed_rows(self) -> list[int]:
        return [row for mb in self.microbatches for row in mb.rows]


@dataclass
class UpdatePlan:
    """Every optimizer step of one update, and the microbatches the old and reference passes score (this rank's;
    rows left out of them get no value: NaN)."""

    steps: list[OptimizerStep]
    old_microbatches: list[list[int]]
    reference_microbatches: list[list[int]]
    rows: int  # rows of the update's steps (all epochs), this rank's part of them
    skipped_rows: int  # of those, not computed because their loss weight is 0
    whole_steps: bool = False  # balance_ranks: every rank holds every step's rows (totals need no collective)
    weight: str = "advantages"  # the loss's weight (PlanSettings.weight)
    flat_rule: bool = True  # a step whose every weight is 0 trains nothing (PlanSettings.flat_steps_train_nothing)
    settled: bool = False

    def settle(self, data: RolloutData, rejected: list[int] | None) -> None:
        """The steps' divisors and empty/flat flags, from the tokens in the loss (`rejected`: the masked
        correction's, rejected_token_counts) summed over the ranks in one collective (skipped with balance_ranks,
        where every rank holds every step's rows). Every rank calls it."""
        zero = zero_weight_rows(data, self.weight)
        local = []
        for step in self.steps:
            tokens = loss_tokens(data, step.rows, rejected)
            weighted = loss_tokens(data, [r for r in step.rows if not zero[r]], rejected)
            local += [float(len(step.rows)), tokens, weighted]
        whole = self.whole_steps
        totals = local if whole else parallel.sum_over_ranks(local)
        ranks = parallel.world().size
        for i, step in enumerate(self.steps):
            sequences, tokens, weighted = totals[3 * i : 3 * i + 3]
            # The divisors: the step's totals over every rank (with balance_ranks every rank holds the whole step:
            # its own totals), over the number of ranks (DDP / FSDP average the ranks' gradients).
            step.sequences, step.tokens = sequences / ranks, max(tokens, 1.0) / ranks
            step.empty = tokens <= 0
            step.flat = self.flat_rule and not step.empty and weighted <= 0
        self.settled = True

    def perf(self) -> dict[str, float]:
        """perf/zero_weight_skipped_frac: the share of the update's rows (all epochs, every rank) not computed
        because their loss weight is 0. Every rank calls it (one sum over the ranks)."""
        rows, skipped = float(self.rows), float(self.skipped_rows)
        if not self.whole_steps:
            rows, skipped = parallel.sum_over_ranks([rows, skipped])
        return {"perf/zero_weight_skipped_frac": skipped / rows if rows else 0.0}


def loss_tokens(data: RolloutData, rows: list[int], rejected: list[int] | None) -> float:
    """The tokens in the loss among `rows`: the model's own tokens, less those the masked correction rejects
    (`rejected`), of the completions not left out (train.mask_truncated's loss_mask)."""
    keep = data.loss_mask.tolist() if data.loss_mask is not None else None
    return float(
        sum((model_tokens(data, i) - (rejected[i] if rejected else 0)) * (keep[i] if keep else 1.0) for i in rows)
    )


def log_layout_choice(layout: StepLayout) -> None:
    """train.microbatch_tokens with the shared-prompt forward: which layout a step took and the positions each
    would process, once per choice and process."""
    if layout.positions_by_groups is None or layout.keeps_groups in _LAYOUTS_LOGGED:
        return
    _LAYOUTS_LOGGED.add(layout.keeps_groups)
    kept = "keeping each prompt's completions together" if layout.keeps_groups else "sorting completions by length"
    log.info(
        "train.microbatch_tokens: %s (positions processed per step: %d with groups kept together, %d sorted by "
        "length; the shared-prompt forward runs a prompt once per microbatch that holds several of its completions)",
        kept,
        layout.positions_by_groups,
        layout.positions_by_rows,
    )


class _Layout:
    """The layout functions of one batch under `settings` (token counts read once)."""

    def __init__(self, data: RolloutData, settings: PlanSettings) -> None:
        self.data, self.settings = data, settings
        self.counts = TokenCounts.of(data.prompt_ids, data.completion_ids)
        self.world = parallel.world()

    def per_rank(self, rows: list[int]) -> list[list[list[int]]]:
        """train.microbatch_tokens: `rows` cut into token-budget microbatches; with balance_ranks first spread over
        the ranks by tokens (whole groups where the one-process layout keeps them together), one list per rank."""
        s = self.settings
        budget = s.microbatch_tokens
        assert budget is not None
        whole = token_microbatches(self.counts, rows, budget, s.share_prompts, packed=s.pack_sequences)
        log_layout_choice(whole)
        if not s.balance_ranks:
            return [whole.microbatches]
        shares = rank_shares(self.counts, rows, self.world.size, whole.keeps_groups, s.share_prompts)
        return [
            token_microbatches(
                self.counts, mine, budget, s.share_prompts, whole.keeps_groups, s.pack_sequences
            ).microbatches
            for mine in shares
        ]

    def microbatches(self, rows: list[int]) -> list[list[list[int]]]:
        """`rows` (to compute) as microbatches, per rank with balance_ranks (else one list: this rank's)."""
        if self.settings.microbatch_tokens is None:
            return [fixed_microbatches(rows, self.settings.microbatch_size)]
        return self.per_rank(rows)

    def positions(self, rows: list[int]) -> tuple[int, int]:
        """(positions processed, real tokens among them) of the training forward over the microbatch `rows`, in the
        layout it takes: a prompt tree (core.prompt_tree: each group's segment, packed into rows as wide as the
        widest), packed rows (train.pack_sequences, where packing beats the shared prompt: the rows
        core.packing.assign_rows builds, as wide as the widest) or padded (microbatches.positions_processed)."""
        s = self.settings
        share = s.share_prompts
        if s.prompt_tree and shares_in_forward(self.data, rows, share, s.pack_sequences, prompt_tree=True):
            groups: dict[Hashable, list[int]] = {}
            for i in rows:
                groups.setdefault(self.counts.prompt_keys[i], []).append(i)
            segments = segment_lengths(
                [self.counts.prompt_lengths[g[0]] for g in groups.values()],
                [[self.counts.completion_lengths[i] for i in g] for g in groups.values()],
            )
            tree_rows, width = packed_positions(segments, s.packed_row_width(segments))
            return tree_rows * width, sum(segments)
        if s.pack_sequences and not shares_in_forward(self.data, rows, share, True):
            lengths = [self.counts.row_tokens(i) for i in rows]
            packed = assign_rows(lengths, self.settings.packed_row_width(lengths))
            width = max((sum(lengths[j] for j in row) for row in packed), default=0)
            return len(packed) * width, sum(lengths)
        return positions_processed(self.counts, rows, share)

    def microbatch(self, rows: list[int]) -> Microbatch:
        if not rows:
            return Microbatch([])
        positions, real = self.positions(rows)
        s = self.settings
        return Microbatch(
            rows,
            positions,
            real,
            tokens_through_model(self.data, rows, s.share_prompts, s.pack_sequences, s.prompt_tree),
        )


def build_update_plan(data: RolloutData, settings: PlanSettings, step: int, scores_old: bool) -> UpdatePlan:
    """The plan of one update of `data` at `step` (the shuffle's seed). `scores_old`: the old/proximal pass runs
    (the old log-probs are needed and not given). Every rank calls it (one gather when ranks hold their own rows)."""
    s = settings
    layout = _Layout(data, s)
    n = len(data.completion_ids)
    has_tokens = [bool(c) for c in data.completion_ids]
    zero = zero_weight_rows(data, s.weight) if s.skip_zero_weight else [False] * n
    # What a step computes: rows with a completion token (a row without one never reached the model: no score, no
    # loss, no entropy) whose loss weight is not 0 (when skipping).
    computed = [has_tokens[i] and not zero[i] for i in range(n)]

    rng = random.Random(s.seed * 7919 + step)
    steps: list[OptimizerStep] = []
    rows_total = skipped = 0
    for _epoch in range(s.epochs):
        order = list(range(n))
        if s.shuffle:
            rng.shuffle(order)  # whole groups need not stay together: advantages are already computed
        for start in range(0, n, s.step_rows):
            rows = order[start : start + s.step_rows]
            per_rank = layout.microbatches([r for r in rows if computed[r]])
            mine = per_rank[layout.world.rank] if s.balance_ranks else per_rank[0]
            steps.append(OptimizerStep(rows, [layout.microbatch(mb) for mb in mine]))
            rows_total += len(rows)
            skipped += sum(has_tokens[r] and zero[r] for r in rows)
            if s.balance_ranks:  # every rank's layout is known here: pad to the most any rank has
                most = max(len(mbs) for mbs in per_rank)
                steps[-1].microbatches += [Microbatch([]) for _ in range(most - len(mine))]
                positions = [sum(layout.positions(mb)[0] for mb in mbs) for mbs in per_rank]
                steps[-1].imbalance = max(positions) * len(positions) / max(sum(positions), 1)

    # The passes score the rows some step computes, or every row where a later computation needs them all.
    needed = [i for i in range(n) if not (has_tokens[i] and zero[i])]
    every = list(range(n))
    old_rows = (every if s.old_pass_every_row else needed) if scores_old else []
    reference_rows = every if s.reference_pass_every_row else needed
    plan = UpdatePlan(
        steps,
        _pass_microbatches(layout, old_rows),
        _pass_microbatches(layout, reference_rows),
        rows_total,
        skipped,
        whole_steps=s.balance_ranks,
        weight=s.weight,
        flat_rule=s.flat_steps_train_nothing,
    )
    if layout.world.distributed and not s.balance_ranks:
        _match_ranks(plan, s.fsdp)
    return plan


def _pass_microbatches(layout: _Layout, rows: list[int]) -> list[list[int]]:
    """This rank's microbatches of a no-grad pass over `rows`: the whole batch's layout, or with balance_ranks its
    share's, as many on every rank under FSDP (each call is a collective)."""
    if not rows:
        return []
    if layout.settings.microbatch_tokens is None:
        return fixed_microbatches(rows, layout.settings.microbatch_size)
    if not layout.settings.balance_ranks:
        return layout.per_rank(rows)[0]
    per_rank = layout.per_rank(rows)
    return (equalize(per_rank) if layout.settings.fsdp else per_rank)[layout.world.rank]


def _match_ranks(plan: UpdatePlan, fsdp: bool) -> None:
    """Ranks that hold their own rows compute different numbers of them: one gather of every rank's microbatch
    counts and positions per step (and per pass), then every rank pads with dummies to the most any rank has, so
    all make the same collective calls (DDP's gradient reduction, FSDP's gathers)."""
    mine = (
        [(len(step.microbatches), sum(mb.positions for mb in step.microbatches)) for step in plan.steps],
        len(plan.old_microbatches),
        len(plan.reference_microbatches),
    )
    every = parallel.all_gather_objects(mine)
    for i, step in enumerate(plan.steps):
        counts = [rank[0][i][0] for rank in every]
        positions = [rank[0][i][1] for rank in every]
        step.microbatches += [Microbatch([]) for _ in range(max(counts) - len(step.microbatches))]
        step.imbalance = max(positions) * len(positions) / max(sum(positions), 1)
    if fsdp:  # the no-grad passes' forwards are collectives under FSDP only
        plan.old_microbatches += [[] for _ in range(max(rank[1] for rank in every) - len(plan.old_microbatches))]
        plan.reference_microbatches += [
            [] for _ in range(max(rank[2] for rank in every) - len(plan.reference_microbatches))
        ]


def plan_settings(
    cfg: GRPOConfig,
    shape: BatchShape,
    loss: LossSettings,
    scoring: ScoringSettings,
    balance_ranks: bool,
    fsdp: bool,
    packed_row_width: Callable[[list[int]], int | None],
) -> PlanSettings:
    """The learner's plan settings from its config, batch shape, loss and scoring settings (read at each update:
    tests and benchmarks replace the shape or the loss of a built learner)."""
    # Any KL term (at some step of the run) puts every row in the loss: nothing is skipped, no step is flat.
    no_other_term = not loss.kl_penalty
    return PlanSettings(
        epochs=shape.epochs_per_rollout_batch,
        # this rank's share of each train batch (the whole batch in one process), or with ranks balanced by tokens
        # the whole step's, which every rank holds and splits the same way
        step_rows=shape.train_batch_size if balance_ranks else shape.train_batch_per_rank,
        shuffle=shape.optimizer_steps_per_rollout_batch > 1,
        seed=cfg.seed,
        microbatch_size=shape.microbatch_size,
        microbatch_tokens=shape.microbatch_tokens,
        share_prompts=scoring.share_prompts,
        pack_sequences=scoring.pack_sequences,
        prompt_tree=scoring.prompt_tree,
        balance_ranks=balance_ranks,
        fsdp=fsdp,
        skip_zero_weight=cfg.train.skip_zero_weight_rows and no_other_term,
        weight=loss_weight_name(loss.loss_type),
        flat_steps_train_nothing=no_other_term,
        old_pass_every_row=loss.importance_correction == "masked",
        reference_pass_every_row=cfg.kl.monitor,
        packed_row_width=packed_row_width,
    )


def every_row_microbatches(data: RolloutData, settings: PlanSettings) -> list[list[int]]:
    """This rank's microbatches of a no-grad pass over every row of `data` (outside an update's plan: a caller that
    wants every completion's log-probs)."""
    return _pass_microbatches(_Layout(data, settings), list(range(len(data.completion_ids))))
