"""The batch: the scored rollout batch (rollout_data.py), which rows go in which microbatch (microbatches.py), one
plan per update of what each optimizer step computes (plan.py), and the one scoring forward (forward.py) with its
settings (settings.py). Below both the rollout worker, which builds the batch and scores its behaviour log-probs, and
the learner, which trains on it: neither imports the other. (Named scoring/ until issue 59: it scores log-probs, not
rewards, which rollout/rewards.py scores.)"""
