"""The composed config: groups compose, schemas reject typos, cross-field rules fail with one clear line."""

import pytest

from grpo_cli.config import BatchShape, validate_config
from grpo_cli.errors import UserFacingError
from tests.conftest import compose_config


def test_defaults_compose_and_validate():
    cfg = compose_config([])
    validate_config(cfg)
    assert cfg.model.name == "smollm2_135m"
    assert cfg.task.name == "keyword"
    assert cfg.loss.type == "reinforce_with_baseline"
    assert cfg.job.name == "train"


def test_groups_compose_with_key_overrides():
    cfg = compose_config(
        [
            "loss=grpo_clip",
            "sync=multi_epoch",
            "normalization=dr_grpo",
            "loss.cliprange=0.1",
            "optim.lr=3e-6",
            "train.steps=5",
        ]
    )
    validate_config(cfg)
    assert (cfg.loss.type, cfg.loss.cliprange, cfg.optim.lr, cfg.train.steps) == ("grpo_clip", 0.1, 3e-6, 5)
    assert (cfg.normalization.advantage, cfg.normalization.length) == ("mean", "constant")
    assert cfg.sync.epochs_per_rollout_batch == 2


def test_debug_smoke_switches_to_the_tiny_model():
    cfg = compose_config(["debug=smoke"])
    validate_config(cfg)
    assert cfg.model.name_or_path == "random:tiny-llama" and cfg.train.steps == 2


@pytest.mark.parametrize("override", ["optim.lrr=1e-5", "train.steps=ten", "loss=ppo", "model.foo=1"])
def test_schema_rejects_typos_wrong_types_and_unknown_choices(override):
    with pytest.raises(Exception) as info:  # noqa: PT011 - Hydra raises several types here
        compose_config([override])
    assert override.split("=")[0].split(".")[-1] in str(info.value) or "ppo" in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["train.rollout_batch_size=10", "train.group_size=4"],
            "train.rollout_batch_size=10 is not divisible by train.group_size=4",
        ),
        (
            ["train.gradient_accumulation_steps=3"],
            "train.train_batch_size=16 is not divisible by train.gradient_accumulation_steps=3",
        ),
        (["train.train_batch_size=2", "train.gradient_accumulation_steps=1"], "smaller than train.group_size"),
        (["sync=multi_epoch"], "use loss=grpo_clip"),
        (["sync.epochs_per_rollout_batch=2", "loss=grpo_clip"], "sync=on_policy takes one optimizer step"),
        (["train.group_size=1", "train.rollout_batch_size=16"], "train.group_size>=2"),
        (["loss.type=ppo"], "loss.type=ppo is not one of no_baseline, reinforce_with_baseline, grpo_clip"),
        (["rollout.min_tokens=100"], "rollout.min_tokens=100 exceeds rollout.max_tokens=48"),
        (["rollout.temperature=0"], "temperature > 0"),
        (["optim.lr=0"], "optim.lr=0.0 must be positive"),
    ],
)
def test_invalid_combinations_fail_with_one_line_naming_the_fields(overrides, message):
    cfg = compose_config(overrides)
    with pytest.raises(UserFacingError) as info:
        validate_config(cfg)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_batch_shape_arithmetic():
    cfg = compose_config(
        [
            "loss=grpo_clip",
            "sync=multi_epoch",
            "train.rollout_batch_size=32",
            "train.group_size=8",
            "train.train_batch_size=16",
            "train.gradient_accumulation_steps=4",
        ]
    )
    validate_config(cfg)
    shape = BatchShape.from_config(cfg)
    # 32 completions / 8 per group = 4 prompts; 2 epochs x 32/16 train batches = 4 optimizer steps
    assert shape.prompts_per_rollout_batch == 4
    assert shape.microbatch_size == 4
    assert shape.optimizer_steps_per_rollout_batch == 4
    assert dict(shape.rows())["max generated tokens per step"] == 32 * 48
