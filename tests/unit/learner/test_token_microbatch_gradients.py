"""train.microbatch_tokens keeps the gradient exact: the learner's accumulated gradient before clipping over
token-budget microbatches of unequal token counts equals the gradient of the whole step in one microbatch (fp32,
1e-5), for every loss and length normalization, with a KL penalty, old log-probs and an importance correction;
and on 2 gloo ranks (DDP and FSDP2) balanced by tokens, one rank running a dummy microbatch. The model is the
tiny random Llama of debug=smoke; the optimizer's step is replaced by a copy of the gradients (compared, not
parameters after AdamW, whose first step is about lr x sign(g) and hides a scale error)."""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grpo_cli.batch.rollout_data import RolloutData
from grpo_cli.core import POLICY_GRADIENT_LOSS_TYPES
from grpo_cli.distributed.parallel import full_tensor
from tests.conftest import compose_config

# 4 prompts x 2 completions; completion lengths from 1 to 23 tokens, one long one (the 2-rank test's budget puts
# it alone, so the ranks' microbatch counts differ and one rank runs a dummy).
PROMPTS = [[1, 5, 9], [1, 5, 9], [2, 6], [2, 6], [3, 7, 11, 13], [3, 7, 11, 13], [4, 8], [4, 8]]
LENGTHS = [3, 9, 1, 6, 23, 4, 2, 7]
ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.3, -0.3]
OVERRIDES = [
    "debug=smoke",
    "model.mixed_precision=no",
    "train.rollout_batch_size=8",
    "train.train_batch_size=8",
    "train.gradient_accumulation_steps=1",
    "train.max_grad_norm=1e9",  # clipping multiplies by exactly 1: the gradients seen are the accumulated ones
    "kl.beta=0.05",
    "rollout.importance_correction=masked",
]


def batch() -> RolloutData:
    generator = torch.Generator().manual_seed(3)
    completions = [[int(t) for t in torch.randint(10, 200, (n,), generator=generator)] for n in LENGTHS]
    old = [-2.0 - torch.rand(n, generator=generator) for n in LENGTHS]
    return RolloutData(
        [list(p) for p in PROMPTS],
        completions,
        raw_rewards=torch.tensor([a > 0 for a in ADVANTAGES], dtype=torch.float32),
        advantages=torch.tensor(ADVANTAGES),
        old_log_probs=old,
        # the sampler off by N(0, 0.5) nats: the masked correction (band [1/2, 2]) rejects some tokens
        sampler_log_probs=[o + 0.5 * torch.randn(len(o), generator=generator) for o in old],
    )


def learner_for(overrides: list[str], output_dir: Path):  # -> Learner
    from grpo_cli.learner.learner import Learner

    learner = Learner(compose_config(overrides, output_dir=str(output_dir)), output_dir)
    captured: list[dict[str, torch.Tensor]] = []

    def capture() -> None:  # the optimizer's step: keep the gradients, leave the weights
        captured.append(
            {n: full_tensor(p.grad).clone() for n, p in learner.model.named_parameters() if p.grad is not None}
        )

    learner.optimizer.step = capture
    learner.captured = captured
    return learner


def gradient(learner, data: RolloutData, budget: int | None, loss_type: str, normalization: str):
    """The accumulated gradient of the update's one optimizer step, and its train/* metrics."""
    learner.shape = dataclasses.replace(learner.shape, microbatch_tokens=budget)
    learner.loss = dataclasses.replace(
        learner.loss, loss_type=loss_type, length_normalization=normalization, cliprange=0.2, cliprange_high=0.28
    )
    learner.captured.clear()
    metrics = learner.update(dataclasses.replace(data), step=1)
    assert len(learner.captured) == 1
    return learner.captured[0], metrics


