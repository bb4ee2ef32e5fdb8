"""grpo-cli's Hydra launcher: every job of a multirun in a new Python process (`hydra/launcher=processes`)."""

__version__ = "0.1.0"
