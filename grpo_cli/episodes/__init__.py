"""Non-model turns: tools and their tool-call formats, environments, the built-in tools, the
episode's turns as tokens (turns.py), the task's multi-turn keys loaded and checked (config.py), and adapters/ for
other libraries' environments (TRL, OpenRLHF).
Untrusted code reaches the sandbox (grpo_cli.sandbox) only through a tool that asks for it."""
