import math

import pytest
import torch

from grpo_cli.core import grpo_microbatch_train_step

# B = 2 examples, T = 3 positions; example 0 has 2 response tokens, example 1 has 3.
MASK = torch.tensor([[True, True, False], [True, True, True]])
LOG_PROBS = torch.tensor([[-1.0, -2.0, -9.0], [-1.0, -1.0, -4.0]])
ADVANTAGES = torch.tensor([[1.0], [-2.0]])
GRAD_ACCUM = 2


def leaf(values: torch.Tensor) -> torch.Tensor:
    return values.clone().requires_grad_()


def test_reinforce_with_baseline_sequence_mean_loss_and_gradient() -> None:
    log_probs = leaf(LOG_PROBS)
    loss, metadata = grpo_microbatch_train_step(
        log_probs, MASK, GRAD_ACCUM, "reinforce_with_baseline", advantages=ADVANTAGES
    )
    # per-token -A * logp: row 0 [1, 2, (9 masked)] -> mean 1.5; row 1 [-2, -2, -8] -> mean -4
    # batch mean (1.5 - 4) / 2 = -1.25; / grad_accum 2 = -.625
    torch.testing.assert_close(loss, torch.tensor(-0.625))
    torch.testing.assert_close(metadata["policy_loss"], torch.tensor(-1.25))
    assert not loss.requires_grad
    # d loss / d logp_t = -A_i * mask_t / (n_tokens_i * B * grad_accum)
    # row 0: -1 / (2 * 2 * 2) = -.125; row 1: 2 / (3 * 2 * 2) = 1/6
    expected = torch.tensor([[-0.125, -0.125, 0.0], [1 / 6, 1 / 6, 1 / 6]])
    torch.testing.assert_close(log_probs.grad, expected)


def test_no_baseline_uses_raw_rewards_and_float_mask() -> None:
    log_probs = leaf(LOG_PROBS)
    loss, _ = grpo_microbatch_train_step(log_probs, MASK.float(), 1, "no_baseline", raw_rewards=ADVANTAGES)
    torch.testing.assert_close(loss, torch.tensor(-1.25))  # same numbers as above, grad_accum 1


def test_constant_normalization_loss_and_gradient() -> None:
    log_probs = leaf(LOG_PROBS)
    loss, _ = grpo_microbatch_train_step(
        log_probs,
        MASK,
        GRAD_ACCUM,
        "reinforce_with_baseline",
        advantages=ADVANTAGES,
        length_normalization="constant",
        normalize_constant=4.0,
    )
    # row sums 3 and -12, / 4 -> .75 and -3; batch mean -1.125; / 2 = -.5625
    torch.testing.assert_close(loss, torch.tensor(-0.5625))
    # d loss / d logp_t = -A_i * mask_t / (C * B * grad_accum): row 0 -1/16, row 1 2/16
    expected = torch.tensor([[-1 / 16, -1 / 16, 0.0], [1 / 8, 1 / 8, 1 / 8]])
    torch.testing.assert_close(log_probs.grad, expected)


