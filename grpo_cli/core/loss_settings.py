"""What the loss of a GRPO update is, as one frozen object: the loss type and its clip ranges, how token losses
are aggregated, the KL penalty and the sampler/learner importance correction.

The learner builds it once from the config (grpo_cli.learner.settings.loss_settings) and hands it to every
microbatch's train step (grpo_cli.core.train_step.microbatch_train_step), which hands it whole to the loss
(grpo_cli.core.losses). Plain data: core stays free of the config.

The fields between `loss_type` and `length_normalization` are the loss.* keys (same names: the learner copies
them over by name); those declared with `loss_option` are read by some losses only, and each loss declares which
it reads (`register_loss(..., reads=...)`), so the config refuses one set for a loss that would ignore it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from grpo_cli.core.kl import scheduled_kl_beta

# The metadata key of a loss option's `does`.
DOES = "does"


def loss_option(default: float | None = None, *, does: str) -> Any:
    """A loss.* option that only some losses read: `does` says what it does, in the config's refusal when the
    chosen loss does not read it ("loss.dual_clip=3.0 bounds grpo_clip's ratio, but loss=...")."""
    return field(default=default, metadata={DOES: does})


@dataclass(frozen=True)
class LossSettings:
    """The loss's settings; each field's meaning is that of the train step's argument of the same name
    (grpo_cli.core.train_step.grpo_microbatch_train_step documents them)."""

    loss_type: str
    cliprange: float | None = None
    # eps_high (clip-higher; CISPO's cap); None: symmetric.
    cliprange_high: float | None = loss_option(does="clips an importance ratio")
    dual_clip: float | None = loss_option(does="bounds grpo_clip's ratio")
    length_normalization: str = "sequence_mean"
    # The divisor of length_normalization="constant".
    normalize_constant: float | None = None
    # The KL coefficient: at every step, or at the first step of a schedule (kl_beta_schedule) that ends at
    # kl_beta_final (None: kl_beta) at step total_steps; at_step(step) gives the settings of one step.
    kl_beta: float = 0.0
    kl_estimator: str = "k3"
    kl_beta_schedule: str = "constant"
    kl_beta_final: float | None = None
    total_steps: int = 1
    importance_correction: str = "none"
    importance_level: str = "token"
    importance_threshold: float = 2.0
    # The lower bound of importance_correction="masked"; None: 1 / importance_threshold.
    importance_threshold_low: float | None = None
    # Decoupled PPO (sync=async): old_log_probs are a proximal policy's, the sampler's are the behaviour policy's,
    # and pi_prox / pi_behav weighs every token whatever importance_correction is (core.importance).
    decoupled: bool = False
    # Decoupled PPO with importance_correction="none": a token whose pi_prox / pi_behav exceeds it weighs 0
    # (sync.behaviour_weight_cap; core.importance); None: uncapped.
    behaviour_weight_cap: float | None = None

    @property
    def kl_penalty(self) -> bool:
        """Whether some step of the run adds a KL penalty (so the reference policy's log-probs are needed)."""
        final = self.kl_beta if self.kl_beta_final is None else self.kl_beta_final
        return self.kl_beta > 0 or (self.kl_beta_schedule != "constant" and final > 0)

    def kl_beta_at(self, step: int) -> float:
        """The KL coefficient of step `step` (1: the first) of the run (core.kl.scheduled_kl_beta)."""
        final = self.kl_beta if self.kl_beta_final is None else self.kl_beta_final
        return scheduled_kl_beta(step, self.total_steps, self.kl_beta, final, self.kl_beta_schedule)

    def at_step(self, step: int) -> LossSettings:
        """The settings in force at step `step`: its scheduled KL coefficient, held (what one step's train steps
        read)."""
        return replace(self, kl_beta=self.kl_beta_at(step), kl_beta_schedule="constant", kl_beta_final=None)


def loss_options() -> dict[str, str]:
    """The optional loss.* options (declared with `loss_option`): name -> what it does."""
    return {f.name: f.metadata[DOES] for f in fields(LossSettings) if DOES in f.metadata}


def settings_from(loss_type: str, arguments: dict[str, Any]) -> LossSettings:
    """The LossSettings of a keyword-style call (the handout's functions): `arguments`' entries named like a field,
    so a wrapper's keywords reach the loss by name and a new field needs no edit there."""
    names = {f.name for f in fields(LossSettings)}
    return LossSettings(loss_type=loss_type, **{k: v for k, v in arguments.items() if k in names and k != "loss_type"})
