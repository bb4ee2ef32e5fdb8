"""train.skip_zero_weight_rows leaves the update as it was: rows whose loss weight is exactly 0 (a flat group's
advantages; under no_baseline a raw reward of 0) are neither forwarded nor back-propagated, yet every divisor
counts them, so the gradients and the parameters after two optimizer steps (a non-flat step, then 0%, 50% or 100%
flat groups) equal those of the same learner computing every row: for every loss, every length normalization, the
masked importance correction, packed rows, fixed and token-budget microbatches, on one process and on 2 gloo DDP
ranks (fp32; gradients to 1e-5 of their scale, parameters to 1e-6). An all-flat step takes no optimizer step in
either arm (train/flat_steps). Skipping computes fewer rows (counted at the forward), a KL term turns it off, and
kl.monitor keeps every row's reference log-probs."""

from __future__ import annotations

import copy
import dataclasses
import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grpo_cli.batch.rollout_data import RolloutData
from grpo_cli.core import POLICY_GRADIENT_LOSS_TYPES
from grpo_cli.distributed.parallel import full_tensor
from grpo_cli.learner.accounting import EMPTY_STEPS, FLAT_STEPS, empty_step_note, update_was_empty
from tests.conftest import compose_config
from tests.unit.distributed.test_distributed import free_port

# 4 groups of 2 completions, one optimizer step of 8 rows in microbatches of 4 (fixed layout); weight decay on,
# so an optimizer step on a zero gradient would move the parameters.
OVERRIDES = [
    "debug=smoke",
    "model.mixed_precision=no",
    "train.rollout_batch_size=8",
    "train.train_batch_size=8",
    "train.gradient_accumulation_steps=2",
    "train.max_grad_norm=1e9",  # no clipping: the gradients compared are the accumulated ones
    "optim.weight_decay=0.1",
    # small: where a gradient is near AdamW's eps (1e-8), fp32 rounding of differently grouped rows (~1e-10) moves
    # the step by up to ~10% of lr; the gradients themselves are compared to 5e-5 of their scale
    "optim.lr=1e-6",
]
LENGTHS = [3, 9, 2, 6, 7, 4, 5, 8]


def batch(seed: int, flat_groups: int) -> RolloutData:
    """8 completions of 4 prompts; the first `flat_groups` groups flat: advantage 0, raw reward 1 for group 0
    (no_baseline weighs it 1) and 0 for the others. Old log-probs are given (filled in by `with_old`)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 200, (3 + g,), generator=generator).tolist() for g in range(4)]
    advantages, rewards = [], []
    for g in range(4):
        if g < flat_groups:
            advantages += [0.0, 0.0]
            rewards += [1.0, 1.0] if g == 0 else [0.0, 0.0]
        else:
            a = 0.5 + float(torch.rand((), generator=generator))
            advantages += [a, -a]
            rewards += [1.0, 0.0]
    return RolloutData(
        [prompts[i // 2] for i in range(8)],
        [torch.randint(3, 200, (n,), generator=generator).tolist() for n in LENGTHS],
        raw_rewards=torch.tensor(rewards),
        advantages=torch.tensor(advantages),
    )


def with_old(learner, data: RolloutData, seed: int, masked: bool) -> RolloutData:
    """`data` with old log-probs near the learner's current ones (ratios near 1, some clipped) and, for the masked
    correction, sampler log-probs off by N(0, 0.5) nats (some tokens rejected)."""
    generator = torch.Generator().manual_seed(seed)
    current = learner.log_probs_under(learner.model, data, [list(range(len(data.completion_ids)))])
    data.old_log_probs = [c + 0.2 * torch.randn(len(c), generator=generator) for c in current]
    if masked:
        data.sampler_log_probs = [o + 0.5 * torch.randn(len(o), generator=generator) for o in data.old_log_probs]
    return data


def make_learner(overrides: list[str], output_dir: Path):  # -> Learner
    from grpo_cli.learner.learner import Learner

    learner = Learner(compose_config(overrides, output_dir=str(output_dir)), output_dir)
    learner.initial = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    learner.captured = []
    step = learner.optimizer.step

    def capture_then_step() -> None:  # the gradients of each optimizer step, then the real AdamW step
        learner.captured.append(
            {n: full_tensor(p.grad).clone() for n, p in learner.model.named_parameters() if p.grad is not None}
        )
        step()

    learner.optimizer.step = capture_then_step
    return learner


def configure(learner, skip: bool, loss_type: str, normalization: str, masked: bool, budget: int | None) -> None:
    """The learner back at its initial weights and a fresh AdamW, with this case's loss, layout and arm."""
    with torch.no_grad():
        for name, parameter in learner.model.named_parameters():
            parameter.copy_(learner.initial[name])
    learner.optimizer.state.clear()
    learner.captured.clear()
    learner.cfg = dataclasses.replace(
        learner.cfg, train=dataclasses.replace(learner.cfg.train, skip_zero_weight_rows=skip)
    )
    learner.shape = dataclasses.replace(learner.shape, microbatch_tokens=budget)
    learner.loss = dataclasses.replace(
        learner.loss,
        loss_type=loss_type,
        length_normalization=normalization,
        normalize_constant=16.0,
        cliprange=0.2,
        cliprange_high=0.28,
        importance_correction="masked" if masked else "none",
    )