def test_grpo_clip_gradient_is_zero_on_clipped_tokens() -> None:
    old = torch.full((2, 3), math.log(0.5))
    ratios = torch.tensor([[1.5, 1.1, 0.5], [1.5, 1.1, 0.5]])
    log_probs = leaf(old + ratios.log())
    advantages = torch.tensor([[1.0], [-1.0]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    loss, metadata = grpo_microbatch_train_step(
        log_probs, mask, 1, "grpo_clip", advantages=advantages, old_log_probs=old, cliprange=0.2
    )
    # per-token loss [[-1.2, -1.1, -.5], [1.5, 1.1, .8]]; row means -.9333 and 1.1333; batch mean .1
    torch.testing.assert_close(loss, torch.tensor(0.1))
    # clipped: (0, 0) and (1, 2) -> 2 of 6 tokens
    torch.testing.assert_close(metadata["clip_fraction"], torch.tensor(2 / 6))
    torch.testing.assert_close(metadata["ratio_mean"], torch.tensor((1.5 + 1.1 + 0.5) / 3))
    # unclipped tokens: d(-rho * A)/d logp = -rho * A, / (3 tokens * 2 examples); clipped tokens: 0
    expected = torch.tensor([[0.0, -1.1, -0.5], [1.5, 1.1, 0.0]]) / 6
    torch.testing.assert_close(log_probs.grad, expected)


def test_clip_fraction_ignores_masked_tokens() -> None:
    old = torch.zeros(1, 3)
    log_probs = leaf(torch.tensor([[math.log(1.5), 0.0, math.log(1.5)]]))  # tokens 0 and 2 clip for A > 0
    mask = torch.tensor([[True, True, False]])
    _, metadata = grpo_microbatch_train_step(
        log_probs, mask, 1, "grpo_clip", advantages=torch.tensor([[1.0]]), old_log_probs=old, cliprange=0.2
    )
    torch.testing.assert_close(metadata["clip_fraction"], torch.tensor(0.5))  # 1 of the 2 response tokens


def test_kl_penalty_gradient() -> None:
    ref = torch.tensor([[-1.5, -2.0, 0.0], [-1.0, -0.5, -4.0]])
    log_probs = leaf(LOG_PROBS)
    beta = 0.5
    # zero rewards: only the KL term moves the policy
    loss, metadata = grpo_microbatch_train_step(
        log_probs,
        MASK,
        GRAD_ACCUM,
        "no_baseline",
        raw_rewards=torch.zeros(2, 1),
        ref_log_probs=ref,
        kl_beta=beta,
    )
    d = ref - LOG_PROBS  # k3 = e^d - d - 1, d k3 / d logp = 1 - e^d
    k3 = d.exp() - d - 1
    kl = ((k3 * MASK).sum(-1) / MASK.sum(-1)).mean()
    torch.testing.assert_close(metadata["kl"], kl)
    torch.testing.assert_close(metadata["policy_loss"], torch.tensor(0.0))
    torch.testing.assert_close(loss, beta * kl / GRAD_ACCUM)
    n_tokens = torch.tensor([[2.0], [3.0]])
    expected = beta * (1 - d.exp()) * MASK / (n_tokens * 2 * GRAD_ACCUM)
    torch.testing.assert_close(log_probs.grad, expected)


def test_kl_is_only_monitored_when_beta_is_zero() -> None:
    ref = LOG_PROBS - 0.3
    log_probs = leaf(LOG_PROBS)
    loss, metadata = grpo_microbatch_train_step(
        log_probs, MASK, GRAD_ACCUM, "reinforce_with_baseline", advantages=ADVANTAGES, ref_log_probs=ref
    )
    # k3 with d = -.3 everywhere: e^-.3 + .3 - 1 = .04082
    torch.testing.assert_close(metadata["kl"], torch.tensor(math.exp(-0.3) + 0.3 - 1))
    assert not metadata["kl"].requires_grad
    torch.testing.assert_close(loss, torch.tensor(-0.625))  # unchanged by the KL
    torch.testing.assert_close(log_probs.grad[0, 0], torch.tensor(-0.125))


def test_empty_response_contributes_zero_not_nan() -> None:
    log_probs = leaf(LOG_PROBS)
    mask = torch.tensor([[False, False, False], [True, False, False]])
    loss, _ = grpo_microbatch_train_step(log_probs, mask, 1, "reinforce_with_baseline", advantages=ADVANTAGES)
    # row 0 empty -> 0; row 1: 2 * -1 = -2; batch mean -1
    torch.testing.assert_close(loss, torch.tensor(-1.0))
    assert torch.isfinite(log_probs.grad).all()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"response_mask": torch.ones(2, 2, dtype=torch.bool)}, "response_mask has shape \\(2, 2\\)"),
        ({"old_log_probs": torch.zeros(1, 3)}, "old_log_probs has shape \\(1, 3\\)"),
        ({"length_normalization": "token_sum"}, "unknown length_normalization 'token_sum'"),
        ({"length_normalization": "constant"}, "needs a positive normalize_constant"),
        ({"kl_beta": 0.1}, "kl_beta=0.1 needs ref_log_probs"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be >= 1"),
    ],
)
def test_train_step_validation(kwargs: dict, message: str) -> None:
    arguments = {
        "policy_log_probs": leaf(LOG_PROBS),
        "response_mask": MASK,
        "gradient_accumulation_steps": 1,
        "loss_type": "reinforce_with_baseline",
        "advantages": ADVANTAGES,
    }
    with pytest.raises(ValueError, match=message):
        grpo_microbatch_train_step(**{**arguments, **kwargs})


