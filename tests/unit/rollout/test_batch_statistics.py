"""Batch-level statistics over the batch the update trains on, on every path (rollout/batch_statistics.py, issue 57):
normalization=batch_std's advantages are compute_advantages over the assembled batch (every rank's rows under
data parallelism, groups of several batches under sync=async), and a step's rollout metrics mean the same whether
the batch was scored whole or in pieces. The rewards vary (lipogram's answer reward on the random model), so a
per-piece std differs from the batch's."""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grpo_cli.batch.rollout_data import RolloutData, select_completions
from grpo_cli.core import compute_advantages
from grpo_cli.drivers.dynamic_sampling import combine_rollout_metrics
from grpo_cli.drivers.prompts import PromptSampler
from grpo_cli.rollout.async_generation import AsyncGeneration, FinishedGroup
from grpo_cli.rollout.batch_statistics import split_whole_batch_metrics
from grpo_cli.rollout.runs import Samples
from grpo_cli.rollout.worker import RolloutWorker, sampling_settings
from grpo_cli.tasks import load_examples
from tests.conftest import compose_config
from tests.e2e.test_multiturn_e2e import ENVIRONMENT
from tests.unit.distributed.test_distributed import SETTING, free_port
from tests.unit.drivers.test_async import ASYNC, FakeActor, bare_executor, submitted, weights_of

EPS = 1e-6  # normalization.advantage_eps's default


def whole_batch_advantages(rewards: torch.Tensor, group_size: int, scored: torch.Tensor | None = None) -> torch.Tensor:
    """The independent computation: compute_advantages over the assembled batch in one call."""
    return compute_advantages(rewards, group_size, "batch_std", EPS, keep=scored)


def per_piece_advantages(rewards: torch.Tensor, piece: int, group_size: int) -> torch.Tensor:
    """What scoring each piece on its own gives (the bug): batch_std's std over each piece of `piece` rows."""
    return torch.cat([whole_batch_advantages(part, group_size) for part in rewards.split(piece)])


# --- step metrics: one batch, scored whole or in pieces -----------------------------------------------------------


def rows_of(samples: Samples, start: int, stop: int) -> Samples:
    """Rows [start, stop) of a batch of samples."""
    cut = {}
    for f in fields(samples):
        value = getattr(samples, f.name)
        cut[f.name] = value[start:stop] if isinstance(value, list) else value
    return Samples(**cut)


def test_a_batch_scored_in_groups_combines_to_the_metrics_of_the_batch_scored_whole():
    cfg = compose_config([*SETTING, "rollout.max_tokens=24", "rollout.stop=['e']", "rollout.min_tokens=1"])
    worker = RolloutWorker(cfg)
    g = cfg.train.group_size
    examples = load_examples(cfg.task, "train")[:4]
    with worker.autocast():
        samples = worker.run.sample(worker.engine, sampling_settings(cfg, g, seed=11), examples)
    whole = worker.scored(samples, {}, 0.0)
    pieces = [worker.scored(rows_of(samples, k * g, (k + 1) * g), {}, 0.0) for k in range(len(examples))]
    combined = combine_rollout_metrics(pieces)
    statistics = sorted(k for k in whole.metrics if k.startswith("train/"))
    assert statistics == sorted(k for k in combined if k.startswith("train/"))
    for key in statistics:
        assert combined[key] == pytest.approx(whole.metrics[key], abs=1e-9), key
    assert combined["n_tokens"] == whole.metrics["n_tokens"]
    # A batch scored whole and shipped group by group (sync.lockstep): its groups combine to it as well, its totals
    # counted once.
    shipped = [select_completions(whole, list(range(k * g, (k + 1) * g))) for k in range(len(examples))]
    for piece, metrics in zip(shipped, split_whole_batch_metrics(whole.metrics, len(shipped)), strict=True):
        piece.metrics = metrics
    assert {k: v for k, v in combine_rollout_metrics(shipped).items() if not k.startswith("time/")} == pytest.approx(
        {k: v for k, v in whole.metrics.items() if not k.startswith("time/")}
    )
    # The comparison can fail: the pieces differ in spread and longest response, so averaging them (the old
    # combine) gives other numbers.
    within = sum(p.metrics["train/reward_std"] for p in pieces) / len(pieces)
    assert within != pytest.approx(whole.metrics["train/reward_std"])
    assert sum(p.metrics["train/response_length_max"] for p in pieces) / len(pieces) != pytest.approx(
        whole.metrics["train/response_length_max"]
    )


