"""distributed=fsdp on two gloo ranks of this CPU: what the learner computes under FSDP2 is what one process
computes. The sampling copy after a resume, the old and reference log-probs in the training forward's numerics
(bf16 included), and LoRA's reference (the base model) under FSDP2.

Two ranks, spawned once for the module, build real Learners from the composed config (model=tiny_random) and feed
them a small hand-made rollout batch: no generation, so the learner's own numbers are what is compared. Each case
runs on both ranks in turn; a case that raises reports its error to its test instead of stopping the others."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grpo_cli.batch.rollout_data import RolloutData
from grpo_cli.distributed import parallel
from tests.conftest import compose_config
from tests.unit.distributed.test_distributed import free_port

# torch.distributed ranks on a rendezvous port, a resource of the machine (tests/conftest.py, "Parallel workers")
pytestmark = pytest.mark.machine_wide

# Per rank: one group of 4 completions of one prompt; lengths differ, so the microbatches of several rows pad.
RANK_SHARE = [
    "model=tiny_random",
    "distributed=fsdp",
    "train.rollout_batch_size=8",
    "train.group_size=4",
]


def rank_batch(rank: int, vocab: int = 1000) -> RolloutData:
    """This rank's scored rollout batch: random token ids (a random model gives them no special status)."""
    generator = torch.Generator().manual_seed(100 + rank)
    prompt = torch.randint(3, vocab, (6,), generator=generator).tolist()
    completions = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (3, 5, 8, 6)]
    return RolloutData(
        prompt_ids=[prompt] * 4,
        completion_ids=completions,
        raw_rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]),
        advantages=torch.tensor([0.9, -0.7, 1.1, -1.3]),
    )


