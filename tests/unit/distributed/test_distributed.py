"""distributed=ddp|fsdp on this CPU (gloo, fp32): the same steps as one process, checkpoints any number of ranks
can resume, one-line errors, and no rank outliving its run."""

from __future__ import annotations

import json
import os
import random
import socket
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from grpo_cli.config import BatchShape, validate_config
from grpo_cli.distributed import parallel
from grpo_cli.distributed.launch import launch_config, run_distributed
from grpo_cli.drivers.executor import finish_step_metrics, step_metrics
from grpo_cli.errors import EXIT_INTERNAL_ERROR, RunStopped, UserFacingError
from tests.conftest import compose_config

# The acceptance setting: 3 steps, 16 rollouts in groups of 4, 2 microbatches, fp32, a reward that varies on a
# random model (lipogram's answer reward), so the updates are not zero.
SETTING = [
    "model=tiny_random",
    "model.mixed_precision=no",
    "task=lipogram",
    "task.reward_weights.correctness=0",
    "task.reward_weights.answer=1",
    "task.n_train=32",
    "task.n_eval=4",
    "train.steps=3",
    "train.rollout_batch_size=16",
    "train.group_size=4",
    "train.train_batch_size=16",
    "train.gradient_accumulation_steps=2",
    "train.eval_every=0",
    "rollout.max_tokens=8",
    "optim.lr=1e-2",
]


