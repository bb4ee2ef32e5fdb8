"""Scoring completions with the task's reward: a crash or a timeout costs one sample, never the run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from grpo_cli.errors import UserFacingError
from grpo_cli.tasks import OPTIONAL_REWARD_KEYS, REWARD_KEYS, RewardFn, RewardTimeout
from grpo_cli.tasks.rewards import uses_n_tokens
from grpo_cli.tasks.trainer_state import TrainerState

ZERO_REWARD = dict.fromkeys(REWARD_KEYS, 0.0)


class LengthAwareRewardFn(Protocol):
    """A reward function whose `uses_n_tokens` is true (tasks.rewards.uses_n_tokens): it also takes the
    completion's token count."""

    # ground_truth: Any as in RewardFn, whatever the task's examples hold (a number, a string, a record).
    def __call__(self, response: str, ground_truth: Any, n_tokens: int | None = None) -> dict[str, float]: ...


@dataclass
class Scores:
    # One dict per response: the three REWARD_KEYS, plus "unparseable" and "reward/<component>" when the
    # reward function returns them (a missing optional key counts as 0).
    rewards: list[dict[str, float]]
    n_errors: int  # reward-function calls that raised and were scored 0
    n_timeouts: int = 0  # calls that ran past task.reward_timeout_s and were scored 0
    # task=custom's reward functions' log_extra columns (one value per response, None where none was logged; Any:
    # whatever the user's function logs) and log_metric values (TRL 1.16's logging callables).
    extra_columns: dict[str, list[Any]] = field(default_factory=dict)
    logged_metrics: dict[str, list[float]] = field(default_factory=dict)
    # The samples that have no reward at all (an episode whose environment failed under task.on_reward_error=skip):
    # their dicts hold 0.0 placeholders that no mean, loss or advantage statistic reads.
    skipped: list[int] = field(default_factory=list)
    # The samples whose correctness (eval/mean@n, pass@k, maj@n) cannot be derived, each with the reason why.
    no_correctness: dict[int, str] = field(default_factory=dict)

    def mean(self, key: str) -> float:
        """The mean of `key` over the scored samples (the skipped ones left out); 0.0 when none is scored."""
        left_out = set(self.skipped)
        values = [r.get(key, 0.0) for i, r in enumerate(self.rewards) if i not in left_out]
        return sum(values) / max(len(values), 1)

    def component_mean(self, key: str) -> float:
        """The mean of a "reward/<component>" key over the samples that have it: a task=custom reward that
        returned None for a sample gave it no reward (TRL's nanmean)."""
        values = [r[key] for r in self.rewards if key in r]
        return sum(values) / max(len(values), 1)

    def component_keys(self) -> list[str]:
        """The "reward/<component>" keys of a composite reward (task.reward_weights), in first-seen order."""
        return list(dict.fromkeys(key for r in self.rewards for key in r if key.startswith("reward/")))


def _kept_keys(result: dict[str, Any]) -> dict[str, float]:
    # result: Any values, as a reward function may return ints, bools or numpy numbers; kept as floats.
    kept = {key: float(result[key]) for key in REWARD_KEYS}
    kept.update({k: float(v) for k, v in result.items() if k in OPTIONAL_REWARD_KEYS or k.startswith("reward/")})
    return kept


def scores_of_batch(batch: Any) -> Scores:
    """The Scores of a reward's `score_batch` result (task=custom's BatchScores: rewards, n_errors, n_timeouts,
    extra, metrics, no_correctness; Any: rollout/ does not import the task's type), each reward's kept keys only."""
    return Scores(
        [_kept_keys(r) for r in batch.rewards],
        batch.n_errors,
        batch.n_timeouts,
        batch.extra,
        batch.metrics,
        no_correctness=dict(batch.no_correctness),
    )


def score_responses(
    reward_fn: RewardFn,
    responses: list[str],
    ground_truths: list[Any],  # Any: whatever the task's examples hold (RewardFn's second argument)
    n_tokens: list[int] | None = None,
    completion_ids: list[list[int]] | None = None,
    trainer_state: TrainerState | None = None,
) -> Scores:
    """Call the reward function on every response; a crash or a timeout scores 0 and is counted, never kills
    the run. `n_tokens` (each completion's generated token count) reaches a reward that reads it (the overlong
    shaping term) as `n_tokens=`: the engine's own count, never a re-tokenization of the text.

    A reward with a `score_batch(responses, ground_truths, n_tokens, completion_ids, trainer_state)` method
    (task=custom: TRL-convention functions and a reward model want the whole batch) is called once for the batch,
    and handles its own errors (it stops the run with a RewardFunctionError, or counts them, per
    task.on_reward_error). `completion_ids` are the sampled token ids of each completion and `trainer_state` how
    far the run is, which its functions get as TRL passes them."""
    score_batch = getattr(reward_fn, "score_batch", None)
    if score_batch is not None:
        return scores_of_batch(score_batch(responses, ground_truths, n_tokens, completion_ids, trainer_state))
    lengths: list[int | None] = list(n_tokens) if n_tokens is not None else [None] * len(responses)
    with_length = n_tokens is not None and uses_n_tokens(reward_fn)
    rewards, n_errors, n_timeouts = [], 0, 0
    for response, truth, length in zip(responses, ground_truths, lengths, strict=True):
        try:
            if with_length:
                result = cast(LengthAwareRewardFn, reward_fn)(response, truth, n_tokens=length)
            else:
                result = reward_fn(response, truth)
            rewards.append(_kept_keys(result))
        except RewardTimeout:
            rewards.append(dict(ZERO_REWARD))
            n_timeouts += 1
        except Exception:  # noqa: BLE001 - a buggy reward must cost one sample, not the run
            rewards.append(dict(ZERO_REWARD))
            n_errors += 1
    return Scores(rewards, n_errors, n_timeouts)


def reward_metrics(scores: Scores, prefix: str) -> dict[str, float]:
    """`<prefix>/reward`, `format_reward`, `answer_reward`, `unparseable_rate`, `reward/<component>`,
    `reward_errors` and `reward_timeouts` of one scored batch (prefix: train or eval)."""
    metrics = {f"{prefix}/{key}": scores.mean(key) for key in REWARD_KEYS}
    metrics[f"{prefix}/unparseable_rate"] = scores.mean("unparseable")
    metrics.update({f"{prefix}/{key}": scores.component_mean(key) for key in scores.component_keys()})
    metrics[f"{prefix}/reward_errors"] = scores.n_errors
    metrics[f"{prefix}/reward_timeouts"] = scores.n_timeouts
    return metrics


def with_logged_metrics(metrics: dict[str, float], scores: Scores, prefix: str) -> dict[str, float]:
    """`metrics` plus `<prefix>/<name>` for each log_metric(name, value) of the batch's reward functions, the mean
    of its values (TRL averages them per logging step); one line when a name would overwrite one of `metrics`."""
    out = dict(metrics)
    for name, values in scores.logged_metrics.items():
        key = f"{prefix}/{name}"
        if key in out:
            raise UserFacingError(
                f"a reward function called log_metric({name!r}, ...), which would overwrite grpo-cli's own {key}: "
                "give the metric another name"
            )
        out[key] = sum(values) / len(values)
    return out
