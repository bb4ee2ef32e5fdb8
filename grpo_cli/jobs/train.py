"""`job=train` (the default): GRPO training, evaluated at step 0, every train.eval_every steps and at the end."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from grpo_cli.config import BatchShape
from grpo_cli.drivers.loop import TrainingLoop
from grpo_cli.tracking.console import shape_table

if TYPE_CHECKING:
    from grpo_cli.config.schemas import GRPOConfig


def run(cfg: GRPOConfig, output_dir: Path, console: Console) -> dict[str, Any]:
    shape = BatchShape.from_config(cfg)
    console.print(shape_table(shape.rows(), title=f"batch shapes ({cfg.sync.strategy}, {cfg.loss.type})"))
    summary = TrainingLoop(cfg, output_dir, console).run()
    if "eval/reward" not in summary:  # a rank other than 0: rank 0 evaluates and reports
        return summary
    console.print(
        f"done: eval reward {summary['baseline/eval_reward']:.3f} (step 0) -> {summary['eval/reward']:.3f} "
        f"(step {cfg.train.steps}); metrics in {output_dir / 'metrics.jsonl'}",
        highlight=False,
    )
    return summary
