"""The Learner computes no layout (issue #59): the update's microbatches, divisors, skipped rows and the rows of
the old and reference passes come from one plan (batch/plan.py), made once per update; the Learner has none of
the layout methods it used to compute them with, and its update walks the plan it is given."""

from __future__ import annotations

import inspect

import torch

from grpo_cli.batch.plan import OptimizerStep, build_update_plan
from grpo_cli.batch.rollout_data import RolloutData
from tests.conftest import compose_config

OVERRIDES = [
    "debug=smoke",
    "model.mixed_precision=no",
    "train.rollout_batch_size=8",
    "train.train_batch_size=4",  # two optimizer steps per update
    "train.gradient_accumulation_steps=2",
    "loss=grpo_clip",
    "sync=multi_epoch",  # a ratio loss off-policy: the old pass runs
    "kl.monitor=true",  # the reference pass runs
]
LAYOUT_METHODS = (
    "_positions",
    "_step_microbatches",
    "_per_rank_microbatches",
    "_scoring_microbatches",
    "_without_empty_rows",
)


def batch() -> RolloutData:
    generator = torch.Generator().manual_seed(5)
    return RolloutData(
        [[1, 2, 3]] * 2 + [[4, 5]] * 2 + [[6, 7, 8, 9]] * 2 + [[10, 11]] * 2,
        [torch.randint(3, 200, (n,), generator=generator).tolist() for n in (3, 5, 2, 6, 4, 4, 7, 1)],
        raw_rewards=torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0]),
        advantages=torch.tensor([0.7, -0.7, 0.0, 0.0, 0.7, -0.7, 0.0, 0.0]),
    )


def test_the_learner_has_no_layout_methods_and_its_source_calls_no_layout_function() -> None:
    from grpo_cli.learner import learner as module

    assert not [name for name in LAYOUT_METHODS if hasattr(module.Learner, name)]
    source = inspect.getsource(module)
    for layout in ("token_microbatches", "fixed_microbatches", "rank_shares", "equalize(", "positions_processed"):
        assert layout not in source, f"learner.py computes a layout: {layout}"


def test_one_plan_per_update_built_once_and_walked_as_planned(tmp_path, monkeypatch) -> None:
    from grpo_cli.learner import learner as module

    learner = module.Learner(compose_config(OVERRIDES, output_dir=str(tmp_path)), tmp_path)
    built, walked, scored = [], [], []

    def counting_build(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        plan = build_update_plan(*args, **kwargs)
        built.append(plan)
        return plan

    step = module.Learner._optimizer_step

    def recording_step(self, data, planned: OptimizerStep, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        walked.append([mb.rows for mb in planned.microbatches])
        return step(self, data, planned, *args, **kwargs)

    log_probs_under = module.Learner.log_probs_under

    def recording_pass(self, model, data, microbatches, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        scored.append([list(mb) for mb in microbatches])
        return log_probs_under(self, model, data, microbatches, *args, **kwargs)

    monkeypatch.setattr(module, "build_update_plan", counting_build)
    monkeypatch.setattr(module.Learner, "_optimizer_step", recording_step)
    monkeypatch.setattr(module.Learner, "log_probs_under", recording_pass)
    for step_number in (1, 2):
        metrics, _ = learner.learn(batch(), step_number)
        assert len(built) == step_number  # once per update
    plan = built[-1]
    assert len(plan.steps) == 2 * learner.shape.epochs_per_rollout_batch
    # The update walked exactly the plan's steps that train, in order, as laid out.
    trained = [[mb.rows for mb in planned.microbatches] for p in built for planned in p.steps if planned.trains]
    assert walked == trained
    # Rows 2, 3, 6, 7 weigh 0: not computed by any step, nor scored by the old pass; kl.monitor: the reference
    # pass scores every row.
    assert all(row not in (2, 3, 6, 7) for step_rows in walked for mb in step_rows for row in mb)
    assert len(scored) == 4  # per update: the old pass, then the reference pass
    old, reference = scored[-2], scored[-1]
    assert sorted(r for mb in old for r in mb) == [0, 1, 4, 5]
    assert sorted(r for mb in reference for r in mb) == list(range(8))
    assert metrics["perf/zero_weight_skipped_frac"] == 0.5
