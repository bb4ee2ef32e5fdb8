"""A run's trained model out (docs/after-training.md): a checkpoint exported as a Hugging Face folder (config,
generation config, tokenizer and chat template, safetensors weights, a model card), LoRA merged or as a PEFT
adapter, pushed to the Hub in one commit; `<run>/model/` at the end of every training run (run_end.py).

Layer: jobs -> export -> drivers and below (the learner's checkpoints, the models' loading, the engines' weights).
"""

from grpo_cli.export.model import Exported, export_checkpoint, export_run
from grpo_cli.export.source import RunCheckpoint, find_checkpoint, trained_policy

__all__ = ["Exported", "RunCheckpoint", "export_checkpoint", "export_run", "find_checkpoint", "trained_policy"]
