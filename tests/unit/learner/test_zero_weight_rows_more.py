"""train.skip_zero_weight_rows beyond tests/unit/learner/test_zero_weight_rows.py's setups: LoRA adapters, several
optimizer steps per rollout batch with old log-probs the learner scores itself (sync=multi_epoch), sync=async's
decoupled PPO (a behaviour log-prob per sampled token, the proximal log-probs recomputed by the learner), and
distributed=fsdp on 2 gloo ranks, full weights and LoRA (one rank's rows all flat, so it computes only the dummy
microbatch; a 100%-flat step). In each, the gradients of every optimizer step and the parameters after them with
skipping equal those of the same learner computing every row (fp32; the comparison of the first file: gradients to
5e-5 of their scale, parameters to 1e-6), and the update logs the same metric names either way. The old/proximal
pass leaves the skipped rows out (NaN), except under the masked correction, whose token divisor counts every row's
rejected tokens."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from grpo_cli.batch.rollout_data import RolloutData, select_completions
from grpo_cli.distributed.parallel import full_tensor
from grpo_cli.learner.accounting import FLAT_STEPS, rejected_token_counts
from tests.unit.learner.test_zero_weight_rows import (
    OVERRIDES,
    assert_same,
    batch,
    configure,
    first_update,
    make_learner,
    second_update,
    two_gloo_ranks,
    zero_weight_share,
)

LORA = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8"]
# 2 optimizer steps per epoch of the 8-row batch (microbatches of 2 rows): the second step's ratio is not 1, and
# with the epoch's shuffle a step of the 50%-flat batch can be all flat (both arms then take no optimizer step).
TWO_STEPS = ["train.train_batch_size=4"]


def with_behaviour(learner, data: RolloutData, seed: int, noise: float = 1.5) -> RolloutData:
    """`data` with a sampler (behaviour) log-prob per token: the learner's current ones off by N(0, noise) nats, so
    under sync=async pi_prox / pi_behav varies (some tokens over sync.behaviour_weight_cap) and under the masked
    correction some tokens are rejected. Old log-probs are not given: the learner scores them (old or proximal)."""
    generator = torch.Generator().manual_seed(seed)
    current = learner.log_probs_under(learner.model, data, [list(range(len(data.completion_ids)))])
    data.sampler_log_probs = [c + noise * torch.randn(len(c), generator=generator) for c in current]
    return data


def reset(learner) -> None:
    """The learner back at its initial weights, a fresh AdamW, no gradients captured."""
    with torch.no_grad():
        for name, parameter in learner.model.named_parameters():
            parameter.copy_(learner.initial[name])
    learner.optimizer.state.clear()
    learner.captured.clear()


def updates(learner, prepare: Callable[[RolloutData, int], RolloutData], flat_groups: int) -> tuple:
    """From the initial weights, a non-flat update then one with `flat_groups` flat groups, each batch `prepare`d
    (its behaviour log-probs) just before its update: (gradients of every optimizer step, the parameters after
    them, the second update's metrics, the second update's batch as the learner left it)."""
    reset(learner)
    learner.learn(prepare(batch(seed=1, flat_groups=0), 11), 1)
    data = prepare(batch(seed=2, flat_groups=flat_groups), 12)
    metrics, _ = learner.learn(data, 2)
    after = {n: full_tensor(p.detach()).clone() for n, p in learner.model.named_parameters()}
    return [dict(g) for g in learner.captured], after, metrics, data


def assert_same_update(got: tuple, expected: tuple) -> None:
    """The gradients and parameters equal (assert_same), and the metric names too."""
    assert_same(got[:3], expected[:3])
    assert got[2].keys() == expected[2].keys(), set(got[2]) ^ set(expected[2])


def scored_rows(data: RolloutData) -> list[int]:
    """The rows the update's old/proximal pass scored (a row it left out holds NaN)."""
    assert data.old_log_probs is not None
    return [i for i, row in enumerate(data.old_log_probs) if not bool(torch.isnan(row).any())]


def rejected_in_flat_rows(learner, data: RolloutData) -> int:
    """The masked correction's rejected tokens among `data`'s rows of advantage 0 (its every row scored): where
    there are some, the step's token divisor needs those rows' old log-probs though no step computes them."""
    rejected = rejected_token_counts(data, learner.loss)
    assert rejected is not None
    return sum(count for count, advantage in zip(rejected, data.advantages.tolist(), strict=True) if advantage == 0)


# --- LoRA: only the adapters train; skipping leaves their gradients as they were ---------------------------------


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    learner = make_learner([*OVERRIDES, *LORA], tmp_path_factory.mktemp("lora"))
    assert all(("lora_" in n) == p.requires_grad for n, p in learner.model.named_parameters())
    return learner


