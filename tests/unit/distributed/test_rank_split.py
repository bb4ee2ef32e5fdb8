"""distributed=ddp|fsdp distributed.nproc_per_node=N on the shipped configs: it runs as written, or it is refused
once, with every size to change in that one message (a user once needed three runs to learn three sizes)."""

import dataclasses
import re
from pathlib import Path

import pytest

from grpo_cli.config import validate_config
from grpo_cli.config.validation import rank_split_sizes
from grpo_cli.errors import UserFacingError
from tests.conftest import REPO_ROOT, compose_config

PRESETS = [[], ["debug=smoke"]] + [
    [f"experiment={path.stem}"] for path in sorted(Path(REPO_ROOT / "grpo_cli" / "conf" / "experiment").glob("*.yaml"))
]


def _with_ranks(cfg, strategy: str, ranks: int):
    return dataclasses.replace(
        cfg, distributed=dataclasses.replace(cfg.distributed, strategy=strategy, nproc_per_node=ranks)
    )


def _with_train(cfg, **sizes):
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **sizes))


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p[0] if p else "defaults")
def test_every_shipped_config_runs_on_n_ranks_as_written_or_after_the_one_message(preset):
    base = compose_config(preset)
    for strategy, ranks in [("ddp", 2), ("fsdp", 3), ("fsdp", 4), ("ddp", 8), ("fsdp", 8)]:
        cfg = _with_ranks(base, strategy, ranks)
        try:
            validate_config(cfg)
            continue
        except UserFacingError as error:
            message = str(error)
        assert "\n" not in message
        written = dict(re.findall(r"train\.(\w+)=(\d+)(?= |$| \()", message.split("run with ", 1)[1]))
        assert written, message
        validate_config(_with_train(cfg, **{key: int(value) for key, value in written.items()}))  # once is enough


def _splits(rollout: int, train: int, accumulation: int, group: int, ranks: int) -> bool:
    return (rollout // group) % ranks == 0 and accumulation % ranks == 0 and train % accumulation == 0


@pytest.mark.parametrize(
    ("rollout", "group", "train", "accumulation", "ranks"),
    [
        (16, 4, 16, 2, 8),  # the defaults on 8 GPUs
        (16, 4, 8, 2, 4),  # two optimizer steps per rollout batch
        (12, 4, 12, 2, 2),
        (4, 2, 4, 2, 3),
        (256, 8, 256, 128, 8),  # cs336_math: already splits
    ],
)
def test_the_sizes_asked_for_are_the_smallest_that_split(rollout, group, train, accumulation, ranks):
    t = dataclasses.replace(
        compose_config(["debug=smoke"]).train,
        rollout_batch_size=rollout,
        group_size=group,
        train_batch_size=train,
        gradient_accumulation_steps=accumulation,
    )
    sizes = {"rollout_batch_size": rollout, "train_batch_size": train, "gradient_accumulation_steps": accumulation}
    sizes |= rank_split_sizes(t, ranks)
    steps = rollout // train
    assert sizes["rollout_batch_size"] // sizes["train_batch_size"] == steps  # the same updates per batch
    assert _splits(
        sizes["rollout_batch_size"], sizes["train_batch_size"], sizes["gradient_accumulation_steps"], group, ranks
    )
    # independently: no smaller rollout batch of whole groups, with `steps` whole train batches, splits at all
    for smaller in range(rollout, sizes["rollout_batch_size"], group):
        if smaller % steps == 0:
            assert not any(
                _splits(smaller, smaller // steps, g, group, ranks) for g in range(1, smaller // steps + 1)
            ), smaller
    # and the microbatch is no larger than before, where the train batch allows it
    assert sizes["train_batch_size"] // sizes["gradient_accumulation_steps"] <= max(1, train // accumulation) or (
        sizes["gradient_accumulation_steps"] == sizes["train_batch_size"]
    )
