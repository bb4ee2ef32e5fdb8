"""LoRA on the tiny model: only adapters train, the reference costs no copy, checkpoints hold only adapters."""

import torch
from rich.console import Console
from safetensors.torch import load_file

from grpo_cli.config import validate_config
from grpo_cli.drivers.loop import TrainingLoop
from grpo_cli.learner.checkpoint import list_checkpoints, load_checkpoint
from grpo_cli.models import TINY_RANDOM, apply_lora, load_policy
from grpo_cli.tracking import read_metrics
from tests.conftest import compose_config

LORA = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8"]


def trainer_for(tmp_path, overrides):
    # letter_e: a reward that varies across a random model's samples, so the adapters get a gradient
    cfg = compose_config(
        [
            "debug=smoke",
            "task.name=letter_e",
            "train.rollout_batch_size=16",
            "train.group_size=8",
            "train.train_batch_size=16",
            *LORA,
            *overrides,
        ],
        output_dir=str(tmp_path),
    )
    validate_config(cfg)
    return TrainingLoop(cfg, tmp_path, Console(quiet=True))


def test_only_adapter_weights_change_and_kl_starts_at_zero(tmp_path, letter_e_task):
    loop = trainer_for(tmp_path, ["kl.beta=0.5", "optim.lr=1e-2", "train.steps=3", "train.eval_every=0"])
    learner = loop.executor.learner
    assert learner.reference is None  # no second copy: the reference is the base with adapters off
    before = {name: p.detach().clone() for name, p in learner.model.named_parameters()}
    loop.run()
    changed = {name for name, p in learner.model.named_parameters() if not torch.equal(before[name], p)}
    assert changed, "nothing trained"
    assert all("lora_" in name for name in changed)
    assert all(p.requires_grad == ("lora_" in name) for name, p in learner.model.named_parameters())
    kls = [r["train/kl"] for r in read_metrics(tmp_path / "metrics.jsonl") if "train/kl" in r]
    assert kls[0] == 0.0  # LoRA's B starts at zero: policy == reference exactly until the first update
    assert kls[-1] > 0.0


def test_checkpoint_holds_only_adapters_and_reloads_into_the_base_model(tmp_path, letter_e_task):
    loop = trainer_for(tmp_path, ["kl.beta=0.5", "optim.lr=1e-2", "train.steps=2", "train.eval_every=0"])
    loop.run()
    learner = loop.executor.learner
    (checkpoint, *_) = list_checkpoints(tmp_path)[-1:]
    tensors = load_file(str(checkpoint / "model.safetensors"))
    assert tensors and all("lora_" in name for name in tensors)

    base, tokenizer = load_policy(TINY_RANDOM, torch.device("cpu"), torch.float32, seed=0)
    fresh = apply_lora(base, r=4, alpha=8, dropout=0.0, target_modules=loop.cfg.model.lora.target_modules)
    optimizer = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad])
    load_checkpoint(checkpoint, fresh, optimizer)
    ids = torch.tensor([tokenizer("hello there")["input_ids"]])
    learner.model.eval()
    torch.testing.assert_close(fresh(ids).logits, learner.model(ids).logits)
