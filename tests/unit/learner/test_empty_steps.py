"""A step with nothing to train (docs/algorithm.md#a-step-with-nothing-to-train): no token of its batch is in the
loss (every episode skipped under task.on_reward_error=skip, every completion left out) and it takes no optimizer
step. The parameters, AdamW's moments and its step count after such a step are exactly those of a learner that
never saw it (not merely close: AdamW on a zero gradient would move every parameter through its momentum and weight
decay, which the test shows too). On one process and on two DDP ranks, where a rank with nothing to train joins the
other's step with its dummy microbatch and an empty step is empty on every rank."""

from __future__ import annotations

import copy
import os
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grpo_cli.batch.rollout_data import RolloutData
from tests.conftest import compose_config
from tests.unit.distributed.test_distributed import free_port

# Weight decay on, so a step on a zero gradient would move the parameters even without momentum; KL on, so the
# reference pass runs over the empty batch too.
ONE_PROCESS = [
    "debug=smoke",
    "model.mixed_precision=no",
    "optim.weight_decay=0.1",
    "kl.beta=0.05",
    "train.max_grad_norm=1e9",
]


def batch(seed: int, completions: tuple[int, ...] = (3, 5, 4, 6), vocab: int = 1000) -> RolloutData:
    """A scored batch of two groups of two (random ids: the random model gives them no special status)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (5,), generator=generator).tolist() for _ in range(2)]
    return RolloutData(
        prompt_ids=[prompts[0], prompts[0], prompts[1], prompts[1]],
        completion_ids=[torch.randint(3, vocab, (n,), generator=generator).tolist() for n in completions],
        raw_rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]),
        advantages=torch.tensor([0.7, -0.7, -0.9, 0.9]),
    )


def skipped(data: RolloutData, reached_model: bool) -> RolloutData:
    """`data` with every episode skipped: left out of the loss and out of the advantages (rollout/worker.py), its
    completion empty when the episode never reached the model (an agent that failed before its first call)."""
    data = copy.deepcopy(data)
    if not reached_model:
        data.prompt_ids = [[] for _ in data.prompt_ids]
        data.completion_ids = [[] for _ in data.completion_ids]
    data.loss_mask = torch.zeros(len(data.completion_ids))
    data.scored = torch.zeros(len(data.completion_ids), dtype=torch.bool)
    data.advantages = torch.zeros(len(data.completion_ids))
    return data


def state_of(learner) -> dict[str, torch.Tensor]:
    """Every parameter and every AdamW state tensor (moments and step count), by name."""
    state = {f"param/{n}": p.detach().clone() for n, p in learner.model.named_parameters()}
    names = {id(p): n for n, p in learner.model.named_parameters()}
    for parameter, values in learner.optimizer.state.items():
        for key, value in values.items():
            state[f"adam/{names[id(parameter)]}/{key}"] = torch.as_tensor(value).detach().clone()
    return state


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [key for key in a if not torch.equal(a[key], b[key])]


def test_a_step_with_nothing_to_train_leaves_parameters_and_adamw_state_exactly_as_they_were(tmp_path: Path) -> None:
    from grpo_cli.learner.learner import Learner

    cfg = compose_config(ONE_PROCESS, output_dir=str(tmp_path))
    with_empty, without = Learner(cfg, tmp_path), Learner(cfg, tmp_path)  # seeded: the same initial weights
    assert not differing(state_of(with_empty), state_of(without))
    first, last = batch(1), batch(2, completions=(4, 2, 7, 3))
    for learner in (with_empty, without):
        learner.learn(copy.deepcopy(first), step=1)
    before = state_of(with_empty)
    # Skipped after the model answered (its tokens out of the loss), then before it did (no token at all).
    for step, reached_model in ((2, True), (3, False)):
        metrics, _ = with_empty.learn(skipped(batch(step), reached_model), step=step)
        assert metrics["train/empty_steps"] == 1 and metrics["train/optimizer_steps"] == 0
        assert "train/loss" not in metrics  # no optimizer step: no loss computed, none invented
        assert not differing(state_of(with_empty), before)  # parameters, both moments, the step count
    for learner in (with_empty, without):
        learner.learn(copy.deepcopy(last), step=4)
    assert not differing(state_of(with_empty), state_of(without))
    # The rule is a decision: an AdamW step on a zero gradient (what "a step on nothing" would be) moves them all.
    for parameter in without.trainable_parameters:
        parameter.grad = torch.zeros_like(parameter)
    moved = state_of(without)
    without.optimizer.step()
    assert len(differing(state_of(without), moved)) == len(moved)


def test_rows_that_never_reached_the_model_beside_trained_ones_are_not_forwarded(tmp_path: Path) -> None:
    """Half the batch skipped before the model (empty completions), half trained: one optimizer step, whose gradient
    is the trained half's, the skipped rows still counted in the sequence divisor."""
    from grpo_cli.learner.learner import Learner

    cfg = compose_config([*ONE_PROCESS, "kl.beta=0", "normalization.length=sequence_mean"], output_dir=str(tmp_path))
    mixed, reference = Learner(cfg, tmp_path), Learner(cfg, tmp_path)
    gradients = {id(mixed): [], id(reference): []}
    for learner in (mixed, reference):
        learner.optimizer.step = lambda learner=learner: gradients[id(learner)].append(  # the step's gradient
            torch.cat([p.grad.flatten() for p in learner.trainable_parameters])
        )
    data = batch(4)
    data.completion_ids[1], data.completion_ids[3] = [], []
    data.loss_mask = torch.tensor([1.0, 0.0, 1.0, 0.0])
    metrics, _ = mixed.learn(data, step=1)
    assert metrics["train/optimizer_steps"] == 1 and metrics["train/empty_steps"] == 0
    # The trained rows alone, each of whose losses the four-completion batch divides by 4, not 2.
    kept = RolloutData(
        prompt_ids=[data.prompt_ids[0], data.prompt_ids[2]],
        completion_ids=[data.completion_ids[0], data.completion_ids[2]],
        raw_rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor([0.7, -0.9]) / 2,
    )
    reference.learn(kept, step=1)
    (got,), (expected,) = gradients[id(mixed)], gradients[id(reference)]
    assert expected.norm() > 0
    assert (got - expected).norm() / expected.norm() < 1e-5