def first_update(learner, masked: bool) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """The non-flat first update; returns what `second_update` restores: the gradients, the parameters and AdamW's
    state after it."""
    learner.learn(with_old(learner, batch(seed=1, flat_groups=0), seed=11, masked=masked), 1)
    parameters = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    return dict(learner.captured[0]), parameters, copy.deepcopy(learner.optimizer.state_dict())


def second_update(learner, after_first: tuple, flat_groups: int, masked: bool) -> tuple[list[dict], dict, dict]:
    """From the state `after_first`, an update with `flat_groups` flat groups: (gradients of both optimizer
    steps, the parameters after both, the second update's metrics)."""
    gradients, parameters, adam = after_first
    with torch.no_grad():
        for name, parameter in learner.model.named_parameters():
            parameter.copy_(parameters[name])
    learner.optimizer.load_state_dict(copy.deepcopy(adam))
    learner.captured[:] = [gradients]
    data = with_old(learner, batch(seed=2, flat_groups=flat_groups), seed=12, masked=masked)
    metrics, _ = learner.learn(data, 2)
    after = {n: full_tensor(p.detach()).clone() for n, p in learner.model.named_parameters()}
    return [dict(g) for g in learner.captured], after, metrics


def assert_same(got: tuple, expected: tuple) -> None:
    got_grads, got_params, _ = got
    expected_grads, expected_params, _ = expected
    assert len(got_grads) == len(expected_grads)
    for g, e in zip(got_grads, expected_grads, strict=True):
        assert g.keys() == e.keys() and g
        for name, value in e.items():
            scale = float(value.abs().max())
            torch.testing.assert_close(g[name], value, rtol=1e-4, atol=5e-5 * scale, msg=lambda m, n=name: f"{n}: {m}")
    for name, value in expected_params.items():
        torch.testing.assert_close(got_params[name], value, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def learners(tmp_path_factory):
    return {
        "padded": make_learner(OVERRIDES, tmp_path_factory.mktemp("padded")),
        "packed": make_learner([*OVERRIDES, "train.pack_sequences=true"], tmp_path_factory.mktemp("packed")),
    }


# Every loss, every length normalization, the masked correction, padded and packed rows, fixed and token-budget
# microbatches: each at least once, not their product (each case runs 6 updates).
CASES = [
    ("grpo_clip", "sequence_mean", False, "padded", None),
    ("reinforce_with_baseline", "constant", False, "padded", 40),
    ("no_baseline", "token_mean", False, "padded", None),
    ("gspo", "token_mean", False, "padded", 40),
    ("cispo", "constant", True, "padded", None),
    ("grpo_clip", "token_mean", True, "padded", 40),
    ("grpo_clip", "sequence_mean", False, "packed", 40),
    ("reinforce_with_baseline", "token_mean", True, "packed", None),
]


def test_the_cases_cover_every_loss_and_normalization() -> None:
    from grpo_cli.core.aggregation import LENGTH_NORMALIZATIONS

    assert {case[0] for case in CASES} == set(POLICY_GRADIENT_LOSS_TYPES)
    assert {case[1] for case in CASES} == set(LENGTH_NORMALIZATIONS)


def zero_weight_share(loss_type: str, data: RolloutData) -> float:
    """The share of `data`'s rows a loss weighs by 0, read off the batch as the test built it."""
    weights = data.raw_rewards if loss_type == "no_baseline" else data.advantages
    return float((weights == 0).float().mean())


@pytest.mark.parametrize(("loss_type", "normalization", "masked", "layout", "budget"), CASES)
def test_skipping_zero_weight_rows_leaves_gradients_and_parameters_as_computing_them(
    learners, loss_type, normalization, masked, layout, budget
):
    learner = learners[layout]
    after_first = {}
    for skip in (False, True):  # each arm's own first update where it skips rows (no_baseline: rewards of 0)
        if skip and not zero_weight_share(loss_type, batch(seed=1, flat_groups=0)):
            after_first[skip] = after_first[False]  # nothing to skip: the same plan, the same update
            continue
        configure(learner, skip, loss_type, normalization, masked, budget)
        after_first[skip] = first_update(learner, masked)
    first_case = (loss_type, normalization, masked, layout, budget) == CASES[0]
    for flat_groups in (0, 2, 4) if first_case else (2, 4):  # 0% flat once: nothing skipped, the same plan
        runs = {}
        for skip in (False, True):
            configure(learner, skip, loss_type, normalization, masked, budget)
            runs[skip] = second_update(learner, after_first[skip], flat_groups, masked)
        assert_same(runs[True], runs[False])
        assert runs[False][2]["perf/zero_weight_skipped_frac"] == 0.0
        share = zero_weight_share(loss_type, batch(seed=2, flat_groups=flat_groups))
        assert runs[True][2]["perf/zero_weight_skipped_frac"] == pytest.approx(share)
        all_flat = share == 1.0
        for skip in (False, True):  # an all-flat step: no optimizer step in either arm, said and counted
            metrics = runs[skip][2]
            assert metrics[FLAT_STEPS] == int(all_flat) and metrics[EMPTY_STEPS] == 0
            assert len(runs[skip][0]) == (1 if all_flat else 2)
            assert not update_was_empty(metrics)  # not a step train.max_empty_steps counts
            assert (empty_step_note(2, metrics) is not None) == all_flat


def test_an_all_flat_step_leaves_parameters_and_adamw_state_exactly_as_they_were(learners) -> None:
    learner = learners["padded"]
    configure(learner, False, "grpo_clip", "sequence_mean", False, None)
    learner.learn(with_old(learner, batch(1, 0), 11, False), 1)
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    adam = {id(p): {k: torch.as_tensor(v).clone() for k, v in s.items()} for p, s in learner.optimizer.state.items()}
    metrics, _ = learner.learn(with_old(learner, batch(2, 4), 12, False), 2)
    assert metrics[FLAT_STEPS] == 1 and metrics["train/optimizer_steps"] == 0
    assert metrics["train/loss"] == 0.0 and metrics["train/grad_norm"] == 0.0  # what they exactly are
    for name, parameter in learner.model.named_parameters():
        assert torch.equal(parameter.detach(), before[name]), name
    for parameter, state in learner.optimizer.state.items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), adam[id(parameter)][key])
    note = empty_step_note(2, metrics)
    assert note is not None and "every row's loss weight is 0" in note and FLAT_STEPS in note


