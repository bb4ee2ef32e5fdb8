"""What the loss of a GRPO update is, as one frozen object: the loss type and its clip ranges, how token losses
are aggregated, the KL penalty and the sampler/learner importance correction.

The learner builds it once from the config (grpo_cli.learner.settings.loss_settings) and hands it to every
microbatch's train step (grpo_cli.core.train_step.microbatch_train_step). Plain data, no torch: core stays free
of the config, and the config of core's tensors.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    kl_beta: float = 0.0
    kl_estimator: str = "k3"
    importance_correction: str = "none"
    importance_level: str = "token"
    importance_threshold: float = 2.0
    # The lower bound of importance_correction="masked"; None: 1 / importance_threshold.
    importance_threshold_low: float | None = None
