"""The sync strategies' bookkeeping as pure functions: lag, overlap, the replay buffer, config rules."""

import builtins
import random

import pytest
import torch

from grpo_cli.batch.rollout_data import RolloutData
from grpo_cli.config import validate_config
from grpo_cli.drivers.versions import ReplayBuffer, check_lag, lag, overlap_fraction, staleness_stats
from grpo_cli.errors import UserFacingError
from tests.conftest import compose_config


def test_lag_counts_versions_and_check_lag_refuses_more_than_allowed():
    assert lag(5, 5) == 0 and lag(5, 4) == 1
    assert check_lag(5, 4, max_lag=1) == 1
    with pytest.raises(RuntimeError, match="lag 2 exceeds 1"):
        check_lag(5, 3, max_lag=1)
    with pytest.raises(ValueError, match="ahead"):  # data from the future is an orchestration bug
        lag(3, 4)


@pytest.mark.parametrize(
    ("produce_s", "waiting_s", "expected"),
    [
        (2.0, 2.0, 0.0),  # the learner waited for all of it: serial
        (2.0, 0.0, 1.0),  # ready before the learner asked: fully hidden
        (2.0, 0.5, 0.75),
        (2.0, 3.0, 0.0),  # waiting also covers transfer latency: never negative
        (0.0, 0.0, 0.0),
    ],
)
def test_overlap_fraction(produce_s, waiting_s, expected):
    assert overlap_fraction(produce_s, waiting_s) == pytest.approx(expected)


def test_replay_buffer_is_bounded_first_in_first_out():
    buffer = ReplayBuffer(capacity=3, max_staleness=5)
    buffer.add(["a", "b"], version=0)
    buffer.add(["c", "d"], version=1)
    assert [e.item for e in buffer.entries] == ["b", "c", "d"] and buffer.dropped_full == 1


def test_replay_buffer_drops_trajectories_older_than_the_staleness_bound():
    buffer = ReplayBuffer(capacity=10, max_staleness=2)
    buffer.add(["v0", "v0"], version=0)
    buffer.add(["v1"], version=1)
    buffer.add(["v3"], version=3)
    assert not buffer.can_sample(3, learner_version=3)  # v0 is 3 versions old: only v1, v3 are usable
    assert buffer.can_sample(2, learner_version=3)
    chosen = buffer.sample(2, learner_version=3, rng=random.Random(0))
    assert sorted(e.item for e in chosen) == ["v1", "v3"] and buffer.dropped_stale == 2
    with pytest.raises(ValueError, match="fewer than 3"):
        buffer.sample(3, learner_version=3, rng=random.Random(0))


def test_replay_buffer_samples_without_replacement_and_counts_reuse():
    buffer = ReplayBuffer(capacity=8, max_staleness=1)
    buffer.add(range(4), version=0)
    rng = random.Random(0)
    first = buffer.sample(4, learner_version=0, rng=rng)
    assert sorted(e.item for e in first) == [0, 1, 2, 3]
    second = buffer.sample(2, learner_version=1, rng=rng)
    assert all(e.uses == 2 for e in second)


def test_staleness_never_exceeds_the_bound_under_any_interleaving():
    # A simulated run: a generator that falls behind by a random number of versions, a learner that samples
    # every step. Whatever the interleaving, no sampled trajectory is older than max_staleness.
    rng = random.Random(1)
    for max_staleness in (1, 2, 4):
        buffer = ReplayBuffer(capacity=16, max_staleness=max_staleness)
        generator_version = 0
        for learner_version in range(200):
            for _ in range(rng.randint(0, 2)):  # 0, 1 or 2 batches finish during this step
                buffer.add(range(4), version=generator_version)
            generator_version = max(generator_version, learner_version - rng.randint(0, 6))
            if buffer.can_sample(4, learner_version):
                entries = buffer.sample(4, learner_version, rng)
                stats = staleness_stats(learner_version, [e.version for e in entries])
                assert stats["max"] <= max_staleness and stats["mean"] <= stats["max"]


