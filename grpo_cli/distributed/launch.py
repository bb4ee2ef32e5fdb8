"""Starting the ranks of a data-parallel job (distributed=ddp|fsdp) with torch.distributed's elastic launcher.

`grpo-run distributed=ddp distributed.nproc_per_node=4` composes the config and picks the run directory once,
then starts the ranks here (what torchrun does, from inside the job). Under an external `torchrun` or `srun`
(RANK and WORLD_SIZE in the environment) nothing is started: each process joins the group as the rank it is.

Each rank reports how it ended in <run dir>/ranks/rank<N>.json, so the launching process can print the one-line
error a single process would print, whichever rank failed first. A rank that fails exits non-zero, and the
elastic agent then stops every other rank (max_restarts=0); a rank also dies with the process that launched it.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from grpo_cli.config import BatchShape
from grpo_cli.distributed import parallel
from grpo_cli.errors import (
    EXIT_INTERNAL_ERROR,
    EXIT_USER_ERROR,
    RunStopped,
    UserFacingError,
    error_summary,
    write_traceback,
)
from grpo_cli.models.runtime import resolve_device

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

    from grpo_cli.config.schemas import DistributedConfig, GRPOConfig

_PR_SET_PDEATHSIG = 1


def run_distributed(module: str, cfg: GRPOConfig, output_dir: Path, console: Console) -> dict[str, Any]:
    """Run job `module` (its `run(cfg, output_dir, console)`) on every rank; returns rank 0's summary (on a node
    of a multi-node run without rank 0, its own first rank's)."""
    if parallel.launched_as_rank():
        return _run_rank(module, cfg, output_dir, console)
    return _launch_ranks(module, cfg, output_dir)


def rendezvous_id(d: DistributedConfig, output_dir: Path) -> str:
    """The c10d rendezvous id of this run, the same on every node: distributed.rdzv_id when given, else derived
    from what every node of the run is given, the rendezvous endpoint (master_addr:master_port) and the run
    directory. Another run directory or endpoint is another run, which never joins this one's rendezvous."""
    if d.rdzv_id:
        return str(d.rdzv_id)
    key = f"{d.master_addr}:{d.master_port}|{Path(output_dir).absolute()}"
    return "grpo-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def launch_config(cfg: GRPOConfig, output_dir: Path) -> LaunchConfig:
    """The elastic launcher's settings for distributed.*: c10d rendezvous at master_addr:master_port under the
    run's rendezvous_id, no restarts. On one node the rendezvous and the ranks' MASTER_ADDR stay on the loopback
    address (the host's name may resolve to an address other processes cannot reach, or one outside this
    machine). On several, node 0 hosts the rendezvous store, and a node waits distributed.rdzv_timeout_s for all
    of them (join_timeout)."""
    from torch.distributed.launcher.api import LaunchConfig

    d = cfg.distributed
    rdzv_configs: dict[str, int | bool] = {"join_timeout": d.rdzv_timeout_s}
    if d.nnodes > 1:
        rdzv_configs["is_host"] = d.node_rank == 0
    return LaunchConfig(
        min_nodes=d.nnodes,
        max_nodes=d.nnodes,
        nproc_per_node=d.nproc_per_node,
        run_id=rendezvous_id(d, output_dir),
        rdzv_backend="c10d",
        rdzv_endpoint=f"{d.master_addr}:{d.master_port}",
        rdzv_configs=rdzv_configs,
        max_restarts=0,
        monitor_interval=0.2,
        start_method="spawn",
        # On SIGINT/SIGTERM the agent forwards the signal and gives the ranks this long to finish the step and
        # write its checkpoint (they agree to stop after the same step) before it kills them.
        shutdown_timeout=300,
        local_addr=d.master_addr if d.nnodes == 1 else None,
    )


def rendezvous_failure(d: DistributedConfig, run_id: str, error: BaseException) -> str:
    """The one line of a node that could not start: what it waited for, where, and how to fix it."""
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousTimeoutError

    node = f"node {d.node_rank} of distributed.nnodes={d.nnodes}"
    where = f"the rendezvous {d.master_addr}:{d.master_port} (id {run_id})"
    same = (
        "start grpo-run on every node with the same distributed.master_addr, master_port, nnodes and hydra.run.dir "
        "(or one distributed.rdzv_id)"
    )
    if isinstance(error, RendezvousTimeoutError):
        return (
            f"{node} waited {d.rdzv_timeout_s} s at {where} for all {d.nnodes} nodes to join, and they did not: "
            f"{same}, or wait longer with distributed.rdzv_timeout_s=N"
        )
    cause = error_summary(error.__cause__ or error, limit=200)
    if isinstance(error, RendezvousConnectionError) and d.nnodes > 1 and d.node_rank == 0:
        return f"{node} could not host {where} ({cause}): pick a free distributed.master_port on this machine"
    if isinstance(error, RendezvousConnectionError):
        return (
            f"{node} waited {d.rdzv_timeout_s} s for node 0's store of {where} and could not reach it: start node 0 "
            f"(distributed.node_rank=0) on {d.master_addr}; {same}, or wait longer with distributed.rdzv_timeout_s=N"
        )
    return f"{node} failed at {where} ({error_summary(error, limit=150)}): {same}"


