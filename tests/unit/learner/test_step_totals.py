"""token_mean over an optimizer step: the gradient of 2 microbatches, and of 2 gloo ranks (DDP) each with 2
microbatches, is the gradient of 1 microbatch in 1 process (responses of unequal lengths, so a per-microbatch
normalization would differ). Also with rollout.importance_correction=masked and old log-probs, whose rejected
tokens leave the step's token total (learner.rejected_token_counts) as they leave one microbatch's own count."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grpo_cli.batch.rollout_data import RolloutData, make_microbatch
from grpo_cli.core import grpo_microbatch_train_step
from grpo_cli.distributed import parallel
from grpo_cli.learner.accounting import optimizer_step_totals, rejected_token_counts

VOCAB = 11
# 8 completions of lengths 1..8 after a 2-token prompt; advantages of both signs
PROMPTS = [[1, 2]] * 8
COMPLETIONS = [[(3 + i + j) % VOCAB for j in range(i + 1)] for i in range(8)]
ADVANTAGES = torch.tensor([1.0, -0.5, 2.0, -1.0, 0.3, -2.0, 0.7, 1.5])


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 6)
        self.head = torch.nn.Linear(6, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        log_probs = torch.log_softmax(self.head(torch.tanh(self.embed(input_ids))), dim=-1)
        return log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (B, T)


# Old and sampler log-probs per completion, the sampler's off by N(0, 0.6) nats: the masked correction (band
# [1/2, 2]) rejects some tokens at the token level and some whole responses at the sequence level.
_generator = torch.Generator().manual_seed(0)
OLD = [-1.0 - torch.rand(len(c), generator=_generator) for c in COMPLETIONS]
SAMPLER = [old + 0.6 * torch.randn(len(old), generator=_generator) for old in OLD]


def masked_correction(level: str) -> SimpleNamespace:
    return SimpleNamespace(
        importance_correction="masked", importance_level=level, importance_threshold=2.0, importance_threshold_low=None
    )


def data(importance: SimpleNamespace | None = None) -> RolloutData:
    batch = RolloutData(PROMPTS, COMPLETIONS, torch.zeros(8), ADVANTAGES.clone())
    if importance is not None:
        batch.old_log_probs, batch.sampler_log_probs = OLD, SAMPLER
    return batch


def step_arguments(mb: dict[str, torch.Tensor], importance: SimpleNamespace | None) -> dict:
    """The train step's importance arguments, as the learner passes them."""
    if importance is None:
        return {}
    return {
        "old_log_probs": mb["old_log_probs"],
        "sampler_log_probs": mb["sampler_log_probs"],
        "importance_correction": importance.importance_correction,
        "importance_level": importance.importance_level,
        "importance_threshold": importance.importance_threshold,
    }


def accumulate(
    model: torch.nn.Module,
    rows: list[int],
    microbatches: list[list[int]],
    mode: str,
    importance: SimpleNamespace | None = None,
    count_rejected: bool = True,
) -> None:
    """One optimizer step's backward passes over `microbatches` (subsets of this rank's `rows`), as the learner
    takes them: each microbatch's share of the step's loss, divided by the step's totals."""
    batch = data(importance)
    rejected = rejected_token_counts(batch, importance) if importance is not None and count_rejected else None
    step_sequences, step_tokens = optimizer_step_totals(batch, rows, rejected)
    for indices in microbatches:
        mb = make_microbatch(batch, indices, pad_token_id=0, device=torch.device("cpu"))
        policy_log_probs = model(mb["input_ids"], mb["labels"])
        grpo_microbatch_train_step(
            policy_log_probs,
            mb["response_mask"],
            len(microbatches),
            "reinforce_with_baseline",
            advantages=mb["advantages"],
            length_normalization=mode,
            normalize_constant=8.0,
            step_sequences=step_sequences,
            step_tokens=step_tokens,
            **step_arguments(mb, importance),
        )