# --- the optimizer step's totals, importance correction, the new metrics -----------------------------------


@pytest.mark.parametrize("mode", ["sequence_mean", "constant", "token_mean"])
def test_unequal_microbatches_with_step_totals_give_the_one_batch_gradient(mode: str) -> None:
    # 3 responses of 1, 2 and 4 tokens, as 1 microbatch and as microbatches of 1 and 2 responses
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    log_probs = torch.tensor([[-1.0, 0, 0, 0], [-2.0, -0.5, 0, 0], [-1.0, -1.0, -3.0, -0.2]])
    advantages = torch.tensor([[1.0], [-0.5], [2.0]])
    common = {"loss_type": "reinforce_with_baseline", "length_normalization": mode, "normalize_constant": 4.0}
    whole = leaf(log_probs)
    whole_loss, _ = grpo_microbatch_train_step(whole, mask, 1, advantages=advantages, **common)
    split = leaf(log_probs)
    totals = {"step_sequences": 3.0, "step_tokens": 7.0}
    parts = [
        grpo_microbatch_train_step(split[rows], mask[rows], 2, advantages=advantages[rows], **common, **totals)[0]
        for rows in (slice(0, 1), slice(1, 3))
    ]
    torch.testing.assert_close(sum(parts), whole_loss)
    torch.testing.assert_close(split.grad, whole.grad)


def test_token_mean_loss_and_gradient_by_hand() -> None:
    log_probs = leaf(LOG_PROBS)
    loss, _ = grpo_microbatch_train_step(
        log_probs, MASK, 1, "reinforce_with_baseline", advantages=ADVANTAGES, length_normalization="token_mean"
    )
    # per-token -A * logp over the 5 response tokens: 1 + 2 - 2 - 2 - 8 = -9 -> -9 / 5
    torch.testing.assert_close(loss, torch.tensor(-1.8))
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-0.2, -0.2, 0.0], [0.4, 0.4, 0.4]]))