def forwarded_rows(learner, monkeypatch, data: RolloutData, step: int) -> tuple[list[int], dict]:
    """The rows the update's training forwards ran (make_microbatch's rows), and the update's metrics."""
    import grpo_cli.learner.learner as module

    rows: list[int] = []
    make = module.make_microbatch

    def counting(data, indices, *args, **kwargs):  # noqa: ANN001, ANN202
        rows.extend(indices)
        return make(data, indices, *args, **kwargs)

    monkeypatch.setattr(module, "make_microbatch", counting)
    metrics, _ = learner.learn(data, step)
    monkeypatch.setattr(module, "make_microbatch", make)
    return rows, metrics


def test_skipping_forwards_fewer_rows_and_a_kl_term_turns_it_off(learners, monkeypatch) -> None:
    learner = learners["padded"]
    configure(learner, True, "reinforce_with_baseline", "sequence_mean", False, None)
    rows, metrics = forwarded_rows(learner, monkeypatch, batch(3, 2), 1)
    assert sorted(rows) == [4, 5, 6, 7] and metrics["perf/zero_weight_skipped_frac"] == 0.5
    configure(learner, False, "reinforce_with_baseline", "sequence_mean", False, None)
    rows, off = forwarded_rows(learner, monkeypatch, batch(3, 2), 1)
    assert sorted(rows) == list(range(8)) and off["perf/zero_weight_skipped_frac"] == 0.0
    assert metrics["throughput/train_tokens"] < off["throughput/train_tokens"]
    # no_baseline weighs by the raw reward: group 0, flat at reward 1, is computed; group 1, flat at 0, is not, nor
    # the other groups' rows of reward 0
    configure(learner, True, "no_baseline", "sequence_mean", False, None)
    rows, _ = forwarded_rows(learner, monkeypatch, batch(3, 2), 1)
    assert sorted(rows) == [0, 1, 4, 6]


