"""Trusted user code, run in killable workers: importing a user's functions (user_code.py), the
worker processes they run in (reward_workers.py), the time limit (timelimit.py), the one place async user
code is awaited (awaiting.py), and a task.agent's function run per episode (agents.py). No torch."""