def free_port() -> int:
    """A rendezvous port that is free now and that no other process is handed before the ranks bind it: one below
    the kernel's ephemeral range. A port found free by binding port 0 lies inside that range, where any server
    binding port 0 or any outgoing connection (the other xdist worker's tests) may be given it first: the ranks'
    store then fails to start, or a rank connects to a stranger (rank 0 was seen to abort under two workers)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    candidates = list(range(max(1024, low - 8192), low))
    random.SystemRandom().shuffle(candidates)
    for port in candidates:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no such range on this kernel: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- configuration: one line, before anything loads -------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["distributed=ddp", "sync=one_behind"], "does not combine with distributed=ddp"),
        (
            ["distributed=ddp", "rollout=vllm", "rollout.tensor_parallel_size=2"],
            "each rank runs its own vLLM engine",
        ),
        (
            ["distributed=ddp", "rollout=vllm", "rollout.openai_server=vllm"],
            "use rollout.openai_server=grpo_cli \\(an endpoint per rank\\)",
        ),
        (["rollout=vllm", "rollout.openai_server=vllm", "sync=one_behind"], "not started inside the generator"),
        (
            [
                "distributed=ddp",
                "train.rollout_batch_size=12",
                "train.group_size=4",
                "train.train_batch_size=12",
                "train.gradient_accumulation_steps=2",
            ],
            "splits into 2 equal shares .* run with train.rollout_batch_size=16 train.train_batch_size=16 "
            "train.gradient_accumulation_steps=4 ",
        ),
        (["distributed=fsdp", "train.gradient_accumulation_steps=1"], "run with train.gradient_accumulation_steps=2 "),
        (["distributed.nproc_per_node=2"], "need distributed=ddp or distributed=fsdp"),
    ],
)
def test_combinations_that_cannot_work_are_one_line(overrides, message):
    cfg = compose_config(["debug=smoke", "train.rollout_batch_size=8", "train.train_batch_size=8", *overrides])
    with pytest.raises(UserFacingError, match=message) as info:
        validate_config(cfg)
    assert "\n" not in str(info.value)


def test_rank_shares_keep_the_one_process_microbatch():
    cfg = compose_config([*SETTING, "distributed=ddp"])
    shape = BatchShape.from_config(cfg)
    assert (shape.ranks, shape.prompts_per_rank, shape.train_batch_per_rank) == (2, 2, 8)
    assert (shape.microbatch_size, shape.gradient_accumulation_per_rank) == (8, 1)


def test_one_node_rendezvous_stays_on_the_loopback_address():
    cfg = compose_config(["distributed=ddp"])
    config = launch_config(cfg, Path("test"))
    assert config.rdzv_endpoint.startswith("127.0.0.1:") and config.local_addr == "127.0.0.1"
    assert config.max_restarts == 0 and config.nproc_per_node == 2


def test_each_ranks_share_samples_the_completions_one_process_samples():
    from grpo_cli.rollout.worker import RolloutWorker
    from grpo_cli.tasks import load_examples

    cfg = compose_config([*SETTING, "rollout.max_tokens=12"])
    worker = RolloutWorker(cfg)
    examples = load_examples(cfg.task, "train")[:4]
    whole = worker.produce(examples, batch_number=3)
    # Two ranks: each takes half of the step's prompts and says where its share starts.
    shares = [worker.produce(examples[r * 2 : r * 2 + 2], batch_number=3, first_prompt_index=r * 2) for r in (0, 1)]
    assert [ids for share in shares for ids in share.completion_ids] == whole.completion_ids
    assert len({tuple(ids) for ids in whole.completion_ids}) > 1  # real samples, not one repeated completion


# --- the collectives, on a real two-process gloo group ----------------------------------------------------------


def _collectives(rank: int, port: int, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        metrics = {
            "train/reward": [0.25, 0.75][rank],
            "train/response_length_max": [5.0, 9.0][rank],
            "time/step_s": [1.0, 3.0][rank],
            "train/reward_errors": [1.0, 2.0][rank],
        }
        values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]][rank])
        # One step's line as InProcessExecutor.step builds it on each rank: this rank's generated tokens and times.
        rollout = {"train/reward": 0.5, "n_tokens": [30.0, 50.0][rank], "time/generation_s": [2.0, 4.0][rank]}
        learned = {"train/loss": 0.1, "time/old_log_probs_s": 0.0}
        timing = {"time/step_s": [5.0, 8.0][rank], "time/waiting_s": 1.0}
        line = finish_step_metrics(step_metrics(rollout, learned, timing, {}), values)
        results[rank] = (
            parallel.reduce_metrics(metrics),
            parallel.reduce_std(values),
            parallel.any_rank(rank == 1),
            parallel.broadcast_object(f"dir-of-rank-{rank}"),
            line,
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.machine_wide
def test_metrics_combine_over_ranks_as_one_batch_would():
    port = free_port()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_collectives, args=(port, results), nprocs=2)
        results = dict(results)
    for metrics, std, anyone, broadcast, line in results.values():
        assert metrics == {
            "train/reward": 0.5,  # mean of equal shares
            "train/response_length_max": 9.0,  # the largest
            "time/step_s": 3.0,  # the slowest rank sets the pace
            "train/reward_errors": 3.0,  # counts add up
        }
        assert std == pytest.approx(torch.arange(1.0, 7.0).std().item())
        assert anyone is True and broadcast == "dir-of-rank-0"
        # Throughput is every rank's tokens (30 + 50) over the step's time (the slowest rank's, 8 s; generation 4 s),
        # not one rank's rate.
        assert line["throughput/tokens_per_s"] == pytest.approx(80 / 8)
        assert line["throughput/generation_tokens_per_s"] == pytest.approx(80 / 4)
        assert "n_tokens" not in line and line["time/step_s"] == 8.0
        assert line["train/reward_std"] == pytest.approx(torch.arange(1.0, 7.0).std().item())


class TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _fsdp_gradient(rank: int, port: int, strategy: str, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = parallel.wrap_for_training(TwoLayers(), strategy, torch.device("cpu"), None)
        x = torch.arange(32.0).reshape(8, 4) / 10
        model(x[rank * 4 : (rank + 1) * 4]).pow(2).mean().backward()  # this rank's half of the batch
        inner = getattr(model, "module", model)  # DDP wraps, FSDP2 shards in place
        results[rank] = parallel.full_tensor(inner.layers[0].weight.grad).clone()
    finally:
        dist.destroy_process_group()


@pytest.mark.machine_wide
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_averaged_gradient_over_two_gloo_ranks_is_the_one_process_gradient(strategy):
    # PyTorch issue 162338: FSDP2 over gloo summed gradients instead of averaging them in some versions (a
    # silent 2x); this fails on such a version.
    torch.manual_seed(0)
    single = TwoLayers()
    single(torch.arange(32.0).reshape(8, 4) / 10).pow(2).mean().backward()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_fsdp_gradient, args=(free_port(), strategy, results), nprocs=2)
        results = dict(results)
    for gradient in results.values():
        torch.testing.assert_close(gradient, single.layers[0].weight.grad)


# --- real runs through grpo-run ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.machine_wide
@pytest.mark.alone  # asserts rank 0 stopped within 120 s
def test_a_failing_rank_stops_every_rank_with_its_one_line_error(tmp_path):
    cfg = compose_config(["debug=smoke", "distributed=ddp", f"distributed.master_port={free_port()}"])
    started = time.monotonic()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(UserFacingError) as info:
        run_distributed("tests.distributed_jobs", cfg, tmp_path, None)
    assert str(info.value) == "task.train_path=/data/missing.jsonl does not exist: give an existing JSONL file"
    assert time.monotonic() - started < 120  # rank 0 did not wait for its collective's timeout
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    # multiprocessing's resource tracker stays for the life of this (test) process: it is not a rank.
    ranks = [p.pid for p in left if not any("resource_tracker" in part for part in p.cmdline())]
    assert not ranks, f"ranks outlived the failed run: {ranks}"
    report = json.loads((tmp_path / "ranks" / "rank1.json").read_text())
    assert report["kind"] == "error" and report["exit_code"] == 2


def test_a_rank_crash_leaves_its_traceback_and_one_line(tmp_path):
    from grpo_cli.distributed.launch import _raise_rank_outcome, _report_crash

    try:
        raise KeyError("policy.lm_head")
    except KeyError as error:
        _report_crash(tmp_path / "rank1.json", 1, error)
    log = tmp_path / "rank1.log"
    assert "Traceback (most recent call last)" in log.read_text() and "KeyError: 'policy.lm_head'" in log.read_text()
    with pytest.raises(RunStopped) as info:
        _raise_rank_outcome(tmp_path, RuntimeError("ChildFailedError"))
    assert str(info.value) == f"rank 1 failed (KeyError: 'policy.lm_head'); traceback in {log}"
    assert info.value.exit_code == EXIT_INTERNAL_ERROR


def test_run_stopped_reports_keep_their_exit_code(tmp_path):
    from grpo_cli.distributed.launch import _raise_rank_outcome, _report

    _report(tmp_path / "rank0.json", "stopped", "stopped by SIGTERM after step 2; continue with: ...", 143)
    with pytest.raises(RunStopped) as info:
        _raise_rank_outcome(tmp_path, RuntimeError("ChildFailedError"))
    assert info.value.exit_code == 143


def test_nccl_for_ranks_on_the_cpu_is_one_line_before_anything_starts():
    from grpo_cli.jobs.preflight import check_devices_for_ranks

    cfg = compose_config(["debug=smoke", "distributed=ddp", "distributed.backend=nccl", "model.device=cpu"])
    with pytest.raises(UserFacingError, match="distributed.backend=nccl connects GPUs") as info:
        check_devices_for_ranks(cfg)
    assert "\n" not in str(info.value)
    check_devices_for_ranks(compose_config(["debug=smoke", "distributed=ddp", "model.device=cpu"]))  # gloo: fine
