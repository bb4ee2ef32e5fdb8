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
import functools
import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from grpo_cli.batch.forward import (
    ScoringSettings,
    dummy_microbatch,
    log_probs_of_rows,
    per_completion_rows,
    score_microbatch,
)
from grpo_cli.batch.plan import (
    OptimizerStep,
    PlanSettings,
    UpdatePlan,
    build_update_plan,
    every_row_microbatches,
    plan_settings,
)
from grpo_cli.batch.rollout_data import (
    RolloutData,
    concat_rollouts,
    make_microbatch,
    missing_behaviour,
    model_token_mask,
)
from grpo_cli.batch.settings import scoring_settings
from grpo_cli.config import BatchShape, needs_old_log_probs
from grpo_cli.config.schemas import GRPOConfig
from grpo_cli.core import (
    RATIO_LOSS_TYPES,
    LossSettings,
    masked_mean,
    microbatch_train_step,
)
from grpo_cli.core.packing import packed_row_tokens
from grpo_cli.distributed import parallel
from grpo_cli.errors import UserFacingError
from grpo_cli.learner.accounting import (
    EMPTY_STEPS,
    FLAT_STEPS,
    PaddingTotals,
    record_microbatch,
    record_value,
    rejected_token_counts,
    step_means,
)
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
from grpo_cli.models import build_policy
from grpo_cli.models.runtime import (
    autocast_factory,
    compute_dtype,
    limit_threads,
    resolve_device,
    seed_everything,
    timed,
)