def test_replay_trajectories_round_trip_with_their_behaviour_log_probs():
    from grpo_cli.drivers.ray_executor import join_trajectories, split_trajectories

    data = RolloutData(
        prompt_ids=[[1, 2], [1, 2]],
        completion_ids=[[3], [4, 5]],
        raw_rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor([0.7, -0.7]),
        old_log_probs=[torch.tensor([-0.1]), torch.tensor([-0.2, -0.3])],
    )
    items = split_trajectories(data)
    joined = join_trajectories(items[::-1], versions=[4, 3])
    assert joined.completion_ids == [[4, 5], [3]] and joined.policy_version == 3
    torch.testing.assert_close(joined.advantages, torch.tensor([-0.7, 0.7]))
    torch.testing.assert_close(joined.old_log_probs[0], torch.tensor([-0.2, -0.3]))


def test_replay_trajectories_keep_an_episodes_tool_and_environment_tokens_out_of_the_loss():
    from grpo_cli.drivers.ray_executor import join_trajectories, split_trajectories

    data = RolloutData(
        prompt_ids=[[1, 2], [1, 2]],
        completion_ids=[[3, 4, 5], [6, 7]],
        raw_rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor([0.7, -0.7]),
        token_masks=[torch.tensor([1.0, 0.0, 1.0]), torch.tensor([1.0, 1.0])],
    )
    single_turn = split_trajectories(RolloutData([[9]], [[8, 8]], torch.zeros(1), torch.zeros(1)))
    joined = join_trajectories([*split_trajectories(data)[::-1], *single_turn], versions=[4, 3, 4])
    assert [m.tolist() for m in joined.token_masks] == [[1.0, 1.0], [1.0, 0.0, 1.0], [1.0, 1.0]]
    assert join_trajectories(single_turn, versions=[1]).token_masks is None


def test_rollout_metrics_of_several_batches_add_times_and_average_statistics():
    from grpo_cli.drivers.dynamic_sampling import combine_rollout_metrics

    parts = [RolloutData([[1]] * 2, [[2]] * 2, torch.tensor(r), torch.zeros(2)) for r in ([1.0, 1.0], [0.0, 0.0])]
    parts[0].metrics = {"train/reward": 1.0, "train/reward_std": 0.0, "time/generation_s": 2.0}
    parts[1].metrics = {"train/reward": 0.0, "train/reward_std": 0.0, "time/generation_s": 3.0}
    combined = combine_rollout_metrics(parts)
    # reward_std: the spread of the four rewards together, not the mean of the two batches' (0).
    std = torch.tensor([1.0, 1.0, 0.0, 0.0]).std().item()
    assert combined == {"train/reward": 0.5, "train/reward_std": std, "time/generation_s": 5.0}
    assert combine_rollout_metrics([]) == {}


BASE = ["debug=smoke"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["sync.epochs_per_rollout_batch=2"], "sync=on_policy takes one optimizer step per rollout batch"),
        (["loss=grpo_clip", "sync=multi_epoch", "sync.old_log_probs=false"], "needs the old policy's log-probs"),
        (["loss=grpo_clip", "sync=one_behind", "sync.old_log_probs=false"], "needs the old policy's log-probs"),
        (["loss=grpo_clip", "sync=replay_buffer", "sync.buffer_size=2"], "sync.buffer_size=2 is smaller than a batch"),
        (["loss=grpo_clip", "sync=replay_buffer", "sync.max_staleness=0"], "sync.max_staleness=0"),
        (["sync=replay_buffer"], "which loss=reinforce_with_baseline ignores: use loss=grpo_clip"),
        (["sync=one_behind", "sync.epochs_per_rollout_batch=2"], "use loss=grpo_clip"),
        (["sync=one_behind", "sync.actor_cpus=0"], "sync.actor_cpus=0 must be >= 1"),
    ],
)
def test_invalid_sync_combinations_fail_with_one_line(overrides, message):
    cfg = compose_config([*BASE, *overrides])
    with pytest.raises(UserFacingError) as info:
        validate_config(cfg)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["sync=one_behind"],  # a one-version lag without ratios: the usual one-step off-policy trade-off
        ["sync=one_behind", "loss=grpo_clip"],
        ["sync=replay_buffer", "loss=grpo_clip"],
        ["sync=on_policy", "loss=grpo_clip", "sync.old_log_probs=false"],  # on-policy: the ratio is exactly 1
    ],
)
def test_valid_sync_combinations_pass(overrides):
    validate_config(compose_config([*BASE, *overrides]))


def test_missing_ray_is_one_line(monkeypatch):
    from grpo_cli.drivers.ray_run import import_ray

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(UserFacingError) as info:
        import_ray("one_behind")
    assert str(info.value) == 'sync=one_behind needs Ray: pip install -e ".[ray]"'
