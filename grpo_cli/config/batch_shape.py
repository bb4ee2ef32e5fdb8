"""The batch arithmetic of a run, derived once from the config, and the off-policy decision that follows."""

from __future__ import annotations

from dataclasses import dataclass

from grpo_cli.config.fields import core_value
from grpo_cli.config.schemas import DISAGGREGATED, GRPOConfig

# The losses' declarations (grpo_cli.core.losses.LOSSES: name -> what each needs and reads), read when first needed
# (the core imports torch).
loss_declarations = core_value("losses", "LOSSES")


def ratio_loss_types() -> tuple[str, ...]:
    """The losses with an importance ratio against the old policy (they declare they need old log-probs): they
    need them off-policy and stay correct there."""
    return tuple(name for name, spec in loss_declarations().items() if spec.ratio)


@dataclass(frozen=True)
class BatchShape:
    """The batch arithmetic of a run and whether its updates are off-policy, derived once from the config
    (printed before any model loads; validation and training both read it)."""

    prompts_per_rollout_batch: int
    completions_per_rollout_batch: int
    group_size: int
    train_batch_size: int
    microbatch_size: int
    gradient_accumulation_steps: int
    epochs_per_rollout_batch: int
    optimizer_steps_per_rollout_batch: int
    max_new_tokens: int
    # sync.strategy
    sync_strategy: str
    # train.microbatch_tokens: microbatches of at most this many positions (None: of microbatch_size rows).
    microbatch_tokens: int | None = None
    # Data-parallel ranks sharing each step (1 without distributed.*): the sizes above stay global, each rank
    # takes an equal share of the prompts (whole groups) and of every train batch.
    ranks: int = 1

    @classmethod
    def from_config(cls, cfg: GRPOConfig) -> BatchShape:
        t = cfg.train
        epochs = cfg.sync.epochs_per_rollout_batch
        distributed = cfg.distributed
        ranks = 1 if distributed.strategy == "none" else distributed.nproc_per_node * distributed.nnodes
        return cls(
            ranks=ranks,
            prompts_per_rollout_batch=t.rollout_batch_size // t.group_size,
            completions_per_rollout_batch=t.rollout_batch_size,
            group_size=t.group_size,
            train_batch_size=t.train_batch_size,
            microbatch_size=t.train_batch_size // t.gradient_accumulation_steps,
            gradient_accumulation_steps=t.gradient_accumulation_steps,
            epochs_per_rollout_batch=epochs,
            optimizer_steps_per_rollout_batch=epochs * t.rollout_batch_size // t.train_batch_size,
            max_new_tokens=cfg.rollout.max_tokens,
            sync_strategy=cfg.sync.strategy,
            microbatch_tokens=t.microbatch_tokens,
        )

    @property
    def prompts_per_rank(self) -> int:
        return self.prompts_per_rollout_batch // self.ranks

    @property
    def train_batch_per_rank(self) -> int:
        return self.train_batch_size // self.ranks

    @property
    def gradient_accumulation_per_rank(self) -> int:
        """Microbatches per rank and optimizer step: the microbatch keeps its one-process size, so the ranks'
        averaged gradient is the one-process gradient."""
        return max(1, self.train_batch_per_rank // self.microbatch_size)

    @property
    def off_policy(self) -> bool:
        """Whether an update may run on a policy that moved since the batch was sampled: several optimizer steps
        per rollout batch, or a generator that runs behind the learner (the DISAGGREGATED strategies)."""
        return self.optimizer_steps_per_rollout_batch > 1 or self.sync_strategy in DISAGGREGATED

    def rows(self) -> list[tuple[str, object]]:
        return [
            ("prompts per rollout batch", self.prompts_per_rollout_batch),
            ("completions per prompt (group size)", self.group_size),
            ("completions per rollout batch", self.completions_per_rollout_batch),
            ("completions per optimizer step", self.train_batch_size),
            (
                ("microbatch (token budget)", f"<= {self.microbatch_tokens} positions")
                if self.microbatch_tokens is not None
                else (
                    "microbatch size (x gradient accumulation)",
                    f"{self.microbatch_size} (x{self.gradient_accumulation_steps})",
                )
            ),
            ("epochs per rollout batch", self.epochs_per_rollout_batch),
            ("optimizer steps per rollout batch", self.optimizer_steps_per_rollout_batch),
            ("max new tokens per completion", self.max_new_tokens),
            ("max generated tokens per step", self.completions_per_rollout_batch * self.max_new_tokens),
        ]


def needs_old_log_probs(cfg: GRPOConfig) -> bool:
    """Whether old (behaviour) log-probs are computed once per rollout batch (sync.old_log_probs, null: when
    needed). The ratio losses (grpo_clip, gspo, cispo) need them whenever an update may run on a policy that moved
    since the rollout (BatchShape.off_policy). With one on-policy step the ratio is exactly 1 and the current
    log-probs serve (detached)."""
    if cfg.sync.old_log_probs is not None:
        return bool(cfg.sync.old_log_probs)
    return cfg.loss.type in ratio_loss_types() and BatchShape.from_config(cfg).off_policy