def test_combined_reward_means_count_only_the_rows_with_a_reward():
    # A skipped episode (no reward) is out of the reward's mean and spread, in the length's; a metric one piece
    # lacks (a reward function's log_metric) is the mean over the pieces that have it.
    first = RolloutData([[1]] * 2, [[2]] * 2, torch.tensor([1.0, 0.0]), torch.zeros(2), scored=torch.tensor([1, 0]) > 0)
    second = RolloutData([[1]] * 2, [[2]] * 2, torch.tensor([0.0, 0.0]), torch.zeros(2))
    first.metrics = {"train/reward": 1.0, "train/reward_std": 0.0, "train/response_length_mean": 2.0}
    second.metrics = {"train/reward": 0.0, "train/reward_std": 0.0, "train/response_length_mean": 5.0, "train/x": 3.0}
    combined = combine_rollout_metrics([first, second])
    assert combined["train/reward"] == pytest.approx(1 / 3)  # the rewards 1, 0, 0
    assert combined["train/reward_std"] == pytest.approx(torch.tensor([1.0, 0.0, 0.0]).std().item())
    assert combined["train/response_length_mean"] == pytest.approx((2 * 2 + 5 * 2) / 4)
    assert combined["train/x"] == 3.0


# --- data parallelism: two gloo ranks, each scoring its share -----------------------------------------------------