def _on_two_ranks(rank: int, port: int, tmp: str, results: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    # A rank whose case failed leaves the other waiting in a collective: the timeout ends that wait.
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(minutes=3))
    torch.set_num_threads(1)  # two ranks on two shared cores
    try:
        for name, case in CASES.items():
            (Path(tmp) / name).mkdir(exist_ok=True)
            try:
                results[(name, rank)] = case(rank, Path(tmp) / name)
            except Exception as error:  # noqa: BLE001 - reported to the case's test
                traceback.print_exc()
                results[(name, rank)] = {"error": f"{type(error).__name__}: {error}"}
            if parallel.any_rank("error" in results[(name, rank)]):
                break  # the ranks' collectives may be out of step: run nothing more
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """Every case's result on each rank: {case: {rank: result}} (one spawn of two ranks for the module)."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_on_two_ranks, args=(free_port(), str(tmp_path_factory.mktemp("fsdp")), results), nprocs=2)
        results = dict(results)
    return {name: {rank: results.get((name, rank), {"error": "not run"}) for rank in (0, 1)} for name in CASES}


def results_of(two_ranks: dict, case: str) -> dict:
    for rank, result in two_ranks[case].items():
        assert "error" not in result, (rank, result["error"])
    return two_ranks[case]


def record_loss_inputs(learner_module) -> list[dict[str, torch.Tensor]]:
    """Spy on the learner's train step: each microbatch's current, old and reference log-probs (masked tokens)."""
    from grpo_cli.core import microbatch_train_step as real

    seen: list[dict[str, torch.Tensor]] = []

    def spy(policy_log_probs, response_mask, gradient_accumulation_steps, settings, **kwargs):
        mask = response_mask.bool()
        tensors = {"current": policy_log_probs, "old": kwargs.get("old_log_probs"), "ref": kwargs.get("ref_log_probs")}
        seen.append({name: t.detach()[mask].clone() for name, t in tensors.items() if t is not None})
        return real(policy_log_probs, response_mask, gradient_accumulation_steps, settings, **kwargs)

    learner_module.microbatch_train_step = spy
    return seen


# --- 1. a resume refreshes the copy every rank samples from ------------------------------------------------------


def _resume_case(rank: int, tmp: Path) -> dict:
    from grpo_cli.learner.learner import Learner

    cfg = compose_config([*RANK_SHARE, "model.mixed_precision=no"], output_dir=str(tmp))
    trained = Learner(cfg, tmp)
    with torch.no_grad():  # a checkpoint whose weights are not the initial ones (every rank shifts its shard)
        for parameter in trained.model.parameters():
            parameter.add_(0.05)
    trained.save_checkpoint(2, {"sampler": {}})
    resumed = Learner(cfg, tmp)
    initial = {name: p.detach().clone() for name, p in resumed.inference_model.named_parameters()}
    resumed.resume()
    sampling = dict(resumed.inference_model.named_parameters())
    trained_now = {name: parallel.full_tensor(p.detach()) for name, p in resumed.model.named_parameters()}
    return {
        "sampling_vs_trained": max((sampling[n] - t).abs().max().item() for n, t in trained_now.items()),
        "trained_vs_initial": max((t - initial[n]).abs().max().item() for n, t in trained_now.items()),
    }


def test_after_a_resume_every_rank_samples_from_the_restored_weights(two_ranks):
    for rank, result in results_of(two_ranks, "resume").items():
        assert result["trained_vs_initial"] == pytest.approx(0.05, abs=1e-6), rank  # the checkpoint was loaded
        assert result["sampling_vs_trained"] == 0.0, (rank, result)


# --- 2. old and reference log-probs in the training forward's numerics ------------------------------------------


def _ratio_case(rank: int, tmp: Path) -> dict:
    import grpo_cli.learner.learner as learner_module
    from grpo_cli.learner.learner import Learner

    found = {}
    for precision in ("bf16", "no"):
        # sync=multi_epoch: old log-probs once, 2 epochs of 1 optimizer step each; one completion per microbatch,
        # so the first update's microbatches are the old pass's, whatever order the epoch shuffles them into.
        cfg = compose_config(
            [
                *RANK_SHARE,
                f"model.mixed_precision={precision}",
                "loss=grpo_clip",
                "sync=multi_epoch",
                "train.train_batch_size=8",
                "train.gradient_accumulation_steps=8",
                "kl.beta=0.04",
                "optim.lr=1e-3",
            ],
            output_dir=str(tmp),
        )
        learner = Learner(cfg, tmp)
        with torch.no_grad():  # a peaked softmax, as a trained policy has (a random one's is near uniform)
            for policy in (learner.model, learner.reference):
                policy.model.norm.weight.mul_(10)
        learner.refresh_inference_copy()
        seen = record_loss_inputs(learner_module)
        learner.learn(rank_batch(rank), step=1)
        first_update = seen[: learner.shape.gradient_accumulation_per_rank]
        assert len(first_update) == 4 and len(seen) == 8
        ratios = torch.cat([torch.exp(mb["current"] - mb["old"]) for mb in first_update])
        # Before the first optimizer step the policy is the reference: their log-probs must agree too.
        ref_gap = torch.cat([(mb["current"] - mb["ref"]).abs() for mb in first_update])
        later = torch.cat([torch.exp(mb["current"] - mb["old"]) for mb in seen[4:]])
        found[precision] = {
            "ratio_min": ratios.min().item(),
            "ratio_max": ratios.max().item(),
            "ref_gap": ref_gap.max().item(),
            "later_ratio_spread": (later - 1).abs().max().item(),
        }
    return found


def test_the_first_update_of_a_multi_epoch_batch_has_ratio_one_in_bf16_and_fp32(two_ranks):
    for rank, found in results_of(two_ranks, "ratio").items():
        bf16, fp32 = found["bf16"], found["no"]
        assert 1 - 1e-3 <= bf16["ratio_min"] <= bf16["ratio_max"] <= 1 + 1e-3, (rank, found)
        assert bf16["ref_gap"] <= 1e-3, (rank, found)
        assert fp32["ratio_min"] == fp32["ratio_max"] == 1.0, (rank, found)
        assert fp32["ref_gap"] == 0.0, (rank, found)
        # the second epoch runs on updated weights: the ratios are not 1 by construction
        assert bf16["later_ratio_spread"] > 1e-2 and fp32["later_ratio_spread"] > 1e-2, (rank, found)


# --- 3. LoRA + FSDP2 + KL: the reference is the base model --------------------------------------------------------


def _lora_reference_case(rank: int, tmp: Path) -> dict:
    import grpo_cli.learner.learner as learner_module
    from grpo_cli.batch.forward import ScoringSettings, per_completion_log_probs
    from grpo_cli.core import LOGITS_CHUNK_TOKENS
    from grpo_cli.learner.learner import Learner
    from grpo_cli.models import build_policy
    from grpo_cli.models.runtime import seed_everything

    overrides = [*RANK_SHARE, "model.mixed_precision=no", "kl.beta=0.04", "train.gradient_accumulation_steps=2"]
    cfg = compose_config([*overrides, "model.lora.enabled=true"], output_dir=str(tmp))
    learner = Learner(cfg, tmp)
    with torch.no_grad():  # adapters that change the policy (LoRA starts with B = 0, the base model itself)
        for name, parameter in learner.model.named_parameters():
            if "lora_B" in name:
                parameter.add_(0.2)
    seen = record_loss_inputs(learner_module)
    data = rank_batch(rank)
    metrics, _ = learner.learn(data, step=1)
    # The independent computation: the base model, built as a run without LoRA builds it, in one process.
    base_cfg = compose_config([*overrides, "model.lora.enabled=false"], output_dir=str(tmp))
    seed_everything(base_cfg.seed)
    base, tokenizer = build_policy(base_cfg.model, torch.device("cpu"))
    scoring = ScoringSettings(
        temperature=1.0,
        share_prompts=False,
        logits_chunk_tokens=LOGITS_CHUNK_TOKENS,
        microbatch_size=2,
        pad_token_id=tokenizer.pad_token_id,
    )
    expected = per_completion_log_probs(base, data, torch.device("cpu"), scoring)
    return {
        "ref_vs_base": max((r - e).abs().max().item() for r, e in zip(data.ref_log_probs, expected, strict=True)),
        "policy_vs_base": max((mb["current"] - mb["ref"]).abs().max().item() for mb in seen),
        "kl": metrics["train/kl"],
        "steps": metrics["train/optimizer_steps"],
    }


def test_lora_with_kl_trains_under_fsdp_against_the_base_model(two_ranks):
    for rank, result in results_of(two_ranks, "lora_reference").items():
        assert result["ref_vs_base"] <= 1e-5, (rank, result)
        assert result["policy_vs_base"] > 1e-3, (rank, result)  # the adapters were on for the policy
        assert result["steps"] == 1 and result["kl"] > 0, (rank, result)


CASES = {"resume": _resume_case, "ratio": _ratio_case, "lora_reference": _lora_reference_case}
