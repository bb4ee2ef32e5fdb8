"""`python -m grpo_cli.tasks.config_reference > docs/config-reference.md` writes the config reference page
(config/reference.py renders it), and `... --fill <page>...` rewrites the generated key tables of docs pages.

The command lives here, in the tasks package, because the page lists every task's keys: running this module
imports grpo_cli.tasks first (its package), which registers the task schemas in the config's registry; the config
itself never imports a task.
"""

from __future__ import annotations

from grpo_cli.config.reference import main

if __name__ == "__main__":
    main()
