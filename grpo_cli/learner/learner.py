"""Phase 2 of a GRPO step: learn from one scored rollout batch.

    (old log-probs, if needed and not given) -> reference log-probs -> epochs x train batches x microbatches
    of updates

The learner owns the trained policy, the optimizer, the KL reference and the checkpoints of all three (with the
RNG states). In-process for on_policy and multi_epoch; a Ray actor for one_behind and replay_buffer.

What it leaves out on purpose: no value model (the group mean is the baseline), no per-token rewards (one
scalar per completion, broadcast over its tokens), and no re-tokenization of sampled text (it scores the exact
token ids the rollout engine sampled, so the response mask cannot drift from what was generated).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from grpo_cli.config import BatchShape, needs_old_log_probs
from grpo_cli.config.schemas import GRPOConfig
from grpo_cli.core import (
    RATIO_LOSS_TYPES,
    LossSettings,
    masked_mean,
    microbatch_train_step,
)
from grpo_cli.core.packing import assign_rows, packed_row_tokens
from grpo_cli.distributed import parallel
from grpo_cli.errors import UserFacingError
from grpo_cli.learner.checkpoint import (
    CheckpointError,
    State,
    init_from_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_weights,
    save_checkpoint,
    verify_checkpoint,
)
from grpo_cli.learner.settings import loss_settings
from grpo_cli.learner.update import (
    EMPTY_STEPS,
    PaddingTotals,
    nothing_to_train,
    optimizer_step_totals,
    record_microbatch,
    record_value,
    rejected_token_counts,
    step_means,
)
from grpo_cli.models import build_policy
from grpo_cli.models.runtime import (
    autocast_factory,
    compute_dtype,
    limit_threads,
    resolve_device,
    seed_everything,
    timed,
)
from grpo_cli.scoring.batch import (
    RolloutData,
    concat_rollouts,
    make_microbatch,
    missing_behaviour,
    model_token_mask,
)
from grpo_cli.scoring.forward import (
    ScoringSettings,
    dummy_microbatch,
    log_probs_of_rows,
    per_completion_rows,
    score_microbatch,
    scoring_microbatches,
    shares_in_forward,
    tokens_through_model,
)
from grpo_cli.scoring.microbatches import (
    StepLayout,
    TokenCounts,
    equalize,
    fixed_microbatches,
    positions_processed,
    rank_shares,
    token_microbatches,
)
from grpo_cli.scoring.settings import scoring_settings

log = logging.getLogger(__name__)
_LAYOUTS_LOGGED: set[bool] = set()  # train.microbatch_tokens: each layout choice once per process

if TYPE_CHECKING:  # the types the wrapped modules are at run time (casts only: no import of peft here)
    from peft import PeftModel
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel


class PolicyScorer(torch.nn.Module):
    """The training forward (response log-probs and entropies of a microbatch) as a module of its own, so the
    DDP / FSDP2 wrapper around it sees the exact computation training runs: one forward per microbatch, scored
    as `scoring` says (the settings every scoring pass shares)."""

    def __init__(self, policy: torch.nn.Module, scoring: ScoringSettings) -> None:
        super().__init__()
        self.policy = policy
        self.scoring = scoring

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        response_mask: torch.Tensor,
        return_token_entropy: bool = True,
    ) -> dict[str, torch.Tensor]:
        batch = {"input_ids": input_ids, "labels": labels, "response_mask": response_mask}
        return score_microbatch(self.policy, batch, self.scoring, return_token_entropy)


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


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference


class Learner:
    """Phase 2 of a step: learn from one scored rollout batch. (Old log-probs if needed and not given,)
    reference log-probs, then epochs x train batches x microbatches of updates. Owns the trained policy, the
    optimizer, the KL reference, and the checkpoints (weights, optimizer, RNG states).

    In-process for on_policy and multi_epoch; a Ray actor for one_behind and replay_buffer.
    """

    def __init__(self, cfg: GRPOConfig, output_dir: Path, threads: int = 0) -> None:
        limit_threads(threads)
        self.cfg = cfg
        self.output_dir = Path(output_dir)
        self.shape = BatchShape.from_config(cfg)
        seed_everything(cfg.seed)
        self.device = resolve_device(cfg.model.device)
        timings: dict[str, float] = {}
        with timed(timings, "load_s"):
            self.model, self.tokenizer = build_policy(cfg.model, self.device)
            if cfg.init_from:  # a branched run: another run's weights, before any copy is made
                load_weights(init_from_checkpoint(cfg.init_from), self.model)
        self.load_s = timings["load_s"]
        self.autocast = autocast_factory(self.device, cfg.model.mixed_precision)
        # The loss's settings, read once: every microbatch's train step gets this object.
        self.loss = loss_settings(cfg)
        self.needs_reference = self.loss.kl_penalty or cfg.kl.monitor
        # With LoRA the reference is the base model with adapters switched off: no second copy in memory.
        lora = cfg.model.lora.enabled
        self.reference = frozen_copy(self.model) if self.needs_reference and not lora else None
        self.world = parallel.world()
        self.strategy = cfg.distributed.strategy if self.world.distributed else "none"
        # train.microbatch_tokens under data parallelism: the ranks' rows are exchanged after generation and each
        # step's rows spread over the ranks by tokens (every rank then holds the whole batch).
        self.balance_ranks = self.strategy != "none" and cfg.train.microbatch_tokens is not None
        self.scoring_idle_s = 0.0  # this step's wait for the other ranks in the old/reference passes
        # What samples: the policy itself, except under FSDP2, whose sharded parameters every forward must gather
        # collectively (ranks stop generating at different tokens): there a full copy, refreshed after every update
        # and after a resume. It does not compute the old log-probs (the sharded training forward does).
        self.inference_model = frozen_copy(self.model) if self.strategy == "fsdp" else self.model
        # The training forward as a module, wrapped by DDP / FSDP2 when data-parallel (their hooks must see it).
        forward_dtype = compute_dtype(self.device, cfg.model.mixed_precision)
        self.pad_token_id = self.tokenizer.pad_token_id
        # How completions are scored, read once: the training forward, the old and reference passes (and, as a
        # Ray actor, the generator's behaviour log-probs) all get this object.
        self.scoring = scoring_settings(cfg, self.model, self.pad_token_id, sharded=self.strategy == "fsdp")
        self.scorer = parallel.wrap_for_training(
            PolicyScorer(self.model, self.scoring), self.strategy, self.device, forward_dtype
        )
        # Under FSDP2 the old and reference log-probs run sharded modules too, with the training forward's
        # mixed-precision policy (log_probs_under): the reference copy is sharded like the policy, which also
        # keeps a second full copy off every rank. DDP has nothing to synchronize in a frozen copy.
        self.reference_scorer = None
        if self.reference is not None and self.strategy == "fsdp":
            self.reference_scorer = parallel.wrap_for_training(
                PolicyScorer(self.reference, self.scoring).eval(), "fsdp", self.device, forward_dtype
            )
        self.trainable_parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.trainable_parameters,
            lr=cfg.optim.lr,
            weight_decay=cfg.optim.weight_decay,
            betas=(cfg.optim.betas[0], cfg.optim.betas[1]),  # two numbers (validate_config)
            # One fused kernel over all parameters instead of a loop of per-tensor ops: 0.08 s instead of
            # 0.41 s per step for SmolLM2-135M on this CPU (same update rule).
            fused=self.device.type in ("cpu", "cuda"),
        )
        self.needs_old_log_probs = needs_old_log_probs(cfg)
        self.nonfinite_streak = 0
        self.version = 0  # optimizer passes over rollout batches so far: the step of the weights

    @property
    def share_prompts(self) -> bool:
        """Whether this learner's forward passes share prompts (scoring_settings decides)."""
        return self.scoring.share_prompts

    def describe(self) -> str:
        return f"{self.device} ({next(self.model.parameters()).dtype})"

    # --- checkpoints ----------------------------------------------------------------------------------------
    def resume(self) -> tuple[int, State, list[str]]:
        """Load the newest usable checkpoint of the run directory: (its step, trainer state, messages)."""
        messages = []
        for path in reversed(list_checkpoints(self.output_dir)):
            problem = verify_checkpoint(path)
            if problem is None:
                try:
                    checkpoint = load_checkpoint(path, self.model, self.optimizer)
                except CheckpointError:
                    raise
                except Exception as error:  # noqa: BLE001 - a damaged file: fall back to the previous one
                    problem = f"it cannot be read ({type(error).__name__}: {str(error)[:120]})"
            if problem is not None:
                messages.append(f"skipping checkpoint {path}: {problem}; trying the previous one")
                continue
            # FSDP2: the checkpoint went into the shards; the copy every rank samples from must follow.
            self.refresh_inference_copy()
            self.nonfinite_streak = int(checkpoint.state.get("nonfinite_streak", 0))
            self.version = checkpoint.step
            messages.append(f"resumed {self.output_dir} from {path.name} (step {checkpoint.step})")
            return checkpoint.step, checkpoint.state, messages
        raise CheckpointError(
            f"no usable checkpoint in {self.output_dir / 'checkpoints'}: start a new run without resume=..."
        )

    def save_checkpoint(self, step: int, state: State) -> Path:
        state = {**state, "nonfinite_streak": self.nonfinite_streak}
        return save_checkpoint(
            self.output_dir, step, self.model, self.optimizer, state, keep=self.cfg.train.keep_checkpoints
        )

    @torch.no_grad()
    def refresh_inference_copy(self) -> None:
        """FSDP2: gather the trained shards into the full copy that samples, after an update and after a resume (a
        collective: every rank calls it). Frozen weights (LoRA's base) never change after the copy is made."""
        if self.inference_model is self.model:
            return
        copies = dict(self.inference_model.named_parameters())
        for name, parameter in self.model.named_parameters():
            if parameter.requires_grad:
                copies[name].copy_(parallel.full_tensor(parameter.detach()))

    def trainable_weights(self) -> dict[str, torch.Tensor]:
        """CPU copies of the trained weights (only the adapters with LoRA), for the generator's copy."""
        return {name: p.detach().to("cpu", copy=True) for name, p in self.model.named_parameters() if p.requires_grad}

    @contextmanager
    def reference_policy(self) -> Iterator[tuple[torch.nn.Module, torch.nn.Module | None]]:
        """The frozen initial policy: a copy, or with LoRA the same model with its adapters switched off. Yields
        (the model, its sharded scorer under FSDP2 or None)."""
        if self.reference is not None:
            yield self.reference, self.reference_scorer
        else:
            with cast("PeftModel", self.model).disable_adapter():  # LoRA: build_policy's peft model
                yield self.model, self.scorer if self.strategy == "fsdp" else None

    # --- learning -----------------------------------------------------------------------------------------
    def learn(self, data: RolloutData, step: int) -> tuple[dict[str, float], int]:
        """Old and reference log-probs, then the updates. Returns (metrics, consecutive non-finite updates)."""
        if self.cfg.sync.simulated_update_s is not None:  # a benchmark arm: no update, its time slept instead
            time.sleep(self.cfg.sync.simulated_update_s)
            self.version = step
            slept = {"time/training_s": self.cfg.sync.simulated_update_s, "perf/rank_idle_s": 0.0}
            zero = {"time/old_log_probs_s": 0.0, "time/ref_log_probs_s": 0.0, "perf/rank_idle_s_max": 0.0}
            return {**slept, **zero, "train/lr": self.optimizer.param_groups[0]["lr"]}, 0
        self.model.train()
        correction = self.cfg.rollout.importance_correction
        missing = missing_behaviour(data)
        if missing is not None and (correction != "none" or self.loss.decoupled):
            # Never train uncorrected without a word: the correction (or decoupled PPO's pi_prox / pi_behav) needs
            # every sampled token's behaviour log-prob.
            needs = "sync=async" if correction == "none" else f"rollout.importance_correction={correction}"
            fix = "use an engine that gives them" if correction == "none" else "use rollout.importance_correction=none"
            raise UserFacingError(
                f"{needs} needs the sampler's log-probs of every sampled token, but rollout={self.cfg.rollout.engine} "
                f"gave {missing}: {fix}"
            )
        if missing is not None and data.sampler_log_probs is not None:
            data.sampler_log_probs = None  # only measured (train/sampler_kl), and not for every token: measure none
        # Old log-probs once per rollout batch, reused by every epoch; a disaggregated generator sends the
        # behaviour policy's own, computed with the weights that sampled (the learner's may have moved on).
        timings = {"time/old_log_probs_s": 0.0, "time/ref_log_probs_s": 0.0}
        self.scoring_idle_s = 0.0
        if self.balance_ranks:
            # Every rank's rows, in rank order: the one-process batch, whose steps every rank then splits by tokens.
            # (The caller's `data` keeps this rank's own rows for its step metrics.)
            data = concat_rollouts(parallel.all_gather_objects(data))
        # Both in the training forward's numerics (the policy itself, or under FSDP2 its sharded scorer with the
        # mixed-precision policy, never the sampling copy): on the batch's own weights the ratio is 1.
        if self.needs_old_log_probs and data.old_log_probs is None:
            with timed(timings, "time/old_log_probs_s"):
                fsdp_scorer = self.scorer if self.strategy == "fsdp" else None
                data.old_log_probs = self.log_probs_under(self.model, data, fsdp_scorer)
        if self.needs_reference:
            with timed(timings, "time/ref_log_probs_s"), self.reference_policy() as (reference, fsdp_scorer):
                data.ref_log_probs = self.log_probs_under(reference, data, fsdp_scorer)
        with timed(timings, "time/training_s"):
            metrics = self.update(data, step)
            self.refresh_inference_copy()
        metrics["perf/rank_idle_s"] += self.scoring_idle_s
        metrics["perf/rank_idle_s_max"] += self.scoring_idle_s
        self.version = step
        metrics.update({"train/lr": self.optimizer.param_groups[0]["lr"], **timings})
        return metrics, self.nonfinite_streak

    def log_probs_under(
        self, model: torch.nn.Module, data: RolloutData, fsdp_scorer: torch.nn.Module | None = None
    ) -> list[torch.Tensor]:
        """Each completion's response-token log-probs under `model` (old or reference policy), no grad, at the
        sampling temperature; under FSDP2 through `fsdp_scorer`, `model`'s sharded PolicyScorer. With ranks
        balanced by tokens each rank scores its share and the ranks exchange the results."""
        microbatches = self._scoring_microbatches(data)
        if fsdp_scorer is not None:
            rows = self._sharded_log_probs(fsdp_scorer, data, microbatches)
        else:
            with self.autocast():
                rows = log_probs_of_rows(model, data, self.device, self.scoring, microbatches)
        if self.balance_ranks:
            self.scoring_idle_s += parallel.wait_for_ranks()
            for other in parallel.all_gather_objects(rows):
                rows.update(other)
        return [rows[i] for i in range(len(data.completion_ids))]

    def _positions(self, data: RolloutData, counts: TokenCounts, indices: list[int]) -> tuple[int, int]:
        """(positions processed, real tokens among them) of the training forward over the microbatch `indices`,
        in the layout it takes: packed rows (train.pack_sequences, where packing beats the shared prompt: the rows
        core.packing.assign_rows builds, as wide as the widest) or padded (microbatches.positions_processed)."""
        share = self.scoring.share_prompts
        if self.scoring.pack_sequences and not shares_in_forward(data, indices, share, True):
            lengths = [counts.row_tokens(i) for i in indices]
            rows = assign_rows(lengths, packed_row_tokens(self.model, lengths))
            width = max((sum(lengths[j] for j in row) for row in rows), default=0)
            return len(rows) * width, sum(lengths)
        return positions_processed(counts, indices, share)

    def _scoring_microbatches(self, data: RolloutData) -> list[list[int]]:
        """This rank's microbatches of the old/reference passes: the whole batch's (scoring_microbatches), or with
        ranks balanced by tokens its share's, as many on every rank under FSDP (each call is a collective)."""
        if not self.balance_ranks:
            return scoring_microbatches(data, self.scoring)
        counts = TokenCounts.of(data.prompt_ids, data.completion_ids)
        per_rank = self._per_rank_microbatches(counts, list(range(len(data.completion_ids))))
        return (equalize(per_rank) if self.strategy == "fsdp" else per_rank)[self.world.rank]

    def _per_rank_microbatches(self, counts: TokenCounts, rows: list[int]) -> list[list[list[int]]]:
        """train.microbatch_tokens: `rows` spread over the ranks by tokens (whole groups where the one-process
        layout keeps them together), then each rank's share cut into its token-budget microbatches."""
        budget, share = cast(int, self.shape.microbatch_tokens), self.scoring.share_prompts
        whole = token_microbatches(counts, rows, budget, share, packed=self.scoring.pack_sequences)
        log_layout_choice(whole)
        if not self.balance_ranks:
            return [whole.microbatches]
        shares = rank_shares(counts, rows, self.world.size, whole.keeps_groups, share)
        packed = self.scoring.pack_sequences
        keep = whole.keeps_groups
        return [token_microbatches(counts, mine, budget, share, keep, packed).microbatches for mine in shares]

    def _sharded_log_probs(
        self, scorer: torch.nn.Module, data: RolloutData, microbatches: list[list[int]]
    ) -> dict[int, torch.Tensor]:
        """log_probs_under through an FSDP2 module: its bf16 parameters under model.mixed_precision=bf16, as in
        training (the fp32 sampling copy under autocast gave on-policy ratios of 0.90 to 1.15). Each microbatch is
        a collective: every rank makes as many calls (equal shares, or `microbatches` equalized)."""

        def score(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return scorer(batch["input_ids"], batch["labels"], batch["response_mask"], return_token_entropy=False)[
                "log_probs"
            ]

        # no_grad, not inference_mode: FSDP2 reuses the tensors it gathers parameters into, and training's next
        # gather into an inference tensor fails ("Inplace update to inference tensor outside InferenceMode").
        with torch.no_grad(), self.autocast():
            rows = per_completion_rows(score, scorer, data, microbatches, self.scoring.pad_token_id, self.device)
        # A forward without a backward leaves FSDP2's iteration half done: the root's parameters stay gathered
        # (a backward would need them) and its post-forward trackers grow until a backward clears them, which a
        # frozen reference never runs. End the iteration: no gathered root outlives an optimizer step, no list
        # grows for the run (no gradients are in flight here: the passes run before the step's updates).
        cast("FSDPModule", scorer).reset_iter_state()
        return rows

    def update(self, data: RolloutData, step: int) -> dict[str, float]:
        """epochs x train batches of optimizer steps over `data`; the metrics are means over the steps."""
        cfg, shape = self.cfg, self.shape
        n = len(data.completion_ids)
        rng = random.Random(cfg.seed * 7919 + step)
        totals: dict[str, list[float]] = {}
        timings = {"time/optimizer_s": 0.0}  # gradient clipping + the optimizer's step
        skipped = 0  # updates skipped for non-finite loss or gradients
        empty = 0  # optimizer steps with nothing to train (update.nothing_to_train): not taken
        computed_tokens = 0
        rejected = rejected_token_counts(data, self.loss)  # once: every epoch reuses the old log-probs
        step_loss = self.loss.at_step(step)  # this step's KL coefficient (kl.beta_schedule)
        counts = TokenCounts.of(data.prompt_ids, data.completion_ids)
        perf = PaddingTotals()
        response_tokens = 0
        # Rows per optimizer step in `data`: this rank's share of each train batch (the whole batch in one process),
        # or with ranks balanced by tokens the whole step's, which every rank holds and splits the same way.
        step_rows = shape.train_batch_size if self.balance_ranks else shape.train_batch_per_rank
        with timed(timings, "time/update_s"):
            for _epoch in range(shape.epochs_per_rollout_batch):
                order = list(range(n))
                if shape.optimizer_steps_per_rollout_batch > 1:
                    rng.shuffle(order)  # whole groups need not stay together: advantages are already computed
                for batch_start in range(0, n, step_rows):
                    rows = order[batch_start : batch_start + step_rows]
                    if nothing_to_train(data, rows, rejected):  # the empty-step rule: no optimizer step at all
                        empty += 1
                        continue
                    mine, microbatches = self._step_microbatches(counts, rows)
                    # A row without a completion token (a skipped episode that never reached the model) has no
                    # score, loss or entropy: it is not forwarded (a microbatch left without rows is a dummy).
                    microbatches = self._without_empty_rows(data, microbatches)
                    computed_tokens += sum(
                        tokens_through_model(data, indices, self.scoring.share_prompts, self.scoring.pack_sequences)
                        for indices in microbatches
                    )
                    response_tokens += sum(counts.completion_lengths[i] for i in mine)
                    finite = self._optimizer_step(
                        data, mine, microbatches, step_loss, totals, timings, rejected, counts, perf
                    )
                    skipped += not finite
        metrics = step_means(totals)
        if self.loss.kl_penalty:
            metrics["train/kl_beta"] = step_loss.kl_beta
        metrics["train/optimizer_steps"] = len(totals.get("train/loss", [])) - skipped
        metrics["train/nonfinite_skipped"] = skipped
        metrics[EMPTY_STEPS] = empty
        metrics["time/optimizer_s"] = timings["time/optimizer_s"]
        metrics["time/forward_backward_s"] = timings["time/update_s"] - timings["time/optimizer_s"]
        # Tokens the model actually ran forward+backward on (all epochs; a shared prompt counts once per
        # microbatch) and response tokens scored, for throughput and FLOP accounting (job=benchmark).
        metrics["throughput/train_tokens"] = computed_tokens
        metrics["throughput/response_tokens"] = response_tokens
        metrics.update(perf.metrics())
        return metrics

    def _without_empty_rows(self, data: RolloutData, microbatches: list[list[int]]) -> list[list[int]]:
        """`microbatches` without the rows that have no completion token; one left empty stays as a dummy under
        data parallelism (every rank makes as many collective calls) and goes in one process."""
        kept = [[i for i in indices if data.completion_ids[i]] for indices in microbatches]
        return kept if self.world.distributed else [indices for indices in kept if indices]

    def _step_microbatches(self, counts: TokenCounts, rows: list[int]) -> tuple[list[int], list[list[int]]]:
        """One optimizer step's `rows`: (this rank's rows, its microbatches). Fixed runs of microbatch_size rows, or
        train.microbatch_tokens' token-budget microbatches; with ranks balanced by tokens this rank's share of the
        whole step's rows, its microbatches padded with empty ones (dummies) to the most any rank has."""
        if self.shape.microbatch_tokens is None:
            return rows, fixed_microbatches(rows, self.shape.microbatch_size)
        per_rank = equalize(self._per_rank_microbatches(counts, rows))
        mine = per_rank[self.world.rank] if self.balance_ranks else per_rank[0]
        return [row for indices in mine for row in indices], mine

    def _optimizer_step(
        self,
        data: RolloutData,
        batch_indices: list[int],
        microbatches: list[list[int]],
        step_loss: LossSettings,
        totals: dict[str, list[float]],
        timings: dict[str, float],
        rejected: list[int] | None = None,
        counts: TokenCounts | None = None,
        perf: PaddingTotals | None = None,
    ) -> bool:
        """Gradient accumulation over the microbatches of one train batch, then one clipped optimizer step, with
        `step_loss`, the loss's settings at this step (LossSettings.at_step: its scheduled KL coefficient).
        Returns False when the loss or the gradients were not finite (the step is skipped and counted).
        `rejected`: per completion, the tokens the masked importance correction rejects (rejected_token_counts),
        which leave the step's token total. `batch_indices`: this rank's rows of the step, in `microbatches` (lists
        of row indices; an empty one is a dummy: one row's forward and backward with its loss x 0, so every rank makes
        as many collective calls). `perf` gathers the positions processed (perf/* metrics)."""
        cfg, shape = self.cfg, self.shape
        counts = counts or TokenCounts.of(data.prompt_ids, data.completion_ids)
        perf = perf or PaddingTotals()

        def record(key: str, value: float | torch.Tensor) -> None:
            record_value(totals, key, value)

        self.optimizer.zero_grad(set_to_none=True)
        batch_loss = 0.0
        step_sequences, step_tokens = optimizer_step_totals(data, batch_indices, rejected)
        step_positions = 0
        for position, indices in enumerate(microbatches):
            dummy = not indices
            mb = (
                make_microbatch(data, indices, self.pad_token_id, self.device)
                if indices
                else dummy_microbatch(data, self.pad_token_id, self.device)
            )
            if not dummy:
                processed, real = self._positions(data, counts, indices)
                step_positions += processed
                perf.positions, perf.real, perf.microbatches = (
                    perf.positions + processed,
                    perf.real + real,
                    perf.microbatches + 1,
                )
                perf.largest = max(perf.largest, processed)
            scored_mask = mb["response_mask"]  # every completion token goes through the forward (as context)
            mask = model_token_mask(mb)  # the model's own tokens: an episode's tool/environment tokens are holes
            # DDP averages gradients across ranks once, after the last microbatch (the sums in between are local).
            last = position == len(microbatches) - 1
            no_sync = (
                cast("DistributedDataParallel", self.scorer).no_sync
                if self.strategy == "ddp" and not last
                else contextlib.nullcontext
            )
            with no_sync():  # forward and backward (grpo_microbatch_train_step runs it)
                with self.autocast():
                    scored = self.scorer(mb["input_ids"], mb["labels"], scored_mask)
                if last and self.world.distributed:
                    # The gradients' reduction (DDP: in the last backward) waits for the slowest rank: time the
                    # wait here, at a barrier before it (perf/rank_idle_s).
                    perf.idle_s += parallel.wait_for_ranks()
                policy_log_probs = scored["log_probs"]
                if dummy:  # this rank has no rows left: the same collective calls, no contribution
                    (policy_log_probs.sum() * 0.0).backward()
                    continue
                old = mb.get("old_log_probs")
                if old is not None:
                    # k1 estimate of KL(old || current) on the old policy's samples: how off-policy this is.
                    record("train/old_policy_kl", masked_mean(old - policy_log_probs.detach(), mask))
                if old is None and step_loss.loss_type in RATIO_LOSS_TYPES:
                    old = policy_log_probs.detach()  # one update per rollout batch: ratio is exactly 1
                # train.mask_truncated: a left-out completion's row of the response mask is zeroed, so it adds 0 to
                # the loss (the batch mean still divides by every completion); entropy and old-policy KL still
                # measure every sampled token.
                loss_mask = mask * mb["loss_mask"] if "loss_mask" in mb else mask
                loss, meta = microbatch_train_step(
                    policy_log_probs,
                    loss_mask,
                    shape.gradient_accumulation_per_rank,
                    step_loss,
                    raw_rewards=mb["raw_rewards"],
                    advantages=mb["advantages"],
                    old_log_probs=old,
                    ref_log_probs=mb.get("ref_log_probs"),
                    sampler_log_probs=mb.get("sampler_log_probs"),
                    step_sequences=step_sequences,
                    step_tokens=step_tokens,
                )
            batch_loss += float(loss)
            record_microbatch(totals, meta, scored["token_entropy"], mask, loss_mask)
        if self.world.distributed:  # the step's positions on each rank: the largest over the mean
            per_rank = parallel.all_gather_objects(step_positions)
            perf.imbalances.append(max(per_rank) * len(per_rank) / max(sum(per_rank), 1))
        with timed(timings, "time/optimizer_s"):
            grad_norm = parallel.full_tensor(
                torch.nn.utils.clip_grad_norm_(self.trainable_parameters, cfg.train.max_grad_norm)
            )
            # Every rank takes the same branch: one rank's NaN loss skips the step everywhere.
            finite = not parallel.any_rank(not (math.isfinite(batch_loss) and bool(torch.isfinite(grad_norm))))
            if finite:
                self.optimizer.step()
                self.nonfinite_streak = 0
            else:
                # One bad batch must not poison the weights (AdamW would spread NaN to every parameter).
                self.optimizer.zero_grad(set_to_none=True)
                self.nonfinite_streak += 1
        record("train/loss", batch_loss)
        record("train/grad_norm", grad_norm)
        return finite