def one_batch_gradient(mode: str, importance: SimpleNamespace | None = None) -> torch.Tensor:
    """One microbatch of the whole batch, normalized by its own counts (no step totals)."""
    model = TinyLM()
    batch = data(importance)
    mb = make_microbatch(batch, list(range(8)), pad_token_id=0, device=torch.device("cpu"))
    grpo_microbatch_train_step(
        model(mb["input_ids"], mb["labels"]),
        mb["response_mask"],
        1,
        "reinforce_with_baseline",
        advantages=mb["advantages"],
        length_normalization=mode,
        normalize_constant=8.0,
        **step_arguments(mb, importance),
    )
    return model.head.weight.grad.clone()


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean", "constant"])
def test_two_unequal_microbatches_give_the_one_batch_gradient(mode: str) -> None:
    model = TinyLM()
    accumulate(model, list(range(8)), [[0, 1, 2, 7], [3, 4, 5, 6]], mode)
    torch.testing.assert_close(model.head.weight.grad, one_batch_gradient(mode))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean", "constant"])
def test_masked_importance_rejections_leave_the_step_totals_exactly(mode: str, level: str) -> None:
    importance = masked_correction(level)
    rejected = rejected_token_counts(data(importance), importance)
    assert 0 < sum(rejected) < sum(map(len, COMPLETIONS))  # some tokens rejected, some kept
    model = TinyLM()
    accumulate(model, list(range(8)), [[0, 1, 2, 7], [3, 4, 5, 6]], mode, importance)
    torch.testing.assert_close(model.head.weight.grad, one_batch_gradient(mode, importance))


def test_rejected_tokens_left_in_the_step_total_would_not() -> None:
    # The check above can fail: a step total that still counts the rejected tokens gives another gradient.
    importance = masked_correction("token")
    model = TinyLM()
    accumulate(model, list(range(8)), [[0, 1, 2, 7], [3, 4, 5, 6]], "token_mean", importance, count_rejected=False)
    assert not torch.allclose(model.head.weight.grad, one_batch_gradient("token_mean", importance))


def test_a_per_microbatch_token_mean_would_not() -> None:
    # The check above can fail: normalizing each microbatch by its own tokens gives another gradient.
    model = TinyLM()
    batch = data()
    for indices in ([0, 1, 2, 7], [3, 4, 5, 6]):
        mb = make_microbatch(batch, indices, pad_token_id=0, device=torch.device("cpu"))
        grpo_microbatch_train_step(
            model(mb["input_ids"], mb["labels"]),
            mb["response_mask"],
            2,
            "reinforce_with_baseline",
            advantages=mb["advantages"],
            length_normalization="token_mean",
        )
    assert not torch.allclose(model.head.weight.grad, one_batch_gradient("token_mean"))


def _two_ranks(rank: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = parallel.wrap_for_training(TinyLM(), "ddp", torch.device("cpu"), None)
        # rank 0 holds the short responses, rank 1 the long ones: unequal token counts per rank
        rows = [[0, 1, 2, 3], [4, 5, 6, 7]][rank]
        inner = model.module

        def forward(input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return model(input_ids, labels)

        for name, importance in (("plain", None), ("masked", masked_correction("token"))):
            inner.zero_grad(set_to_none=True)
            with model.no_sync():  # the learner's accumulation: gradients averaged once, after the last microbatch
                accumulate(forward, rows, [rows[:1]], "token_mean", importance)
            accumulate(forward, rows, [rows[1:]], "token_mean", importance)
            results[(rank, name)] = inner.head.weight.grad.clone()
    finally:
        dist.destroy_process_group()


@pytest.mark.machine_wide
def test_two_gloo_ranks_with_two_microbatches_each_give_the_one_process_gradient() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_two_ranks, args=(port, results), nprocs=2)
        results = dict(results)
    expected = {
        "plain": one_batch_gradient("token_mean"),
        "masked": one_batch_gradient("token_mean", masked_correction("token")),
    }
    assert len(results) == 4
    for (_rank, name), gradient in results.items():
        torch.testing.assert_close(gradient, expected[name])
