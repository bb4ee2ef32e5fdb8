"""grpo-cli: a command-line experiment runner for GRPO fine-tuning of language models."""

__version__ = "0.1.0"

# Old module paths keep working until grpo-cli 0.3.0, with a note of the new path: grpo_cli/moved.py.
from grpo_cli.moved import install as _install_moved_paths  # noqa: E402

_install_moved_paths()
