"""Per-token policy-gradient losses: one small function per loss type, registered by name with what it needs.

Every loss has one signature (verl's registered policy losses are the anchor, `core_algos.py`):
``loss(old_log_probs, policy_log_probs, advantages, response_mask, settings) -> (per-token loss, metadata)``,
``settings`` the frozen :class:`LossSettings` whole, so a new option of a loss is a field there read here, with no
keyword list in between. Each loss declares, where it is defined (``@register_loss``), what it needs (the tensors
and settings that must be given) and which optional settings it reads: the dispatcher checks the needs, and the
config reads the same declarations for `loss.type`'s allowed values and help and for its cross-field rules
(grpo_cli/config/validation.py), so nothing about a loss is stated twice.

Each loss is per token, shape (batch, seq), unmasked; aggregation over tokens and examples happens in
:func:`grpo_cli.core.aggregate_token_loss` (called by :func:`grpo_cli.core.grpo_microbatch_train_step`).
Rewards and advantages are per example, (batch, 1), and broadcast over every token of the response.

The clipped losses return masks of the tokens each clip acted on, so the train step can log how often each
side bound: "clipped_low" (ratio below 1 - eps_low), "clipped_high" (ratio above 1 + eps_high) and
"clipped_dual" (dual-clip's bound on a negative advantage).

The handout's functions (`compute_grpo_clip_loss`, `compute_policy_gradient_loss`, ...) keep their keyword
signatures as thin wrappers: their keywords become a LossSettings by field name (`settings_from`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from grpo_cli.core.loss_settings import LossSettings, settings_from

LossOutput = tuple[torch.Tensor, dict[str, torch.Tensor]]


class LossFn(Protocol):
    """A registered loss: the old policy's log-probs (None for a loss that needs none), the policy's (with grad),
    each example's weight (its advantage, or its raw reward for a loss that needs "raw_rewards"), (batch, 1), the
    response mask, and the settings whole."""

    def __call__(
        self,
        old_log_probs: torch.Tensor | None,
        policy_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        settings: LossSettings,
    ) -> LossOutput: ...


# The tensors a loss may need besides the policy's log-probs; every other name in a `needs` is a LossSettings field.
LOSS_TENSORS: tuple[str, ...] = ("raw_rewards", "advantages", "old_log_probs", "response_mask")


@dataclass(frozen=True)
class LossSpec:
    """A loss type as declared next to its function."""

    fn: LossFn
    # What loss=<name> computes, in a few words: its part of loss.type's help.
    summary: str
    # What must be given: tensors of LOSS_TENSORS and LossSettings fields (not None).
    needs: tuple[str, ...]
    # The optional LossSettings fields it reads when set; setting one no loss of the run reads is refused.
    reads: tuple[str, ...] = ()

    @property
    def ratio(self) -> bool:
        """Whether it weighs tokens by an importance ratio against the old policy: it needs old log-probs, and stays
        correct off-policy (several optimizer steps per batch, stale samples)."""
        return "old_log_probs" in self.needs

    def uses(self, option: str) -> bool:
        """Whether it reads LossSettings field `option`."""
        return option in self.needs or option in self.reads


LOSSES: dict[str, LossSpec] = {}


def register_loss(
    name: str, summary: str, needs: tuple[str, ...], reads: tuple[str, ...] = ()
) -> Callable[[LossFn], LossFn]:
    """Register the decorated function as loss type `name` (loss.type=<name>), with what it needs and reads."""

    def register(fn: LossFn) -> LossFn:
        LOSSES[name] = LossSpec(fn, summary, needs, reads)
        return fn

    return register


def _as_column(values: torch.Tensor, policy_log_probs: torch.Tensor, name: str) -> torch.Tensor:
    """Return per-example ``values`` as (batch, 1), accepting (batch,) too.

    A (batch,) tensor would silently broadcast along the wrong axis against (batch, seq), hence the reshape.
    """
    batch_size = policy_log_probs.shape[0]
    if values.dim() == 1:
        values = values.unsqueeze(-1)
    if values.shape != (batch_size, 1):
        raise ValueError(
            f"{name} has shape {tuple(values.shape)} but policy_log_probs {tuple(policy_log_probs.shape)}; "
            f"pass one value per example, shape ({batch_size}, 1)"
        )
    return values


def _same_shape(tensor: torch.Tensor | None, policy_log_probs: torch.Tensor, name: str) -> torch.Tensor:
    """`tensor`, checked to be given and shaped like policy_log_probs."""
    if tensor is None:
        raise ValueError(f"{name} is needed, but None was given")
    if tensor.shape != policy_log_probs.shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} but policy_log_probs {tuple(policy_log_probs.shape)}; "
            "they must match"
        )
    return tensor


def _clip_ranges(settings: LossSettings) -> tuple[float, float]:
    """(eps_low, eps_high) of the clipped losses, validated; eps_high is eps_low when cliprange_high is None
    (symmetric)."""
    cliprange, cliprange_high, dual_clip = settings.cliprange, settings.cliprange_high, settings.dual_clip
    if cliprange is None or cliprange < 0:
        raise ValueError(f"cliprange must be >= 0, got {cliprange}")
    if cliprange_high is not None and cliprange_high < 0:
        raise ValueError(f"cliprange_high must be >= 0, got {cliprange_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 (the dual-clip paper uses 3), got {dual_clip}")
    return cliprange, cliprange if cliprange_high is None else cliprange_high


def compute_naive_policy_gradient_loss(
    raw_rewards_or_advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
) -> torch.Tensor:
    """REINFORCE per-token loss ``-A * log pi_theta(o_t)``.

    With raw rewards as ``A`` this is the "no_baseline" loss, with group-normalized advantages the
    "reinforce_with_baseline" loss.

    Args:
        raw_rewards_or_advantages (torch.Tensor): per-example reward or advantage, shape (batch, 1) (or
            (batch,)).
        policy_log_probs (torch.Tensor): log-probs of the sampled tokens under the policy, shape (batch, seq).

    Returns:
        torch.Tensor: per-token loss, shape (batch, seq).
    """
    advantages = _as_column(raw_rewards_or_advantages, policy_log_probs, "raw_rewards_or_advantages")
    return -advantages * policy_log_probs  # (B, 1) * (B, T) -> (B, T)


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    cliprange: float,
    cliprange_high: float,
    dual_clip: float | None,
) -> LossOutput:
    """``-min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)``, optionally dual-clipped, with the masks of
    the tokens each bound acted on. ``ratio`` (B, T) carries the gradient, ``advantages`` is (B, 1)."""
    unclipped = ratio * advantages  # (B, T)
    clipped = torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange_high) * advantages  # (B, T)
    objective = torch.minimum(unclipped, clipped)
    # The clipped side is the minimum only beyond the bound on the side the advantage pushes towards.
    clipped_low = clipped < unclipped
    clipped_high = clipped_low & (advantages > 0)
    clipped_low = clipped_low & (advantages < 0)
    metadata = {"clipped": clipped_low | clipped_high, "clipped_low": clipped_low, "clipped_high": clipped_high}
    if dual_clip is not None:
        # Dual-clip (Ye et al. 2020): with A < 0 a huge ratio would make -rho * A unbounded; bound the
        # objective below by c * A (no gradient there, like any clipped token).
        bound = dual_clip * advantages  # (B, 1)
        dual = (advantages < 0) & (objective < bound)
        objective = torch.where(dual, bound.expand_as(objective), objective)
        metadata["clipped_dual"] = dual
    metadata["ratio"] = ratio.detach()
    return -objective, metadata


# Registered bottom-up: no_baseline first, as the handout lists them.
@register_loss("reinforce_with_baseline", "-A log pi", needs=("advantages",))
@register_loss("no_baseline", "-R log pi", needs=("raw_rewards",))
def reinforce_loss(
    old_log_probs: torch.Tensor | None,
    policy_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    settings: LossSettings,
) -> LossOutput:
    """REINFORCE, ``-A * log pi_theta(o_t)`` (:func:`compute_naive_policy_gradient_loss`): with the raw rewards as
    ``A`` the "no_baseline" loss, with group-normalized advantages "reinforce_with_baseline"."""
    return compute_naive_policy_gradient_loss(advantages, policy_log_probs), {}


@register_loss(
    "grpo_clip",
    "PPO-style clipped ratio",
    needs=("advantages", "old_log_probs", "cliprange"),
    reads=("cliprange_high", "dual_clip"),
)
def grpo_clip_loss(
    old_log_probs: torch.Tensor | None,
    policy_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    settings: LossSettings,
) -> LossOutput:
    """GRPO-Clip, ``-min(rho_t * A, clip(rho_t, 1 - eps_low, 1 + eps_high) * A)``, optionally dual-clipped
    (:func:`compute_grpo_clip_loss` documents it)."""
    old_log_probs = _same_shape(old_log_probs, policy_log_probs, "old_log_probs")
    cliprange, cliprange_high = _clip_ranges(settings)
    advantages = _as_column(advantages, policy_log_probs, "advantages")
    ratio = torch.exp(policy_log_probs - old_log_probs)  # (B, T)
    return _clipped_surrogate(ratio, advantages, cliprange, cliprange_high, settings.dual_clip)


@register_loss(
    "gspo",
    "one clipped, length-normalized ratio per sequence (GSPO)",
    needs=("advantages", "old_log_probs", "response_mask", "cliprange"),
    reads=("cliprange_high",),
)
def gspo_loss(
    old_log_probs: torch.Tensor | None,
    policy_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    settings: LossSettings,
) -> LossOutput:
    """GSPO, the clipped surrogate with one ratio per sequence, the geometric mean of its token ratios
    (:func:`compute_gspo_loss` documents it). An empty response has ratio 1."""
    old_log_probs = _same_shape(old_log_probs, policy_log_probs, "old_log_probs")
    _same_shape(response_mask, policy_log_probs, "response_mask")
    cliprange, cliprange_high = _clip_ranges(settings)
    advantages = _as_column(advantages, policy_log_probs, "advantages")
    mask = response_mask.to(policy_log_probs.dtype)
    log_ratio = (policy_log_probs - old_log_probs) * mask  # (B, T); masked positions may hold anything
    sequence_log_ratio = log_ratio.sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp_min(1.0)
    ratio = torch.exp(sequence_log_ratio).expand_as(policy_log_probs)  # (B, 1) -> (B, T)
    return _clipped_surrogate(ratio, advantages, cliprange, cliprange_high, None)


@register_loss(
    "cispo",
    "REINFORCE weighted by the clipped, stop-gradient ratio (CISPO)",
    needs=("advantages", "old_log_probs", "cliprange_high"),
)
def cispo_loss(
    old_log_probs: torch.Tensor | None,
    policy_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    settings: LossSettings,
) -> LossOutput:
    """CISPO, ``-sg(min(rho_t, 1 + eps_high)) * A * log pi_theta(o_t)`` (:func:`compute_cispo_loss` documents
    it): no lower bound on the weight, as in the paper."""
    old_log_probs = _same_shape(old_log_probs, policy_log_probs, "old_log_probs")
    cap = settings.cliprange_high
    if cap is None or cap < 0:
        raise ValueError(f"cliprange_high must be >= 0, got {cap}")
    advantages = _as_column(advantages, policy_log_probs, "advantages")
    ratio = torch.exp(policy_log_probs - old_log_probs).detach()  # (B, T)
    weight = torch.clamp(ratio, max=1.0 + cap)
    capped = ratio > 1.0 + cap
    loss = -weight * advantages * policy_log_probs
    metadata = {"clipped": capped, "clipped_high": capped, "clipped_low": torch.zeros_like(capped), "ratio": ratio}
    return loss, metadata


POLICY_GRADIENT_LOSS_TYPES: tuple[str, ...] = tuple(LOSSES)
# The losses that weigh tokens by an importance ratio against the old policy (they need old log-probs, and
# stay correct off-policy: several optimizer steps per batch, stale samples).
RATIO_LOSS_TYPES: tuple[str, ...] = tuple(name for name, spec in LOSSES.items() if spec.ratio)


def loss_types_help() -> str:
    """loss.type's help (grpo_cli/config/schemas.py reads it): each registered loss's summary."""
    summaries = " | ".join(f"{name}: {spec.summary}" for name, spec in LOSSES.items())
    return f"{summaries}. Formulas and papers: docs/algorithm.md."


def loss_spec(loss_type: str) -> LossSpec:
    """The declaration of loss type `loss_type`; ValueError naming the choices for an unknown one."""
    if loss_type not in LOSSES:
        raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {list(POLICY_GRADIENT_LOSS_TYPES)}")
    return LOSSES[loss_type]


def policy_gradient_loss(
    settings: LossSettings,
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor | None = None,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
) -> LossOutput:
    """The per-token loss of ``settings.loss_type``: its needs checked against its declaration, then its function
    called with the settings whole. ``response_mask`` None: every token (a loss that needs it refuses None)."""
    spec = loss_spec(settings.loss_type)
    tensors = {
        "raw_rewards": raw_rewards,
        "advantages": advantages,
        "old_log_probs": old_log_probs,
        "response_mask": response_mask,
    }
    missing = [name for name in spec.needs if (tensors[name] if name in tensors else getattr(settings, name)) is None]
    if missing:
        raise ValueError(f"loss_type {settings.loss_type!r} needs {', '.join(missing)}, which was not given (None)")
    weights = raw_rewards if "raw_rewards" in spec.needs else advantages
    assert weights is not None  # every loss needs one of them (tests/unit/core/test_loss_registry.py)
    mask = response_mask if response_mask is not None else torch.ones_like(policy_log_probs, dtype=torch.bool)
    return spec.fn(old_log_probs, policy_log_probs, weights, mask, settings)


def compute_grpo_clip_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    cliprange: float,
    cliprange_high: float | None = None,
    dual_clip: float | None = None,
) -> LossOutput:
    """GRPO-Clip per-token loss ``-min(rho_t * A, clip(rho_t, 1 - eps_low, 1 + eps_high) * A)``.

    ``rho_t = pi_theta(o_t) / pi_old(o_t) = exp(log_probs - old_log_probs)``. Where the clipped side is the
    minimum, the loss is constant in the policy, so those tokens get no gradient. ``eps_low = cliprange``;
    ``eps_high = cliprange_high`` (DAPO's clip-higher, Yu et al. 2025), or ``cliprange`` when None
    (symmetric, the handout's loss). With ``dual_clip = c`` (Ye et al. 2020) a negative advantage's
    objective is further bounded below by ``c * A``: ``-max(min(rho A, clip(rho) A), c A)`` for ``A < 0``.

    Args:
        advantages (torch.Tensor): per-example advantage, shape (batch, 1) (or (batch,)).
        policy_log_probs (torch.Tensor): log-probs under the policy being trained, shape (batch, seq).
        old_log_probs (torch.Tensor): log-probs under the policy that sampled the rollouts, shape
            (batch, seq); treated as a constant (pass it detached).
        cliprange (float): eps_low (and eps_high unless ``cliprange_high`` is given), >= 0.
        cliprange_high (float | None): eps_high, >= 0; None: symmetric.
        dual_clip (float | None): the dual-clip constant c > 1; None: off.

    Returns:
        tuple[torch.Tensor, dict[str, torch.Tensor]]:

        - loss: per-token loss, shape (batch, seq).
        - metadata: "clipped" (batch, seq) bool, True where the clipped side was strictly smaller (chosen),
          split into "clipped_low" (A < 0, ratio below 1 - eps_low) and "clipped_high" (A > 0, ratio above
          1 + eps_high); "clipped_dual" (A < 0 and the dual-clip bound chosen) when ``dual_clip`` is set;
          "ratio" (batch, seq), rho_t, detached.
    """
    settings = settings_from("grpo_clip", locals())
    return policy_gradient_loss(settings, policy_log_probs, advantages=advantages, old_log_probs=old_log_probs)


def compute_gspo_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float,
    cliprange_high: float | None = None,
) -> LossOutput:
    """GSPO per-token loss (Zheng et al. 2025, "Group Sequence Policy Optimization"): the clipped surrogate
    with one importance ratio per sequence, the geometric mean of its token ratios:

    ``s_i = exp(mean_t (log pi_theta(o_t) - log pi_old(o_t)))`` over the response tokens of sequence i, and
    ``-min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)`` broadcast over its tokens. Aggregated by
    a per-sequence mean (``sequence_mean``) this is the paper's objective; its gradient flows into every
    token of the sequence through ``s_i``. The paper clips in a far narrower range than GRPO
    (eps_low 3e-4, eps_high 4e-4: conf/loss/gspo.yaml) because ``s_i`` is length-normalized.

    Under decoupled PPO (sync=async) the train step multiplies this per-token loss by each token's weight
    pi_prox / pi_behav, so with ``sequence_mean`` a sequence is weighted by the arithmetic mean of its token weights,
    not by a sequence-level ratio: AReaL's choice too (its behaviour weight stays per token under GSPO), and a mean of
    capped weights stays bounded (docs/sync.md#decoupled-ppo; tests/unit/core/test_behaviour_cap.py).

    Args:
        advantages (torch.Tensor): per-example advantage, shape (batch, 1) (or (batch,)).
        policy_log_probs (torch.Tensor): (batch, seq), with grad.
        old_log_probs (torch.Tensor): (batch, seq), constant.
        response_mask (torch.Tensor): (batch, seq), bool or float: the tokens whose ratios are averaged.
        cliprange (float): eps_low (and eps_high unless ``cliprange_high`` is given).
        cliprange_high (float | None): eps_high; None: symmetric.

    Returns:
        tuple[torch.Tensor, dict[str, torch.Tensor]]: the per-token loss (batch, seq) (one value per row) and
        the metadata of :func:`compute_grpo_clip_loss`, with "ratio" the sequence ratio broadcast over the
        row. An empty response has ratio 1.
    """
    settings = settings_from("gspo", locals())
    return policy_gradient_loss(
        settings, policy_log_probs, response_mask, advantages=advantages, old_log_probs=old_log_probs
    )


def compute_cispo_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    cliprange_high: float,
) -> LossOutput:
    """CISPO per-token loss (MiniMax-M1, Chen et al. 2025): REINFORCE weighted by the clipped importance
    ratio, whose gradient is stopped:

    ``-sg(min(rho_t, 1 + eps_high)) * A * log pi_theta(o_t)``.

    Unlike GRPO-Clip no token loses its gradient: only the weight is capped. The paper sets no lower bound
    on the weight ("we did not impose a lower bound ... only tuned eps_high"), and neither does this.

    Args:
        advantages (torch.Tensor): per-example advantage, shape (batch, 1) (or (batch,)).
        policy_log_probs (torch.Tensor): (batch, seq), with grad.
        old_log_probs (torch.Tensor): (batch, seq), constant.
        cliprange_high (float): eps_high >= 0: the weight is capped at 1 + eps_high.

    Returns:
        tuple[torch.Tensor, dict[str, torch.Tensor]]: per-token loss (batch, seq); metadata "clipped" and
        "clipped_high" (tokens whose weight was capped), "ratio" (rho_t, detached).
    """
    settings = settings_from("cispo", locals())
    return policy_gradient_loss(settings, policy_log_probs, advantages=advantages, old_log_probs=old_log_probs)


def compute_policy_gradient_loss(
    policy_log_probs: torch.Tensor,
    loss_type: str,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
    cliprange_high: float | None = None,
    dual_clip: float | None = None,
    response_mask: torch.Tensor | None = None,
) -> LossOutput:
    """Per-token policy-gradient loss of the given type.

    Args:
        policy_log_probs (torch.Tensor): log-probs under the policy being trained, shape (batch, seq).
        loss_type (str): one of ``POLICY_GRADIENT_LOSS_TYPES``: "no_baseline" (``-R * log pi``),
            "reinforce_with_baseline" (``-A * log pi``), "grpo_clip" (:func:`compute_grpo_clip_loss`), "gspo"
            (:func:`compute_gspo_loss`), "cispo" (:func:`compute_cispo_loss`). What each needs and reads is its
            declaration, ``LOSSES[loss_type]`` (``@register_loss`` above its function).
        raw_rewards (torch.Tensor | None): shape (batch, 1).
        advantages (torch.Tensor | None): shape (batch, 1).
        old_log_probs (torch.Tensor | None): shape (batch, seq).
        cliprange (float | None): eps (eps_low with ``cliprange_high``).
        cliprange_high (float | None): eps_high (clip-higher); None: symmetric.
        dual_clip (float | None): dual-clip constant c > 1 for "grpo_clip"; None: off.
        response_mask (torch.Tensor | None): (batch, seq), for "gspo"'s per-sequence ratio.

    Returns:
        tuple[torch.Tensor, dict[str, torch.Tensor]]: per-token loss (batch, seq) and the loss's metadata
        (empty for the two REINFORCE losses; clip masks and "ratio" for the others).

    Raises:
        ValueError: on an unknown ``loss_type``, or when an argument the loss type needs is None.
    """
    settings = settings_from(loss_type, locals())
    return policy_gradient_loss(settings, policy_log_probs, response_mask, raw_rewards, advantages, old_log_probs)