# --- two DDP ranks ---------------------------------------------------------------------------------------------

TWO_RANKS = [
    "model=tiny_random",
    "distributed=ddp",
    "model.mixed_precision=no",
    "train.rollout_batch_size=8",
    "train.group_size=2",
    "optim.weight_decay=0.1",
]


def _ddp_case(rank: int, tmp: Path, empty_ranks: tuple[int, ...], extra: list[str]) -> dict:
    from grpo_cli.learner.learner import Learner

    cfg = compose_config([*TWO_RANKS, *extra], output_dir=str(tmp))
    learner = Learner(cfg, tmp)
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    data = batch(10 + rank)
    if rank in empty_ranks:
        data = skipped(data, reached_model=False)
    metrics, _ = learner.learn(data, step=1)
    after = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    return {
        "moved": sum(not torch.equal(before[n], after[n]) for n in before),
        "params": after,
        "adam_steps": sorted({float(s["step"]) for s in learner.optimizer.state.values()}),
        "empty_steps": metrics["train/empty_steps"],
        "optimizer_steps": metrics["train/optimizer_steps"],
    }


# Fixed microbatches (each rank its own rows) and train.microbatch_tokens (the ranks' rows exchanged, each step's
# spread over the ranks by tokens).
DDP_CASES = {
    "one_rank_empty": ((1,), []),
    "both_empty_by_tokens": ((0, 1), ["train.microbatch_tokens=64"]),
}


def _on_two_ranks(rank: int, port: int, tmp: str, results: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(minutes=3))
    torch.set_num_threads(1)  # two ranks on two shared cores
    try:
        for name, (empty_ranks, extra) in DDP_CASES.items():
            (Path(tmp) / name).mkdir(exist_ok=True)
            try:
                results[(name, rank)] = _ddp_case(rank, Path(tmp) / name, empty_ranks, extra)
            except Exception as error:  # noqa: BLE001 - reported to the test
                traceback.print_exc()
                results[(name, rank)] = {"error": f"{type(error).__name__}: {error}"}
                break  # the ranks' collectives may be out of step: run nothing more
    finally:
        dist.destroy_process_group()


@pytest.mark.machine_wide
def test_ddp_ranks_agree_on_a_step_with_nothing_to_train(tmp_path: Path) -> None:
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(_on_two_ranks, args=(free_port(), str(tmp_path), shared), nprocs=2)
        results = dict(shared)
    for name in DDP_CASES:
        ranks = [results.get((name, rank), {"error": "not run"}) for rank in (0, 1)]
        for result in ranks:
            assert "error" not in result, (name, result)
        # The ranks' weights stay one model, whatever each rank had to train.
        assert not differing(ranks[0]["params"], ranks[1]["params"]), name
        if name == "both_empty_by_tokens":
            assert all(r["moved"] == 0 and r["adam_steps"] == [] and r["empty_steps"] == 1 for r in ranks)
        else:  # the rank with nothing joined the other's step (its dummy microbatch): one step on both
            assert all(r["moved"] > 0 and r["adam_steps"] == [1.0] and r["optimizer_steps"] == 1 for r in ranks), name
