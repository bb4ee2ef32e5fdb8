"""Jobs that tests/unit/distributed/test_distributed.py launches on real ranks through
grpo_cli.distributed.launch (each rank
imports this module by name, as it imports grpo_cli.jobs.train)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console

from grpo_cli.distributed import parallel
from grpo_cli.errors import UserFacingError


def run(cfg: Any, output_dir: Path, console: Console) -> dict[str, Any]:
    """Rank 1 fails with a user error; rank 0 waits for it at a collective that never completes."""
    world = parallel.world()
    if world.rank == 1:
        time.sleep(0.5)
        raise UserFacingError("task.train_path=/data/missing.jsonl does not exist: give an existing JSONL file")
    parallel.barrier()
    return {"rank": world.rank}