def _rank(rank: int, port: int, out_dir: str, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from grpo_cli.drivers.local import InProcessExecutor

        cfg = compose_config([*SETTING, "distributed=ddp", "normalization=batch_std", "train.steps=2"])
        sampler = PromptSampler(load_examples(cfg.task, "train"), seed=cfg.seed)
        executor = InProcessExecutor(cfg, Path(out_dir) / f"rank{rank}", sampler)
        trained: list[tuple[torch.Tensor, torch.Tensor]] = []
        learn = executor.learner.learn

        def recording_learn(data, step):  # what the update receives, this rank's rows
            trained.append((data.raw_rewards.clone(), data.advantages.clone()))
            return learn(data, step)

        executor.learner.learn = recording_learn
        lines = [executor.step(1)[0]]
        cfg.train.dynamic_sampling = True  # the same executor, step 2 through dynamic sampling's assembled batch
        lines.append(executor.step(2)[0])
        executor.close()
        results[rank] = (trained, [line["train/reward_std"] for line in lines])
    finally:
        dist.destroy_process_group()


@pytest.mark.machine_wide
def test_batch_std_over_two_gloo_ranks_is_the_whole_batchs(tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(free_port(), str(tmp_path), results), nprocs=2)
        results = dict(results)
    g = 4  # SETTING's train.group_size
    for step in range(2):
        rewards = torch.cat([results[rank][0][step][0] for rank in (0, 1)])
        advantages = torch.cat([results[rank][0][step][1] for rank in (0, 1)])
        torch.testing.assert_close(advantages, whole_batch_advantages(rewards, g))
        for rank in (0, 1):  # train/reward_std: the whole trained batch's, on every rank
            assert results[rank][1][step] == pytest.approx(rewards.std().item())
    first = torch.cat([results[rank][0][0][0] for rank in (0, 1)])
    # Each rank's own std (what each rank computed before) would give other advantages: the test can fail.
    assert not torch.allclose(per_piece_advantages(first, len(first) // 2, g), whole_batch_advantages(first, g))


# --- sync=async: groups scored one at a time, trained together ----------------------------------------------------


class RecordingLearner(FakeActor):
    """The learner actor without Ray: records each batch `learn` receives."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list = []

    def answer(self, method: str, *args):
        if method == "learn":
            self.batches.append(args[0])
            return {"time/old_log_probs_s": 0.0, "train/loss": 0.0}, 0
        return None


class HandingGenerator(FakeActor):
    """A generator actor without Ray: its first collect hands over the finished groups it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.groups: list[FinishedGroup] = []

    def answer(self, method: str, *args):
        if method == "collect":
            groups, self.groups = self.groups, []
            return groups, {}, 0, 0.0
        return None


def finished_groups(cfg, batches) -> list[FinishedGroup]:
    """The groups a real in-process generator sampled and scored for these batch orders (version 0)."""
    generation = AsyncGeneration(cfg)
    try:
        generation.offer_weights(weights_of(generation, 0), 0)
        for order in batches:
            generation.submit(order)
        groups: list[FinishedGroup] = []
        expected = sum(len(order.examples) for order in batches)
        while len(groups) < expected:
            groups += generation.collect(1.0)[0]
    finally:
        generation.close()
    return groups


@pytest.mark.parametrize("path", ["stream", "episodes"])
def test_an_async_step_trains_the_advantages_of_its_assembled_batch(tmp_path, path):
    overrides = [*ASYNC, "normalization=batch_std", "sync.on_stale=drop", "sync.max_staleness=1"]
    overrides += ["train.group_size=4", "train.rollout_batch_size=8", "train.train_batch_size=8"]
    if path == "stream":  # single-turn: the decode stream scores each group as its rows end
        overrides += SETTING[2:6] + ["rollout.max_tokens=12"]
    else:  # episodes: scored a batch at a time (the whole-batch path), groups shipped one by one
        (tmp_path / "parity_env.py").write_text(ENVIRONMENT)
        overrides += ["task=guess_number", f"task.environment={tmp_path / 'parity_env.py'}:Parity", "task.max_turns=3"]
    cfg = compose_config(overrides)
    learner, generator = RecordingLearner(), HandingGenerator()
    sampler = PromptSampler(load_examples(cfg.task, "train"), seed=0)
    executor = bare_executor(cfg, sampler, {}, learner, [generator])
    executor.start(0)
    executor.top_up()  # batches 1 and 2 handed out
    orders = submitted(executor)
    groups = finished_groups(cfg, orders)
    # The step trains the first groups to end, from both batches: batch 2's first, then batch 1's second.
    by_key = {(grp.batch_number, grp.prompt_indices[0]): grp for grp in groups}
    first = [by_key[(2, 0)], by_key[(1, 1)]]
    rest = [grp for grp in groups if all(grp is not f for f in first)]
    generator.groups = first + rest
    line, _ = executor.step(1)
    (batch,) = learner.batches
    g = cfg.train.group_size
    rewards = torch.cat([grp.data.raw_rewards for grp in first])
    torch.testing.assert_close(batch.raw_rewards, rewards)
    torch.testing.assert_close(batch.advantages, whole_batch_advantages(rewards, g))
    assert line["train/reward_std"] == pytest.approx(rewards.std().item())
    # The step's metrics are those of the groups it trains, as one batch (an episode's length: its model tokens).
    assert line["train/reward"] == pytest.approx(rewards.mean().item())
    lengths = [
        int(m.sum()) if grp.data.token_masks is not None else len(ids)
        for grp in first
        for ids, m in zip(grp.data.completion_ids, grp.data.token_masks or grp.data.completion_ids, strict=True)
    ]
    assert line["train/response_length_max"] == max(lengths)
    assert line["train/response_length_mean"] == pytest.approx(sum(lengths) / len(lengths))
    # The groups' own advantages (what the step trained before) differ: the test can fail.
    own = torch.cat([grp.data.advantages for grp in first])
    assert not torch.allclose(own, whole_batch_advantages(rewards, g))
