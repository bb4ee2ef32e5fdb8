import pytest
import torch

from grpo_cli.core import (
    compute_group_normalized_rewards,
    fraction_of_zero_std_groups,
    normalize_group_rewards,
)


def exact_match_reward(response: str, ground_truth: str) -> dict[str, float]:
    answer = float(response == ground_truth)
    return {"reward": answer, "format_reward": float(response != ""), "answer_reward": answer}


# two prompts, G = 4: group 1 rewards [1, 0, 0, 1], group 2 rewards [1, 1, 1, 1]
RESPONSES = ["4", "5", "", "4", "7", "7", "7", "7"]
GROUND_TRUTHS = ["4"] * 4 + ["7"] * 4


def test_group_normalized_rewards_with_std() -> None:
    advantages, raw_rewards, metadata = compute_group_normalized_rewards(
        exact_match_reward, RESPONSES, GROUND_TRUTHS, group_size=4, advantage_eps=1e-6, normalize_by_std=True
    )
    torch.testing.assert_close(raw_rewards, torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1]))
    # group 1: mean .5, Bessel std sqrt(4 * .25 / 3) = .57735 -> A = +-.5 / .57735 = +-.86603
    # group 2: all equal -> (r - mean) = 0 -> A = 0 / (0 + eps) = 0
    a = 0.5 / (0.57735027 + 1e-6)
    torch.testing.assert_close(advantages, torch.tensor([a, -a, -a, a, 0, 0, 0, 0]))
    assert advantages.shape == (8,) and advantages.dtype == torch.float32
    # 6 of 8 rewards are 1; format: 7 of 8 responses non-empty
    assert metadata["reward_mean"] == pytest.approx(0.75)
    assert metadata["reward_std"] == pytest.approx((0.75 * 0.25 * 8 / 7) ** 0.5)  # Bessel over the batch
    assert metadata["reward_max"] == 1.0 and metadata["reward_min"] == 0.0
    assert metadata["format_reward_mean"] == pytest.approx(7 / 8)
    assert metadata["answer_reward_mean"] == pytest.approx(0.75)
    assert metadata["frac_zero_std_groups"] == pytest.approx(0.5)


def test_group_normalized_rewards_mean_only() -> None:
    advantages, _, _ = compute_group_normalized_rewards(
        exact_match_reward, RESPONSES, GROUND_TRUTHS, group_size=4, advantage_eps=1e-6, normalize_by_std=False
    )
    # group 1: r - .5; group 2: r - 1
    torch.testing.assert_close(advantages, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))


def test_normalize_group_rewards_pure_function() -> None:
    # groups of 2: [0, 2] -> mean 1, std sqrt(2) -> A = -+1/(sqrt 2 + .1); [3, 3] -> 0
    rewards = torch.tensor([0.0, 2.0, 3.0, 3.0])
    a = 1 / (2**0.5 + 0.1)
    torch.testing.assert_close(normalize_group_rewards(rewards, 2, 0.1, True), torch.tensor([-a, a, 0, 0]))
    torch.testing.assert_close(normalize_group_rewards(rewards, 2, 0.1, False), torch.tensor([-1.0, 1, 0, 0]))
    # integer rewards become float advantages
    assert normalize_group_rewards(torch.tensor([0, 1]), 2, 0.0, False).tolist() == [-0.5, 0.5]


def test_fraction_of_zero_std_groups() -> None:
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])  # groups [1 1] [0 1] [0 0]
    assert fraction_of_zero_std_groups(rewards, 2) == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    ("responses", "truths", "group_size", "by_std", "message"),
    [
        (["a", "b"], ["a"], 2, True, "2 responses but 1 ground truths"),
        (["a", "b", "c"], ["a", "b", "c"], 2, True, "not a multiple of group_size=2"),
        (["a", "b"], ["a", "b"], 1, True, "group_size >= 2"),
    ],
)
def test_group_normalized_rewards_validation(
    responses: list[str], truths: list[str], group_size: int, by_std: bool, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        compute_group_normalized_rewards(exact_match_reward, responses, truths, group_size, 1e-6, by_std)


def test_group_size_one_is_fine_without_std() -> None:
    advantages, _, _ = compute_group_normalized_rewards(exact_match_reward, ["a"], ["a"], 1, 1e-6, False)
    assert advantages.tolist() == [0.0]


def test_reward_fn_missing_key_raises() -> None:
    with pytest.raises(ValueError, match="missing \\['format_reward', 'answer_reward'\\]"):
        compute_group_normalized_rewards(lambda r, g: {"reward": 1.0}, ["a", "b"], ["a", "b"], 2, 1e-6, True)


def test_rloo_subtracts_the_mean_of_the_other_responses() -> None:
    from grpo_cli.core import compute_advantages

    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0])
    # group 1: 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3; group 2 all equal -> 0
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(compute_advantages(rewards, 4, "rloo"), expected)
    with pytest.raises(ValueError, match="rloo needs group_size >= 2"):
        compute_advantages(rewards, 1, "rloo")


