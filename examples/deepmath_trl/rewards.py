"""The TRL script's own reward function, copied unchanged: grpo-cli passes it what TRL passes (completions as
messages for this conversational data, log_metric, ...)."""


def one_boxed_answer(completions, log_metric, **kwargs):
    """1 when the answer is boxed exactly once; logs the fraction that box anything."""
    counts = [c[0]["content"].count("\\boxed{") for c in completions]
    log_metric("boxed_frac", sum(n > 0 for n in counts) / len(counts))
    return [1.0 if n == 1 else 0.0 for n in counts]
