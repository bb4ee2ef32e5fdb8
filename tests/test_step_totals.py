"""token_mean over an optimizer step: the gradient of 2 microbatches, and of 2 gloo ranks (DDP) each with 2
microbatches, is the gradient of 1 microbatch in 1 process (responses of unequal lengths, so a per-microbatch
normalization would differ)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grpo_cli import parallel
from grpo_cli.batch import RolloutData, make_microbatch
from grpo_cli.core import grpo_microbatch_train_step
from grpo_cli.learner import optimizer_step_totals

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


def data() -> RolloutData:
    return RolloutData(PROMPTS, COMPLETIONS, torch.zeros(8), ADVANTAGES.clone())


def accumulate(model: torch.nn.Module, rows: list[int], microbatches: list[list[int]], mode: str) -> None:
    """One optimizer step's backward passes over `microbatches` (subsets of this rank's `rows`), as the learner
    takes them: each microbatch's share of the step's loss, divided by the step's totals."""
    batch = data()
    step_sequences, step_tokens = optimizer_step_totals(batch, rows)
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
        )


def one_batch_gradient(mode: str) -> torch.Tensor:
    model = TinyLM()
    batch = data()
    mb = make_microbatch(batch, list(range(8)), pad_token_id=0, device=torch.device("cpu"))
    grpo_microbatch_train_step(
        model(mb["input_ids"], mb["labels"]),
        mb["response_mask"],
        1,
        "reinforce_with_baseline",
        advantages=mb["advantages"],
        length_normalization=mode,
        normalize_constant=8.0,
    )
    return model.head.weight.grad.clone()


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean", "constant"])
def test_two_unequal_microbatches_give_the_one_batch_gradient(mode: str) -> None:
    model = TinyLM()
    accumulate(model, list(range(8)), [[0, 1, 2, 7], [3, 4, 5, 6]], mode)
    torch.testing.assert_close(model.head.weight.grad, one_batch_gradient(mode))


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

        with model.no_sync():  # the learner's accumulation: gradients averaged once, after the last microbatch
            accumulate(forward, rows, [rows[:1]], "token_mean")
        accumulate(forward, rows, [rows[1:]], "token_mean")
        results[rank] = inner.head.weight.grad.clone()
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_with_two_microbatches_each_give_the_one_process_gradient() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_two_ranks, args=(port, results), nprocs=2)
        results = dict(results)
    expected = one_batch_gradient("token_mean")
    for gradient in results.values():
        torch.testing.assert_close(gradient, expected)