log = logging.getLogger(__name__)

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
        # The update's one plan: its steps' microbatches and the rows the old and reference passes score.
        scores_old = self.needs_old_log_probs and data.old_log_probs is None
        plan = build_update_plan(data, self.plan_settings(), step, scores_old)
        # Both in the training forward's numerics (the policy itself, or under FSDP2 its sharded scorer with the
        # mixed-precision policy, never the sampling copy): on the batch's own weights the ratio is 1.
        if scores_old:
            with timed(timings, "time/old_log_probs_s"):
                fsdp_scorer = self.scorer if self.strategy == "fsdp" else None
                data.old_log_probs = self.log_probs_under(self.model, data, plan.old_microbatches, fsdp_scorer)
        if self.needs_reference:
            with timed(timings, "time/ref_log_probs_s"), self.reference_policy() as (reference, fsdp_scorer):
                data.ref_log_probs = self.log_probs_under(reference, data, plan.reference_microbatches, fsdp_scorer)
        with timed(timings, "time/training_s"):
            metrics = self.update(data, step, plan)
            self.refresh_inference_copy()
        metrics["perf/rank_idle_s"] += self.scoring_idle_s
        metrics["perf/rank_idle_s_max"] += self.scoring_idle_s
        self.version = step
        metrics.update({"train/lr": self.optimizer.param_groups[0]["lr"], **timings})
        return metrics, self.nonfinite_streak

    def plan_settings(self) -> PlanSettings:
        """What this learner's update plans read besides the batch (batch.plan.plan_settings), from its current
        batch shape and loss."""
        return plan_settings(
            self.cfg,
            self.shape,
            self.loss,
            self.scoring,
            self.balance_ranks,
            self.strategy == "fsdp",
            functools.partial(packed_row_tokens, self.model),
        )

    def log_probs_under(
        self,
        model: torch.nn.Module,
        data: RolloutData,
        microbatches: list[list[int]] | None = None,
        fsdp_scorer: torch.nn.Module | None = None,
    ) -> list[torch.Tensor]:
        """Each completion's response-token log-probs under `model` (old or reference policy), no grad, at the
        sampling temperature, for the rows of `microbatches` (the plan's pass); under FSDP2 through `fsdp_scorer`,
        `model`'s sharded PolicyScorer. With ranks balanced by tokens each rank scores its share and the ranks
        exchange the results. A row no microbatch holds (its loss weight is 0 and nothing needs it) gets NaN: no
        step computes it, and a value read by mistake would not pass for a log-prob. `microbatches` None: every
        row."""
        if microbatches is None:
            microbatches = every_row_microbatches(data, self.plan_settings())
        if fsdp_scorer is not None:
            rows = self._sharded_log_probs(fsdp_scorer, data, microbatches)
        else:
            with self.autocast():
                rows = log_probs_of_rows(model, data, self.device, self.scoring, microbatches)
        if self.balance_ranks:
            self.scoring_idle_s += parallel.wait_for_ranks()
            for other in parallel.all_gather_objects(rows):
                rows.update(other)
        return [
            rows[i] if i in rows else torch.full((len(data.completion_ids[i]),), math.nan)
            for i in range(len(data.completion_ids))
        ]

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

    def update(self, data: RolloutData, step: int, plan: UpdatePlan | None = None) -> dict[str, float]:
        """epochs x train batches of optimizer steps over `data`, as `plan` (learn's; else made here) lays them out;
        the metrics are means over the steps."""
        if plan is None:
            plan = build_update_plan(data, self.plan_settings(), step, scores_old=False)
        rejected = rejected_token_counts(data, self.loss)  # once: every epoch reuses the old log-probs
        plan.settle(data, rejected)
        totals: dict[str, list[float]] = {}
        timings = {"time/optimizer_s": 0.0}  # gradient clipping + the optimizer's step
        skipped = 0  # updates skipped for non-finite loss or gradients
        empty = flat = 0  # optimizer steps with nothing to train, or whose every loss weight is 0: not taken
        computed_tokens = 0
        step_loss = self.loss.at_step(step)  # this step's KL coefficient (kl.beta_schedule)
        perf = PaddingTotals()
        response_tokens = 0
        with timed(timings, "time/update_s"):
            for planned in plan.steps:
                if planned.empty or planned.flat:  # the empty-step rule: no optimizer step at all
                    empty += planned.empty
                    flat += planned.flat
                    if planned.flat:  # its loss and gradient are exactly 0 (every term x a weight of 0): said so
                        record_value(totals, "train/loss", 0.0)
                        record_value(totals, "train/grad_norm", 0.0)
                    continue
                computed_tokens += sum(mb.tokens for mb in planned.microbatches)
                response_tokens += sum(len(data.completion_ids[i]) for i in planned.computed_rows)
                finite = self._optimizer_step(data, planned, step_loss, totals, timings, perf)
                skipped += not finite
        metrics = step_means(totals)
        if self.loss.kl_penalty:
            metrics["train/kl_beta"] = step_loss.kl_beta
        metrics["train/optimizer_steps"] = len(totals.get("train/loss", [])) - flat - skipped
        metrics["train/nonfinite_skipped"] = skipped
        metrics[EMPTY_STEPS] = empty
        metrics[FLAT_STEPS] = flat
        metrics["time/optimizer_s"] = timings["time/optimizer_s"]
        metrics["time/forward_backward_s"] = timings["time/update_s"] - timings["time/optimizer_s"]
        # Tokens the model actually ran forward+backward on (all epochs; a shared prompt counts once per
        # microbatch) and response tokens scored, for throughput and FLOP accounting (job=benchmark).
        metrics["throughput/train_tokens"] = computed_tokens
        metrics["throughput/response_tokens"] = response_tokens
        metrics.update(perf.metrics())
        metrics.update(plan.perf())
        return metrics

    def _optimizer_step(
        self,
        data: RolloutData,
        planned: OptimizerStep,
        step_loss: LossSettings,
        totals: dict[str, list[float]],
        timings: dict[str, float],
        perf: PaddingTotals | None = None,
    ) -> bool:
        """Gradient accumulation over the microbatches of one planned optimizer step, then one clipped optimizer
        step, with `step_loss`, the loss's settings at this step (LossSettings.at_step: its scheduled KL
        coefficient). Returns False when the loss or the gradients were not finite (the step is skipped and
        counted). `planned` (a settled UpdatePlan's step): its microbatches (an empty one is a dummy: one row's
        forward and backward with its loss x 0, so every rank makes as many collective calls) and its divisors,
        which count every row of the step, computed or not. `perf` gathers the positions processed (perf/*)."""
        cfg, shape = self.cfg, self.shape
        perf = perf or PaddingTotals()

        def record(key: str, value: float | torch.Tensor) -> None:
            record_value(totals, key, value)

        self.optimizer.zero_grad(set_to_none=True)
        batch_loss = 0.0
        for position, planned_mb in enumerate(planned.microbatches):
            indices = planned_mb.rows
            dummy = not indices
            mb = (
                make_microbatch(data, indices, self.pad_token_id, self.device)
                if indices
                else dummy_microbatch(data, self.pad_token_id, self.device)
            )
            if not dummy:
                perf.positions += planned_mb.positions
                perf.real += planned_mb.real
                perf.microbatches += 1
                perf.largest = max(perf.largest, planned_mb.positions)
            scored_mask = mb["response_mask"]  # every completion token goes through the forward (as context)
            mask = model_token_mask(mb)  # the model's own tokens: an episode's tool/environment tokens are holes
            # DDP averages gradients across ranks once, after the last microbatch (the sums in between are local).
            last = position == len(planned.microbatches) - 1
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
                    step_sequences=planned.sequences,
                    step_tokens=planned.tokens,
                )
            batch_loss += float(loss)
            record_microbatch(totals, meta, scored["token_entropy"], mask, loss_mask)
        if self.world.distributed:  # the step's positions on each rank: the largest over the mean (planned)
            perf.imbalances.append(planned.imbalance)
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
