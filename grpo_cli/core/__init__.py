"""The pure math of GRPO (docs/algorithm.md): tokenization, log-probs, advantages, losses, aggregation,
importance correction, the train step.

Imports torch only: no transformers at import time, no I/O, no Hydra.
"""

from grpo_cli.core.advantages import (
    ADVANTAGE_NORMALIZATIONS,
    compute_advantages,
    compute_group_normalized_rewards,
    fraction_of_zero_std_groups,
    normalize_group_rewards,
)
from grpo_cli.core.aggregation import LENGTH_NORMALIZATIONS, aggregate_token_loss
from grpo_cli.core.chunked_logprobs import LOGITS_CHUNK_TOKENS
from grpo_cli.core.importance import IMPORTANCE_CORRECTIONS, IMPORTANCE_LEVELS, compute_importance_weights
from grpo_cli.core.kl import KL_ESTIMATORS, compute_kl
from grpo_cli.core.logprobs import (
    compute_entropy,
    get_response_log_probs,
    get_response_log_probs_from_logits,
    response_log_probs,
)
from grpo_cli.core.loss_settings import LossSettings
from grpo_cli.core.losses import (
    POLICY_GRADIENT_LOSS_TYPES,
    RATIO_LOSS_TYPES,
    compute_cispo_loss,
    compute_grpo_clip_loss,
    compute_gspo_loss,
    compute_naive_policy_gradient_loss,
    compute_policy_gradient_loss,
)
from grpo_cli.core.masking import masked_mean, masked_normalize
from grpo_cli.core.tokenization import tokenize_prompt_and_output, tokenize_prompt_and_output_ids
from grpo_cli.core.train_step import grpo_microbatch_train_step, microbatch_train_step

__all__ = [
    "ADVANTAGE_NORMALIZATIONS",
    "IMPORTANCE_CORRECTIONS",
    "IMPORTANCE_LEVELS",
    "KL_ESTIMATORS",
    "LENGTH_NORMALIZATIONS",
    "LOGITS_CHUNK_TOKENS",
    "POLICY_GRADIENT_LOSS_TYPES",
    "RATIO_LOSS_TYPES",
    "LossSettings",
    "aggregate_token_loss",
    "compute_advantages",
    "compute_cispo_loss",
    "compute_entropy",
    "compute_group_normalized_rewards",
    "compute_grpo_clip_loss",
    "compute_gspo_loss",
    "compute_importance_weights",
    "compute_kl",
    "compute_naive_policy_gradient_loss",
    "compute_policy_gradient_loss",
    "fraction_of_zero_std_groups",
    "get_response_log_probs",
    "get_response_log_probs_from_logits",
    "grpo_microbatch_train_step",
    "masked_mean",
    "masked_normalize",
    "microbatch_train_step",
    "normalize_group_rewards",
    "response_log_probs",
    "tokenize_prompt_and_output",
    "tokenize_prompt_and_output_ids",
]
