"""What the loss of a GRPO update is, as one frozen object: the loss type and its clip ranges, how token losses
are aggregated, the KL penalty and the sampler/learner importance correction.

The learner builds it once from the config (grpo_cli.learner.settings.loss_settings) and hands it to every
microbatch's train step (grpo_cli.core.train_step.microbatch_train_step). Plain data: core stays free of the
config.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from grpo_cli.core.kl import scheduled_kl_beta


@dataclass(frozen=True)
class LossSettings:
    """The loss's settings; each field's meaning is that of the train step's argument of the same name
    (grpo_cli.core.train_step.grpo_microbatch_train_step documents them)."""

    loss_type: str
    cliprange: float | None = None
    # eps_high (clip-higher; CISPO's cap); None: symmetric.
    cliprange_high: float | None = None
    dual_clip: float | None = None
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
