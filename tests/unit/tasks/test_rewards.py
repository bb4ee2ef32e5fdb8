"""Composable rewards, per-call time limits, and the reward metrics logged for train and eval."""

import time

import pytest

from grpo_cli.config import validate_config
from grpo_cli.errors import UserFacingError
from grpo_cli.rollout.rewards import reward_metrics, score_responses
from grpo_cli.tasks import RewardTimeout, get_task, make_reward_fn, r1_zero_reward_fn
from grpo_cli.tasks.rewards import TimeLimitedReward, WeightedReward, build_reward_fn
from tests.conftest import compose_config


def test_default_weights_give_the_task_reward_unchanged():
    reward = make_reward_fn(compose_config(["task=math"]).task)
    response = "</think> <answer>\\frac12</answer>"
    assert reward(response, "0.5") == r1_zero_reward_fn(response, "0.5")  # no reward/<name> keys added


def test_format_shaping_on_top_of_correctness():
    cfg = compose_config(["task=math", "task.reward_weights.format=0.1"])
    validate_config(cfg)
    reward = make_reward_fn(cfg.task)
    wrong = reward("</think> <answer>3</answer>", "4")  # formatted but wrong: only the shaping term
    assert wrong["reward"] == pytest.approx(0.1)
    assert wrong["reward/correctness"] == 0.0 and wrong["reward/format"] == 1.0
    assert (wrong["format_reward"], wrong["answer_reward"], wrong["unparseable"]) == (1.0, 0.0, 0.0)
    assert reward("</think> <answer>4</answer>", "4")["reward"] == pytest.approx(1.1)
    assert reward("4", "4")["reward"] == 0.0


def test_answer_component_gives_keyword_partial_credit():
    reward = make_reward_fn(
        compose_config(["task=keyword", "task.reward_weights.correctness=0", "task.reward_weights.answer=1"]).task
    )
    assert reward("a red car", ["red", "apple"]) == {
        "reward": 0.5,
        "format_reward": 1.0,
        "answer_reward": 0.5,
        "correctness": 0.0,  # the task's own reward: whether the answer is right (eval/pass@k reads it)
        "reward/answer": 0.5,
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["task=json", "task.reward_weights.numeric_close=1"], "task=json has no numeric_close component"),
        (["task.reward_weights.correctness=0"], "every task.reward_weights is 0"),
        (["task.reward_weights.format=inf"], "must be a finite number"),
        (["task.reward_timeout_s=-1"], "task.reward_timeout_s=-1.0 must be >= 0"),
        (["task=gsm8k", "task.numeric_tolerance=-0.1"], "task.numeric_tolerance=-0.1 must be >= 0"),
    ],
)
def test_bad_reward_settings_fail_validation_with_one_line(overrides, message):
    with pytest.raises(UserFacingError, match=message) as info:
        validate_config(compose_config(overrides))
    assert "\n" not in str(info.value)


def slow_reward(response, truth):
    deadline = time.perf_counter() + (0.01 if response == "fast" else 60)
    while time.perf_counter() < deadline:  # a Python-level runaway for "slow"
        pass
    return {"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0}


def broken_reward(response, truth):
    raise RuntimeError("bug")


def test_score_responses_counts_timeouts_and_errors_separately():
    scores = score_responses(TimeLimitedReward(slow_reward, 0.2), ["fast", "slow", "fast"], [0, 0, 0])
    assert [r["reward"] for r in scores.rewards] == [1.0, 0.0, 1.0]
    assert (scores.n_timeouts, scores.n_errors) == (1, 0)
    scores = score_responses(broken_reward, ["a"], [0])
    assert (scores.n_timeouts, scores.n_errors) == (0, 1)


def test_make_reward_fn_applies_the_configured_time_limit():
    reward = make_reward_fn(compose_config(["task.reward_timeout_s=0.5"]).task)
    assert isinstance(reward, TimeLimitedReward) and reward.seconds == 0.5
    assert not isinstance(make_reward_fn(compose_config(["task.reward_timeout_s=0"]).task), TimeLimitedReward)
    with pytest.raises(RewardTimeout):
        TimeLimitedReward(slow_reward, 0.1)("slow", 0)


def test_reward_metrics_name_every_component_and_the_unparseable_rate():
    reward = build_reward_fn(get_task("regex_sum"), "chat", {"correctness": 1.0, "format": 0.5})
    assert isinstance(reward, WeightedReward)
    responses = ["<ans>5</ans>", "<ans>4</ans>", "five", "<ans>x</ans>"]
    metrics = reward_metrics(score_responses(reward, responses, [5, 5, 5, 5]), "train")
    assert metrics == {
        "train/reward": pytest.approx((1.5 + 0.5 + 0.0 + 0.5) / 4),
        "train/format_reward": 0.75,
        "train/answer_reward": 0.25,
        "train/unparseable_rate": 0.5,  # "five" and "x" hold no number
        "train/reward/correctness": 0.25,
        "train/reward/format": 0.75,
        "train/reward_errors": 0,
        "train/reward_timeouts": 0,
    }


def test_tasks_without_unparseable_report_a_zero_rate():
    metrics = reward_metrics(score_responses(get_task("keyword").reward_fn, ["red"], [["red"]]), "eval")
    assert metrics["eval/unparseable_rate"] == 0.0 and "eval/reward/correctness" not in metrics
