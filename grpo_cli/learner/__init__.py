"""The learner: scores rollouts with the policy, takes optimizer steps (`learner`), holds the rollout batch
and its microbatches (`batch`), and saves and restores the training state (`checkpoint`)."""