@pytest.mark.parametrize(
    ("loss_type", "normalization", "masked", "budget"),
    [("grpo_clip", "token_mean", True, 40), ("no_baseline", "sequence_mean", False, None)],
)
def test_lora_skipping_leaves_the_adapters_gradients_and_parameters(lora, loss_type, normalization, masked, budget):
    after_first: dict[bool, tuple] = {}
    for skip in (False, True):  # each arm's own first update where it skips rows (no_baseline: rewards of 0)
        if skip and not zero_weight_share(loss_type, batch(seed=1, flat_groups=0)):
            after_first[skip] = after_first[False]
            continue
        configure(lora, skip, loss_type, normalization, masked, budget)
        after_first[skip] = first_update(lora, masked)
    for flat_groups in (0, 2, 4):
        runs: dict[bool, tuple] = {}
        for skip in (False, True):
            configure(lora, skip, loss_type, normalization, masked, budget)
            runs[skip] = second_update(lora, after_first[skip], flat_groups, masked)
        assert_same(runs[True], runs[False])
        assert runs[True][2].keys() == runs[False][2].keys()
        assert all("lora_" in name for grads in runs[True][0] for name in grads)  # only the adapters have gradients
        share = zero_weight_share(loss_type, batch(seed=2, flat_groups=flat_groups))
        assert runs[True][2]["perf/zero_weight_skipped_frac"] == pytest.approx(share)


# --- several optimizer steps per rollout batch, old log-probs scored by the learner --------------------------------


def test_multi_epoch_with_old_log_probs_scored_by_the_learner(tmp_path) -> None:
    learner = make_learner([*OVERRIDES, *TWO_STEPS, "loss=grpo_clip", "sync=multi_epoch"], tmp_path / "multi_epoch")
    assert learner.shape.optimizer_steps_per_rollout_batch == 4 and learner.needs_old_log_probs
    for loss_type, masked in (("grpo_clip", False), ("cispo", True)):

        def prepare(data: RolloutData, seed: int, masked: bool = masked) -> RolloutData:
            return with_behaviour(learner, data, seed) if masked else data

        for flat_groups in (2, 4):
            runs = {}
            for skip in (False, True):
                configure(learner, skip, loss_type, "token_mean", masked, None)
                runs[skip] = updates(learner, prepare, flat_groups)
            assert_same_update(runs[True], runs[False])
            skipped = [i for i in range(8) if i < 2 * flat_groups]
            assert runs[True][2]["perf/zero_weight_skipped_frac"] == pytest.approx(flat_groups / 4)
            # the old pass scored what some step computes; every row under the masked correction (its divisor)
            assert scored_rows(runs[False][3]) == list(range(8))
            expected = list(range(8)) if masked else [i for i in range(8) if i not in skipped]
            assert scored_rows(runs[True][3]) == expected
            assert not masked or rejected_in_flat_rows(learner, runs[False][3]) > 0
            # 4 optimizer steps of the non-flat update, then those of the second not all flat (every one at 100%)
            steps = len(runs[False][0])
            assert 4 < steps <= 8 if flat_groups == 2 else steps == 4
            assert runs[True][2][FLAT_STEPS] == runs[False][2][FLAT_STEPS] == 8 - steps


# --- sync=async: decoupled PPO, the proximal log-probs recomputed by the learner ------------------------------------


def test_async_proximal_pass_and_decoupled_update(tmp_path) -> None:
    for correction in ("none", "masked"):
        learner = make_learner(
            [*OVERRIDES, *TWO_STEPS, "loss=grpo_clip", "sync=async", f"rollout.importance_correction={correction}"],
            tmp_path / correction,
        )
        assert learner.loss.decoupled and learner.needs_old_log_probs
        masked = correction == "masked"

        def prepare(data: RolloutData, seed: int, learner=learner) -> RolloutData:
            return with_behaviour(learner, data, seed)

        for flat_groups in (2, 4):
            runs = {}
            for skip in (False, True):
                configure(learner, skip, "grpo_clip", "token_mean", masked, None)
                runs[skip] = updates(learner, prepare, flat_groups)
            assert_same_update(runs[True], runs[False])
            if flat_groups == 2:  # the decoupled weight acted: pi_prox / pi_behav over the cap zeroes some tokens
                key = "train/importance_masked_frac" if masked else "train/behaviour_capped_frac"
                assert runs[True][2][key] > 0 and runs[False][2][key] > 0
            # the proximal pass scores what some step computes; every row under the masked correction
            expected = list(range(8)) if masked else list(range(2 * flat_groups, 8))
            assert scored_rows(runs[True][3]) == expected and scored_rows(runs[False][3]) == list(range(8))
            assert not masked or rejected_in_flat_rows(learner, runs[False][3]) > 0