def _launch_ranks(module: str, cfg: GRPOConfig, output_dir: Path) -> dict[str, Any]:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    # The agent logs a multi-page report for every failed rank; the rank's own one line is what users need.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    reports = output_dir / "ranks"
    reports.mkdir(parents=True, exist_ok=True)
    for old in reports.glob("rank*.json"):  # a resumed run's earlier outcome is not this one's
        old.unlink()
    from torch.distributed.elastic.rendezvous import RendezvousError

    config = launch_config(cfg, output_dir)
    try:
        if cfg.distributed.nnodes > 1 and cfg.distributed.node_rank != 0:
            _wait_for_node_0(cfg.distributed)
        results = elastic_launch(config, _rank_main)(module, cfg, str(output_dir))
    except RendezvousError as error:  # before any rank started: the nodes did not meet
        raise UserFacingError(rendezvous_failure(cfg.distributed, config.run_id, error)) from None
    except (ChildFailedError, Exception) as error:  # noqa: BLE001 - the ranks' own reports say what happened
        _raise_rank_outcome(reports, error)
    return results[min(results)]  # keyed by global rank: rank 0's on its node, this node's first rank elsewhere


def _wait_for_node_0(d: DistributedConfig) -> None:
    """Wait (up to distributed.rdzv_timeout_s) until node 0's rendezvous store accepts this node, with torch's own
    store client, before the elastic agent joins. The agent would wait the same way, but its store client prints
    each failed try as pages of C++ stack frames on stderr: a node started before node 0 waits quietly here, and
    one left alone ends with one line (RendezvousConnectionError, rendezvous_failure)."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    try:
        with _stderr_silenced():
            store = TCPStore(d.master_addr, d.master_port, is_master=False, timeout=timedelta(seconds=d.rdzv_timeout_s))
    except (RuntimeError, ValueError, TimeoutError) as error:  # torch's DistNetworkError is a RuntimeError
        raise RendezvousConnectionError(str(error)) from error
    del store  # the agent connects again, at once now


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """File descriptor 2 to /dev/null for the block: what C++ code logs there too (no rank runs yet)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _rank_main(module: str, cfg: GRPOConfig, output_dir: str) -> dict[str, Any]:
    """One rank, started by the elastic agent: the job, with its outcome written down for the launcher."""
    _die_with_parent()
    # Out of the terminal's process group: a Ctrl-C reaches the ranks once, forwarded by the agent, instead of
    # twice (directly and forwarded), which would read as "press Ctrl-C again to stop at once".
    os.setpgrp()
    world_rank = int(os.environ["RANK"])
    console = Console(highlight=False, soft_wrap=True, quiet=world_rank != 0)
    report = Path(output_dir) / "ranks" / f"rank{world_rank}.json"
    try:
        return _run_rank(module, cfg, Path(output_dir), console)
    except UserFacingError as error:
        _report(report, "error", str(error), EXIT_USER_ERROR)
        raise SystemExit(EXIT_USER_ERROR) from None
    except RunStopped as error:
        _report(report, "stopped", str(error), error.exit_code)
        raise SystemExit(error.exit_code) from None
    except BaseException as error:
        _report_crash(report, world_rank, error)
        raise


def _run_rank(module: str, cfg: GRPOConfig, output_dir: Path, console: Console) -> dict[str, Any]:
    d = cfg.distributed
    world = parallel.init_process_group(d.backend, resolve_device(cfg.model.device).type, d.timeout_min)
    try:
        expected = BatchShape.from_config(cfg).ranks
        if world.size != expected:
            raise UserFacingError(
                f"the launcher started {world.size} ranks but distributed.nproc_per_node x distributed.nnodes = "
                f"{expected}: set them to match (the step's work is split into that many equal shares)"
            )
        # Under torchrun each process composed its own config and may have picked its own run directory.
        output_dir = Path(parallel.broadcast_object(str(output_dir)))
        if not world.is_main:
            console = Console(quiet=True)
        return importlib.import_module(module).run(cfg, output_dir, console)
    finally:
        parallel.destroy_process_group()


def _report(path: Path, kind: str, message: str, exit_code: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"kind": kind, "message": message, "exit_code": exit_code}))


def _report_crash(report: Path, world_rank: int, error: BaseException) -> None:
    """A rank's bug: its traceback in ranks/rank<N>.log beside the report, the report naming it."""
    log = write_traceback(error, report.with_suffix(".log"))
    message = f"rank {world_rank} failed ({error_summary(error, limit=200)}); traceback in {log}"
    _report(report, "crash", message, EXIT_INTERNAL_ERROR)


def _raise_rank_outcome(reports: Path, error: BaseException) -> None:
    """The one line a single process would have ended with: a rank's own error or stop first (the ranks that
    only failed because a peer left report a crash at their collective), else the earliest crash."""
    outcomes = [json.loads(path.read_text()) | {"mtime": path.stat().st_mtime} for path in reports.glob("rank*.json")]
    if not outcomes:
        first_line = (str(error).splitlines() or [""])[0][:200]
        raise RunStopped(
            f"the ranks stopped without a report ({type(error).__name__}: {first_line})",
            exit_code=EXIT_INTERNAL_ERROR,
        ) from None
    outcome = min(outcomes, key=lambda o: (o["kind"] == "crash", o["mtime"]))
    if outcome["kind"] == "error":
        raise UserFacingError(outcome["message"]) from None
    raise RunStopped(outcome["message"], exit_code=int(outcome["exit_code"])) from None


def _die_with_parent() -> None:
    """Linux: this rank gets SIGKILL when the process that launched it dies (even by SIGKILL), so no rank
    outlives its run waiting at a collective."""
    # Not Linux: no prctl, and the agent's own shutdown still stops the ranks.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