def test_a_kl_term_computes_every_row_and_kl_monitor_scores_every_reference_row(tmp_path, monkeypatch) -> None:
    kl = make_learner([*OVERRIDES, "kl.beta=0.05"], tmp_path / "kl")
    rows, metrics = forwarded_rows(kl, monkeypatch, batch(3, 4), 1)
    assert sorted(rows) == list(range(8)) and metrics["perf/zero_weight_skipped_frac"] == 0.0
    assert metrics[FLAT_STEPS] == 0 and metrics["train/optimizer_steps"] == 1  # the KL term has a gradient
    monitor = make_learner([*OVERRIDES, "kl.monitor=true"], tmp_path / "monitor")
    data = batch(3, 2)
    rows, metrics = forwarded_rows(monitor, monkeypatch, data, 1)
    assert sorted(rows) == [4, 5, 6, 7]
    assert len(data.ref_log_probs) == 8 and all(torch.isfinite(r).all() and len(r) for r in data.ref_log_probs)
    assert "train/kl" in metrics


# --- 2 gloo DDP ranks: each rank its own rows (fixed layout), or the step spread over the ranks by tokens ------


def _rank_main(rank: int, port: int, output_dir: str, results: dict, body: Callable) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    try:
        body(rank, output_dir, results)
    except BaseException:
        results[("error", rank)] = traceback.format_exc()
        raise
    finally:
        dist.destroy_process_group()


def two_gloo_ranks(body: Callable, output_dir: Path) -> dict:
    """`body(rank, output_dir, results)` (a module-level function) on 2 spawned gloo ranks: what they put in
    `results`, none of it an error."""
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(_rank_main, args=(free_port(), str(output_dir), shared, body), nprocs=2)
        results = dict(shared)
    assert not [key for key in results if key[0] == "error"], results
    return results


def _ranks(rank: int, output_dir: str, results: dict) -> None:
    from grpo_cli.batch.rollout_data import select_completions

    ddp = [*OVERRIDES, "distributed=ddp", "distributed.nproc_per_node=2"]
    for name, overrides, budget, loss_type, masked in (
        ("fixed", ddp, None, "grpo_clip", True),
        ("tokens", [*ddp, "train.microbatch_tokens=40"], 40, "no_baseline", False),
    ):
        learner = make_learner(overrides, Path(output_dir) / f"{name}{rank}")
        for skip in (False, True):
            configure(learner, skip, loss_type, "token_mean", masked, budget)
            for step, flat in ((1, 0), (2, 2)):
                whole = with_old(learner, batch(seed=step, flat_groups=flat), seed=10 + step, masked=masked)
                # rank 0 holds groups 0-1 (flat at step 2), rank 1 groups 2-3: rank 0 computes nothing at step 2
                # under reinforce-like weights, and joins with dummies
                metrics, _ = learner.learn(select_completions(whole, [0, 1, 2, 3] if rank == 0 else [4, 5, 6, 7]), step)
            params = {n: full_tensor(p.detach()).clone() for n, p in learner.model.named_parameters()}
            results[(name, skip, rank)] = ([dict(g) for g in learner.captured], params, metrics)


@pytest.mark.machine_wide
def test_two_ddp_ranks_skipping_zero_weight_rows_give_the_same_parameters(tmp_path) -> None:
    results = two_gloo_ranks(_ranks, tmp_path)
    for name in ("fixed", "tokens"):
        for rank in (0, 1):
            assert_same(results[(name, True, rank)], results[(name, False, rank)])
            assert results[(name, True, rank)][2]["perf/zero_weight_skipped_frac"] > 0
        assert_same(results[(name, True, 1)], results[(name, True, 0)])  # the ranks agree
