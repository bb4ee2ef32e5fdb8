"""Scoring: the scored rollout batch (batch.py), which rows go in which microbatch (microbatches.py) and the one
scoring forward (forward.py) with its settings (settings.py). Below both the rollout worker, which builds the batch
and scores its behaviour log-probs, and the learner, which trains on it: neither imports the other."""
