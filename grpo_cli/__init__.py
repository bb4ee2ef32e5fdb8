"""grpo-cli: a command-line experiment runner for GRPO fine-tuning of language models."""

__version__ = "0.1.0"
