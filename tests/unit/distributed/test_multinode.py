"""Several nodes, each started with its own `grpo-run` (docs/distributed.md's recipe), simulated on loopback: the
nodes meet at one rendezvous, take the steps one process takes, and a node left alone stops with one line."""

from __future__ import annotations

from pathlib import Path

from grpo_cli.distributed.launch import launch_config, rendezvous_id
from tests.conftest import compose_config
from tests.unit.distributed.test_distributed import SETTING


def node_args(node_rank: int, port: int, run_dir: Path, extra: list[str] = ()) -> list[str]:
    """What node `node_rank` of 2 is given: the same settings, endpoint and (shared) run directory on both."""
    return [
        *SETTING,
        "distributed=ddp",
        "distributed.nproc_per_node=1",
        "distributed.nnodes=2",
        f"distributed.node_rank={node_rank}",
        "distributed.master_addr=127.0.0.1",
        f"distributed.master_port={port}",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


def test_every_node_derives_the_same_rendezvous_id_from_what_it_is_given(tmp_path):
    run_dir = tmp_path / "run"
    nodes = [compose_config(node_args(i, 29600, run_dir)) for i in (0, 1)]
    ids = [launch_config(cfg, run_dir).run_id for cfg in nodes]
    assert ids[0] == ids[1] == rendezvous_id(nodes[0].distributed, run_dir)
    # another run directory or endpoint is another run, which must not join this one
    assert launch_config(nodes[0], tmp_path / "other").run_id != ids[0]
    assert launch_config(compose_config(node_args(0, 29601, run_dir)), run_dir).run_id != ids[0]
    # named explicitly, it is taken as given (torchrun's --rdzv-id)
    named = compose_config(node_args(1, 29600, run_dir, ["distributed.rdzv_id=exp1"]))
    assert launch_config(named, run_dir).run_id == "exp1"


def test_node_0_hosts_the_rendezvous_and_every_node_waits_the_join_timeout(tmp_path):
    for rank in (0, 1):
        cfg = compose_config(node_args(rank, 29600, tmp_path, ["distributed.rdzv_timeout_s=42"]))
        config = launch_config(cfg, tmp_path)
        assert config.rdzv_configs["join_timeout"] == 42 and config.rdzv_configs["is_host"] == (rank == 0)
        assert (config.min_nodes, config.max_nodes, config.rdzv_endpoint) == (2, 2, "127.0.0.1:29600")