# --- distributed=fsdp, 2 gloo ranks -----------------------------------------------------------------------------


def sharded_scoring(learner) -> None:
    """The test's own log-probs (with_behaviour) through the learner's FSDP2 scorer: its parameters are shards,
    gathered by the sharded module's forward (a collective every rank makes)."""
    plain = learner.log_probs_under

    def log_probs_under(model, data, microbatches=None, fsdp_scorer=None):  # noqa: ANN001, ANN202
        return plain(model, data, microbatches, fsdp_scorer or learner.scorer)

    learner.log_probs_under = log_probs_under


def _fsdp_ranks(rank: int, output_dir: str, results: dict) -> None:
    torch.set_num_threads(1)  # two ranks on two shared cores
    fsdp = [*OVERRIDES, "distributed=fsdp", "distributed.nproc_per_node=2", "sync.old_log_probs=true"]
    for name, overrides, budget, loss_type, masked in (
        ("fixed", fsdp, None, "grpo_clip", True),
        ("tokens", [*fsdp, "train.microbatch_tokens=40"], 40, "no_baseline", False),
        # FSDP over a LoRA model: the sharded adapters are all that trains, and a rank whose rows are all flat
        # must still take part in their gradients' reduce-scatter through its dummy microbatch.
        ("lora", [*fsdp, *LORA], None, "grpo_clip", False),
    ):
        learner = make_learner(overrides, Path(output_dir) / f"{name}{rank}")
        sharded_scoring(learner)
        for skip in (False, True):
            configure(learner, skip, loss_type, "token_mean", masked, budget)
            metrics = []
            for step, flat in ((1, 0), (2, 2), (3, 4)):
                whole = batch(seed=step, flat_groups=flat)
                whole = with_behaviour(learner, whole, seed=10 + step) if masked else whole
                # rank 0 holds groups 0-1 (flat at step 2: under a baselined loss it computes only the dummy),
                # rank 1 groups 2-3; step 3 is all flat (under no_baseline group 0 still weighs 1)
                mine = select_completions(whole, [0, 1, 2, 3] if rank == 0 else [4, 5, 6, 7])
                metrics.append(learner.learn(mine, step)[0])
                if masked:
                    metrics[-1]["rows_scored"] = len(scored_rows(mine))
                    metrics[-1]["rejected_in_flat_rows"] = rejected_in_flat_rows(learner, mine)
            params = {n: full_tensor(p.detach()).clone() for n, p in learner.model.named_parameters()}
            results[(name, skip, rank)] = ([dict(g) for g in learner.captured], params, metrics)


@pytest.mark.machine_wide
def test_two_fsdp_ranks_skipping_zero_weight_rows_give_the_same_parameters(tmp_path) -> None:
    results = two_gloo_ranks(_fsdp_ranks, tmp_path)
    for name in ("fixed", "tokens", "lora"):
        for rank in (0, 1):
            assert_same(results[(name, True, rank)], results[(name, False, rank)])
        for step in range(3):  # the same metric names with skipping on and off, on every rank
            names = {frozenset(results[(name, skip, rank)][2][step]) for skip in (False, True) for rank in (0, 1)}
            assert len(names) == 1, (name, step, names)
        assert_same(results[(name, True, 1)], results[(name, True, 0)])  # the ranks agree
    lora_grads, _, lora_metrics = results[("lora", True, 0)]
    assert all("lora_" in name for grads in lora_grads for name in grads)  # only the adapters have gradients
    assert any(float(value.abs().max()) > 0 for grads in lora_grads for value in grads.values())
    assert [m["perf/zero_weight_skipped_frac"] for m in lora_metrics] == [0.0, 0.5, 1.0]
    fixed = {rank: results[("fixed", True, rank)][2] for rank in (0, 1)}
    # step 2: rank 0's rows all flat (only the dummy computed), rank 1's not; the step trains on both ranks
    assert [m["perf/zero_weight_skipped_frac"] for m in fixed[0]] == [0.0, 0.5, 1.0]
    assert [m["train/optimizer_steps"] for m in fixed[0]] == [1, 1, 0] == [m["train/optimizer_steps"] for m in fixed[1]]
    assert [m[FLAT_STEPS] for m in fixed[0]] == [0, 0, 1]
    # the masked correction's old pass scores every row of the rank, flat or not
    assert all(m["rows_scored"] == 4 for rank in (0, 1) for m in fixed[rank])
    assert fixed[0][1]["rejected_in_flat_rows"] > 0  # rank 0's divisor at step 2 needs its flat rows' old log-probs
    assert not math.isnan(fixed[0][1]["train/loss"])