def assert_same_gradients(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Equal to 1e-5 of each tensor's scale: the random model's gradients reach ~100 where terms of both signs
    cancel, and fp32 attention over another padded width already moves them by ~4e-6 of that (a normalizer taken
    per microbatch moves them by more than 1e-2)."""
    assert got.keys() == expected.keys() and got
    for name, value in expected.items():
        scale = float(value.abs().max())
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5 * scale, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    learner = learner_for(OVERRIDES, tmp_path_factory.mktemp("one"))
    assert learner.shape.microbatch_size == 8  # the reference: the whole step in one microbatch
    data = batch()
    data.ref_log_probs = [o + 0.1 for o in data.old_log_probs]
    return learner, data


@pytest.mark.parametrize("normalization", ["sequence_mean", "token_mean", "constant"])
@pytest.mark.parametrize("loss_type", POLICY_GRADIENT_LOSS_TYPES)
def test_token_budget_microbatches_give_the_whole_step_gradient(one_process, loss_type, normalization):
    learner, data = one_process
    expected, whole = gradient(learner, data, None, loss_type, normalization)
    got, budgeted = gradient(learner, data, 40, loss_type, normalization)
    assert budgeted["perf/microbatch_tokens_max"] <= 40
    assert whole["perf/microbatch_tokens_mean"] > 2 * budgeted["perf/microbatch_tokens_mean"]  # several, unequal
    assert_same_gradients(got, expected)
    for key in ("train/entropy", "train/kl"):  # token and response means over the whole step, whatever the cut
        assert budgeted[key] == pytest.approx(whole[key], rel=1e-5)
    # The prompt tree (this model's probe passes: core/prompt_tree.py) computes the whole step without padding;
    # the two-pass shared forward padded every completion to the longest here.
    assert learner.scoring.prompt_tree and whole["perf/padding_frac"] == 0.0


def _two_ranks(rank: int, port: int, output_dir: str, strategy: str, budget: str, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        learner = learner_for(
            [
                *OVERRIDES,
                f"distributed={strategy}",
                "distributed.nproc_per_node=2",
                f"train.microbatch_tokens={budget}",
            ],
            Path(output_dir) / f"rank{rank}",
        )
        assert learner.balance_ranks == (budget != "null")
        plans: list[list[list[int]]] = []
        update = learner.update

        def record(data, step, plan=None):  # noqa: ANN001, ANN202 - the learner's own plan, recorded
            plans.extend([mb.rows for mb in planned.microbatches] for planned in plan.steps)
            return update(data, step, plan)

        learner.update = record
        whole = batch()
        # Each rank generated 2 of the 4 prompts; learn() exchanges them, spreads the rows by tokens, scores its
        # share's reference log-probs and trains on it.
        half = [0, 1, 2, 3] if rank == 0 else [4, 5, 6, 7]
        from grpo_cli.batch.rollout_data import select_completions

        metrics, _ = learner.learn(select_completions(whole, half), step=1)
        results[rank] = ({k: v.clone() for k, v in learner.captured[0].items()}, plans, metrics)
    finally:
        dist.destroy_process_group()


@pytest.mark.machine_wide
@pytest.mark.parametrize(("strategy", "budget"), [("ddp", "30"), ("fsdp", "30"), ("ddp", "null")])
def test_two_gloo_ranks_balanced_by_tokens_give_the_one_process_gradient(tmp_path, strategy, budget):
    # budget null: today's layout (each rank its own rows, fixed microbatches), with the idle-time barrier and the
    # imbalance gather the learner now adds under data parallelism
    reference = learner_for(OVERRIDES, tmp_path / "one")
    metrics, _ = reference.learn(batch(), step=1)  # its reference log-probs from its own frozen copy, as each rank's
    expected = reference.captured[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_two_ranks, args=(port, str(tmp_path), strategy, budget, results), nprocs=2)
        results = dict(results)
    plans = [results[rank][1][0] for rank in (0, 1)]
    assert len(plans[0]) == len(plans[1])
    if budget != "null":
        assert sorted(r for plan in plans for mb in plan for r in mb) == list(range(8))  # every row once
        assert any(not mb for plan in plans for mb in plan)  # a dummy ran
    for rank in (0, 1):
        assert_same_gradients(results[rank][0], expected)
        ranked = results[rank][2]
        assert ranked["perf/rank_token_imbalance"] >= 1.0 and ranked["perf/rank_idle_s"] >= 0.0
    assert results[0][2]["train/entropy"] == pytest.approx(metrics["train/entropy"], rel=1e-5)