def test_batch_std_divides_by_one_std_for_the_whole_batch() -> None:
    from grpo_cli.core import compute_advantages

    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0])
    centered = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(compute_advantages(rewards, 4, "batch_std", 0.0), centered / rewards.std())
    # the handout's two through the same entry point
    torch.testing.assert_close(compute_advantages(rewards, 4, "mean"), centered)
    with pytest.raises(ValueError, match="unknown advantage normalization 'whiten'"):
        compute_advantages(rewards, 4, "whiten")


def test_group_normalized_rewards_takes_any_advantage_normalization() -> None:
    advantages, _, _ = compute_group_normalized_rewards(
        exact_match_reward, RESPONSES, GROUND_TRUTHS, 4, 1e-6, True, advantage_normalization="rloo"
    )
    torch.testing.assert_close(advantages, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0, 0.0, 0.0]))


@pytest.mark.parametrize("mode", ["std", "mean", "rloo", "batch_std"])
def test_responses_left_out_leave_their_group_statistics(mode: str) -> None:
    from grpo_cli.core import compute_advantages

    # G = 4: group 0 keeps rows 0, 1, 3 (row 2 skipped, its placeholder reward 0 must not count); group 1 keeps
    # one row (no comparison: 0); group 2 keeps all.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.25])
    keep = torch.tensor([True, True, False, True, True, False, False, False, True, True, True, True])
    got = compute_advantages(rewards, 4, mode, 1e-6, keep=keep)
    # Independent: each group's kept rows alone, as a group of their own size (batch_std: one std of every kept
    # reward, the groups centred on their own kept mean).
    expected = torch.zeros(12)
    for rows in ([0, 1, 3], [8, 9, 10, 11]):
        index = torch.tensor(rows)
        if mode == "batch_std":
            centred = compute_advantages(rewards[index], len(rows), "mean")
            expected[index] = centred / (rewards[keep].std() + 1e-6)
        else:
            expected[index] = compute_advantages(rewards[index], len(rows), mode, 1e-6)
    assert torch.allclose(got, expected, atol=1e-6)
    assert not torch.allclose(got, compute_advantages(rewards, 4, mode, 1e-6), atol=1e-3)  # the mask matters
    # all kept: exactly the unmasked computation
    everyone = torch.ones(12, dtype=torch.bool)
    assert torch.equal(compute_advantages(rewards, 4, mode, 1e-6, keep=everyone), compute_advantages(rewards, 4, mode))


def test_zero_std_groups_among_the_kept_responses() -> None:
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 0.0, 0.0, 0.0])
    keep = torch.tensor([True, True, False, True, True, False, True, True])
    # group 0: kept rewards all 1 (no signal, though the skipped placeholder differs); group 1: 2 vs 0, signal
    assert fraction_of_zero_std_groups(rewards, 4, keep) == 0.5
    assert fraction_of_zero_std_groups(rewards, 4) == 0.0


@pytest.mark.parametrize("mode", ["std", "mean", "rloo", "batch_std"])
@pytest.mark.parametrize("reward", [0.7, 0.1, 1 / 3, 0.9])
def test_a_group_of_equal_fractional_rewards_gets_exactly_zero(mode: str, reward: float) -> None:
    # float32's mean of seven 0.7s is 0.7 less one ulp: before the fix the std's eps turned it into +-0.056
    # advantages (checked against the exact statement: every reward equal -> no signal), beside a group with one.
    from grpo_cli.core.advantages import compute_advantages

    rewards = torch.tensor([reward] * 7 + [0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    advantages = compute_advantages(rewards, 7, mode)
    assert torch.equal(advantages[:7], torch.zeros(7))
    assert (advantages[7:] != 0).all()  # the other group keeps its signal
    kept = compute_advantages(rewards, 7, mode, keep=torch.tensor([True] * 6 + [False] + [True] * 7))
    assert torch.equal(kept[:7], torch.zeros(7))