def test_truncated_importance_weights_scale_the_token_gradients() -> None:
    log_probs = leaf(LOG_PROBS)
    # sampler gave the first token of each row a lower probability: ratio learner / sampler = e^1, capped at 2
    sampler = LOG_PROBS.clone()
    sampler[:, 0] -= 1.0
    _, meta = grpo_microbatch_train_step(
        log_probs,
        MASK,
        1,
        "reinforce_with_baseline",
        advantages=ADVANTAGES,
        length_normalization="token_mean",
        sampler_log_probs=sampler,
        importance_correction="truncated",
        importance_threshold=2.0,
    )
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-0.4, -0.2, 0.0], [0.8, 0.4, 0.4]]))
    torch.testing.assert_close(meta["importance_weight_max"], torch.tensor(math.e))
    torch.testing.assert_close(meta["importance_weight_mean"], torch.tensor((2 * math.e + 3) / 5))
    torch.testing.assert_close(meta["importance_truncated_frac"], torch.tensor(0.4))
    # k3 of KL(sampler || learner) per token: d = learner - sampler = 1 -> e - 1 - 1 on two of five tokens
    torch.testing.assert_close(meta["sampler_kl"], torch.tensor(2 * (math.e - 2) / 5))


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean"])
def test_masked_importance_weighs_by_the_ratio_and_rejected_tokens_leave_the_counts(mode: str) -> None:
    sampler = LOG_PROBS.clone()
    sampler[0, 0] -= 0.5  # ratio e^.5, inside [1/2, 2]: weighed by it (MIS keeps the correction)
    sampler[1, 2] += 3.0  # ratio e^-3 < 1/2: rejected
    common = {
        "advantages": ADVANTAGES,
        "length_normalization": mode,
        "sampler_log_probs": sampler,
        "importance_correction": "masked",
    }
    log_probs = leaf(LOG_PROBS)
    _, meta = grpo_microbatch_train_step(log_probs, MASK, 1, "reinforce_with_baseline", **common)
    # -A * w / count: 4 tokens count (token_mean); row 1 has 2 left (sequence_mean: 2 rows of 2 tokens each)
    w = math.exp(0.5)
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-w / 4, -1 / 4, 0.0], [0.5, 0.5, 0.0]]))
    torch.testing.assert_close(meta["importance_masked_frac"], torch.tensor(0.2))
    # The caller's step totals stand: the learner counts the rejected token there only when it cannot know it
    # before the step (no old log-probs); here it did not take it out.
    log_probs = leaf(LOG_PROBS)
    totals = {"step_sequences": 2.0, "step_tokens": 5.0}
    grpo_microbatch_train_step(log_probs, MASK, 1, "reinforce_with_baseline", **common, **totals)
    expected = {
        "token_mean": [[-w / 5, -1 / 5, 0.0], [0.4, 0.4, 0.0]],
        "sequence_mean": [[-w / 4, -1 / 4, 0.0], [0.5, 0.5, 0.0]],  # a response's own count is always known
    }[mode]
    torch.testing.assert_close(log_probs.grad, torch.tensor(expected))


def test_clip_fractions_low_high_and_dual_are_reported() -> None:
    old = torch.zeros(2, 3)
    log_probs = leaf(torch.tensor([[math.log(1.5), 0.0, 0.0], [math.log(0.5), math.log(5.0), 0.0]]))
    _, meta = grpo_microbatch_train_step(
        log_probs,
        torch.ones(2, 3, dtype=torch.bool),
        1,
        "grpo_clip",
        advantages=torch.tensor([[1.0], [-1.0]]),
        old_log_probs=old,
        cliprange=0.2,
        cliprange_high=0.28,
        dual_clip=3.0,
    )
    # high: A > 0 with r 1.5 > 1.28 (1 of 6); low: A < 0 with r .5 < .8 (1 of 6); dual: A < 0 with r 5 > 3
    torch.testing.assert_close(meta["clip_fraction_high"], torch.tensor(1 / 6))
    torch.testing.assert_close(meta["clip_fraction_low"], torch.tensor(1 / 6))
    torch.testing.assert_close(meta["clip_fraction_dual"], torch.tensor(1 / 6))
    torch.testing.assert_close(meta["clip_fraction"], torch.tensor(2 / 6))


def test_step_totals_come_in_pairs_and_a_correction_needs_sampler_log_probs() -> None:
    with pytest.raises(ValueError, match="pass both step_sequences and step_tokens"):
        grpo_microbatch_train_step(
            leaf(LOG_PROBS), MASK, 1, "reinforce_with_baseline", advantages=ADVANTAGES, step_sequences=2.0
        )
    with pytest.raises(ValueError, match="'truncated' needs sampler_log_probs"):
        grpo_microbatch_train_step(
            leaf(LOG_PROBS),
            MASK,
            1,
            "reinforce_with_baseline",
            advantages=ADVANTAGES,
            importance_correction="truncated",
        )
