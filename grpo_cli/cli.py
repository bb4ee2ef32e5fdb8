"""`grpo-run`: the Hydra entrypoint. Composes and validates the config, then dispatches the job.

This is the only module that touches Hydra: it reads what it needs (output dir, the resolved config) once and
hands plain objects to the job functions.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from grpo_cli.config import BatchShape, GRPOConfig, register_configs, validate_config
from grpo_cli.errors import UserFacingError

EXIT_USER_ERROR = 2


def _fail(message: str) -> None:
    print(f"grpo-run: error: {message}", file=sys.stderr)
    sys.exit(EXIT_USER_ERROR)


def _check_output_dir(output_dir: Path) -> None:
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / ".write_probe"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserFacingError(
            f"output directory {output_dir} is not writable ({e.strerror}): "
            "pass a writable output_dir=... or hydra.run.dir=..."
        ) from None


def run_job(cfg: GRPOConfig, console: Console) -> dict[str, Any]:
    """Validate, print the batch shapes, then run the job. Raises UserFacingError on bad input."""
    from grpo_cli.models import check_model_source
    from grpo_cli.tasks import load_examples
    from grpo_cli.tracking.console import shape_table

    validate_config(cfg)
    output_dir = Path(cfg.output_dir)
    _check_output_dir(output_dir)
    # Everything that can be checked without loading a model is checked now: a bad data file or model path
    # must fail in a second, not after a minute of loading.
    check_model_source(cfg.model.name_or_path)
    for split in ("train", "eval") if cfg.job.name == "train" else ("eval",):
        load_examples(cfg.task, split)

    if cfg.job.name == "train":
        shape = BatchShape.from_config(cfg)
        console.print(shape_table(shape.rows(), title=f"batch shapes ({cfg.sync.strategy}, {cfg.loss.type})"))
        from grpo_cli.train import GRPOTrainer

        summary = GRPOTrainer(cfg, output_dir, console).train()
        console.print(
            f"done: eval reward {summary['baseline/eval_reward']:.3f} (step 0) -> {summary['eval/reward']:.3f} "
            f"(step {cfg.train.steps}); metrics in {output_dir / 'metrics.jsonl'}",
            highlight=False,
        )
        return summary
    if cfg.job.name == "baseline_eval":
        from grpo_cli.evaluate import run_baseline_eval

        return run_baseline_eval(cfg, output_dir, console)
    raise UserFacingError(f"job={cfg.job.name} is not a known job")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def _hydra_main(dict_cfg: DictConfig) -> None:
    console = Console(highlight=False, soft_wrap=True)
    try:
        # to_object resolves interpolations and checks types against the schema dataclasses.
        cfg: GRPOConfig = OmegaConf.to_object(dict_cfg)  # type: ignore[assignment]
        output_dir = Path(cfg.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(OmegaConf.to_yaml(dict_cfg, resolve=True))
        run_job(cfg, console)
    except UserFacingError as e:
        _fail(str(e))


def main() -> None:
    # transformers' per-load progress bars would drown our own output (set the variable to 0 to get them back).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    register_configs()
    _hydra_main()


if __name__ == "__main__":
    main()
