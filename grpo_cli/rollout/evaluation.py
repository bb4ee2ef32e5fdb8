"""Held-out evaluation: generate for each held-out prompt, score, summarize. Used by training evaluations and
`job=baseline_eval` alike (both through `RolloutWorker.evaluate`)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from grpo_cli.engines.base import RolloutEngine, SamplingSettings
from grpo_cli.errors import UserFacingError
from grpo_cli.rollout.episode_rollout import TRANSCRIPT_COLUMNS
from grpo_cli.rollout.rewards import Scores, reward_metrics, with_logged_metrics
from grpo_cli.rollout.runs import RolloutRun, Samples, join_samples
from grpo_cli.rollout.sample_metrics import default_pass_ks, majority_group, multi_sample_metrics, normalized_text
from grpo_cli.tasks import Example, TaskSpec
from grpo_cli.tasks.trainer_state import TrainerState

if TYPE_CHECKING:
    from grpo_cli.tasks.schema import TaskConfig

log = logging.getLogger(__name__)
_SAID: set[str] = set()  # the no-correctness lines already logged by this process

# Held-out completions per generate() call: a progress bar can move between calls on large eval sets
# (MATH-500), while the default 64-example set is still one call.
EVAL_CHUNK_PROMPTS = 64


@dataclass(frozen=True)
class Voting:
    """How eval/maj@n groups answers: the answer of a response (None: it abstains) and whether two agree."""

    answer: Callable[[str], str | None]
    same: Callable[[str, str], bool] | None = None  # None: equal strings


def voting_for(task: TaskSpec, prompt_style: str) -> Voting:
    """The task's answers (math: the graded answer, equivalent under math-verify), or for a task without one
    (keyword) the normalized response text."""
    if task.extract_answer is None:
        return Voting(normalized_text)
    extract = task.extract_answer
    return Voting(lambda response: extract(response, prompt_style), task.same_answer)


def is_correct(reward: dict[str, float]) -> bool:
    """A sample is correct when the task's own reward is 1: "correctness" when the reward is weighted (shaping
    terms do not make an answer right or wrong), else "reward"."""
    return reward.get("correctness", reward["reward"]) >= 1.0


def evaluate(
    run: RolloutRun,
    engine: RolloutEngine,
    examples: list[Example],
    settings: SamplingSettings,
    on_generated: Callable[[int], None] | None = None,
    voting: Voting | None = None,
    pass_ks: list[int] | None = None,
    trainer_state: TrainerState | None = None,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Sample settings.n episodes per held-out example with the task's `run` (a completion is an episode of one
    turn) and score them.

    eval/reward and the other reward metrics are means over every sample. With settings.n > 1 the metrics add
    eval/mean@n, eval/pass@k (k in `pass_ks`, default 1 and n) and eval/maj@n (votes grouped by `voting`, default:
    the normalized text; an episode's answer is its last model turn), and each record its sample number and whether
    it holds the majority answer. on_generated(k) is called after each chunk of k prompts (a progress bar).
    task=custom's reward functions get the sampled token ids and `trainer_state`; what they log with log_extra
    becomes columns of the records, and with log_metric eval/<name>. A multi-turn run's records add the episode's
    transcript (`messages`, `turns`, `stop_reason`, ...), `response` its last model turn and `n_tokens` its model
    tokens; its metrics add eval/turns, eval/tool_calls, eval/tool_errors, eval/env_tokens, ...
    Returns (metrics named eval/*, one record per sample for the eval JSONL, prompt-major).
    """
    n = settings.n
    samples = generate_in_chunks(run, engine, examples, settings, on_generated)
    scores = run.score(samples, trainer_state)
    prompts = [run.prompt_text(samples.prompt_ids[i * n]) for i in range(len(examples))]
    metrics, records = summarize(
        prompts,
        samples.responses,
        samples.ground_truths,
        scores,
        samples.model_tokens,
        samples.truncated,
        n,
        voting,
        pass_ks,
        run.transcripts(samples, None),
    )
    metrics.update(run.metrics(samples, "eval"))
    return metrics, records


def summarize(
    prompts: list[str],
    texts: list[str],
    truths: list[Any],
    scores: Scores,
    lengths: list[int],
    truncated: list[bool],
    n: int,
    voting: Voting | None = None,
    pass_ks: list[int] | None = None,
    transcripts: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The eval metrics and records of scored samples (an episode's `transcripts` go in the records, their rewards
    and truncated aside: the record has its own), `prompts` one per example, the rest prompt-major (n per
    example)."""
    metrics = reward_metrics(scores, "eval")
    metrics["eval/response_length_mean"] = sum(lengths) / len(lengths)
    metrics["eval/truncated_frac"] = sum(truncated) / len(lengths)
    records = [
        {
            "prompt": prompts[i // n],
            "response": text,
            "ground_truth": truth,
            **reward,
            "n_tokens": n_tokens,
            "truncated": cut,
        }
        for i, (text, truth, reward, n_tokens, cut) in enumerate(
            zip(texts, truths, scores.rewards, lengths, truncated, strict=True)
        )
    ]
    if transcripts is not None:
        for record, episode_transcript in zip(records, transcripts, strict=True):
            record.update({k: v for k, v in episode_transcript.items() if k not in ("rewards", "truncated")})
    add_extra_columns(records, scores.extra_columns)
    for index in scores.no_correctness:
        records[index]["correctness"] = None  # unknown, not 0
    if n > 1 and scores.no_correctness:
        why = scores.no_correctness[min(scores.no_correctness)]
        if why not in _SAID:  # once per process and reason, not at every evaluation
            _SAID.add(why)
            log.warning(no_correctness_line(scores.no_correctness, len(records), n))
    elif n > 1:
        voting = voting or Voting(normalized_text)
        correct, votes = [], []
        for start in range(0, len(records), n):
            group = records[start : start + n]
            correct.append([is_correct(r) for r in group])
            winners = majority_group([voting.answer(r["response"]) for r in group], voting.same)
            votes.append(winners[0] if winners else None)  # the first holder of the majority answer is graded
            for j, record in enumerate(group):
                record["sample"] = j
                record["majority"] = j in winners
        metrics.update(multi_sample_metrics(correct, votes, default_pass_ks(n, pass_ks)))
    return with_logged_metrics(metrics, scores, "eval"), records


def no_correctness_line(reasons: dict[int, str], n_samples: int, n: int) -> str:
    """The one line that says why eval/mean@n, pass@k and maj@n are not logged: some samples' correctness cannot be
    derived (`Scores.no_correctness`), and an average that counted them as wrong would be a silent 0."""
    first = reasons[min(reasons)]
    return (
        f"eval/mean@{n}, eval/pass@k and eval/maj@{n} are not logged: {len(reasons)} of {n_samples} samples have no "
        f"correctness ({first}); set task.answer_from to a reward that scores every sample (docs/evaluation.md)"
    )


# Columns of an eval record that log_extra may not take (besides the reward keys, which every record has).
RECORD_COLUMNS = (
    "prompt",
    "response",
    "ground_truth",
    "n_tokens",
    "truncated",
    "sample",
    "majority",
    "eval_set",
    *TRANSCRIPT_COLUMNS,
)


def add_extra_columns(records: list[dict[str, Any]], columns: dict[str, list[Any]]) -> None:
    """Each record gets the value a reward function logged for its completion with log_extra(column, values), in
    place; one line when a column would overwrite one of the record's own."""
    for column, values in columns.items():
        if column in RECORD_COLUMNS or any(column in record for record in records[:1]):
            raise UserFacingError(
                f"a reward function called log_extra({column!r}, ...), which would overwrite the eval samples' own "
                f"{column!r} column: give the column another name"
            )
        for record, value in zip(records, values, strict=True):
            record[column] = value


def generate_in_chunks(
    run: RolloutRun,
    engine: RolloutEngine,
    examples: Sequence[Example],
    settings: SamplingSettings,
    on_generated: Callable[[int], None] | None = None,
) -> Samples:
    """run.sample over about EVAL_CHUNK_PROMPTS samples at a time (EVAL_CHUNK_PROMPTS / n prompts), joined in
    prompt order; on_generated gets the number of prompts of each chunk.

    Each chunk starts at its first prompt's index in the whole list (`first_prompt_index`), so its samples
    continue the random streams where the previous chunk stopped: the result is one sample() call's over every
    prompt, and a prompt repeated in another chunk gets fresh samples rather than the first chunk's again.
    """
    parts = []
    per_call = max(1, EVAL_CHUNK_PROMPTS // settings.n)
    for start in range(0, len(examples), per_call):
        chunk = examples[start : start + per_call]
        parts.append(
            run.sample(engine, replace(settings, first_prompt_index=settings.first_prompt_index + start), chunk)
        )
        if on_generated is not None:
            on_generated(len(chunk))
    return join_samples(parts)


def prefixed(metrics: dict[str, float], set_name: str) -> dict[str, float]:
    """An extra eval set's metrics under its own prefix: eval/reward -> eval/<set_name>/reward."""
    return {key.replace("eval/", f"eval/{set_name}/", 1): value for key, value in metrics.items()}


def summarize_records(records: list[dict[str, Any]], n_examples_per_category: int = 3) -> dict[str, Any]:
    """Accuracy, format rate and the three outcome categories, with a few examples of each. Accuracy is the mean
    of the task's own reward ("correctness" when task.reward_weights weighs more components or shaping terms),
    not of the weighted total: with a 0/1 reward it equals eval/mean@n."""
    categories = {
        "format_1_answer_1": [r for r in records if r["format_reward"] == 1 and r["answer_reward"] == 1],
        "format_1_answer_0": [r for r in records if r["format_reward"] == 1 and r["answer_reward"] != 1],
        "format_0": [r for r in records if r["format_reward"] != 1],
    }
    n = max(len(records), 1)
    return {
        "n": len(records),
        # A record whose correctness is unknown (None: Scores.no_correctness) counts in none of them.
        "accuracy": _mean_known([r.get("correctness", r["reward"]) for r in records]),
        "format_rate": sum(r["format_reward"] for r in records) / n,
        "answer_reward": sum(r["answer_reward"] for r in records) / n,
        "unparseable_rate": sum(r.get("unparseable", 0.0) for r in records) / n,
        "counts": {name: len(rows) for name, rows in categories.items()},
        "examples": {
            name: [
                {"response": r["response"], "ground_truth": r["ground_truth"]} for r in rows[:n_examples_per_category]
            ]
            for name, rows in categories.items()
        },
    }


def _mean_known(values: list[float | None]) -> float | None:
    """The mean of the known values; None when every one is unknown (0.0 for none at all)."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else (None if values else 0.0)


def truncation_warning(
    metrics: dict[str, float],
    max_tokens: int,
    records: Sequence[Mapping[str, Any]] = (),
    task: TaskConfig | None = None,
) -> str | None:
    """One warning line when over half of the evaluated answers were cut before they ended (a reasoning task at a
    CPU-sized limit scores 0 on every cut answer, and nothing else would say why), naming the limit that cut most
    of them: rollout.max_tokens for single completions; for episodes (their `records` carry `stop_reason`) the
    limit their stop reason names, `task` giving its value."""
    episode_records = [r for r in records if "stop_reason" in r]
    # An episode ends before it ended when its last turn was cut (truncated) or a limit ended it (turn_limited).
    cut = [r for r in episode_records if r.get("truncated") or r.get("turn_limited")]
    fraction = len(cut) / len(episode_records) if episode_records else metrics.get("eval/truncated_frac", 0.0)
    if fraction <= 0.5:
        return None
    reasons = Counter(str(r["stop_reason"]) for r in cut)
    if not reasons:
        return (
            f"{fraction:.0%} of the evaluation's answers hit rollout.max_tokens={max_tokens} before they ended: "
            "raise rollout.max_tokens, or their rewards measure the limit rather than the policy"
        )
    reason, count = reasons.most_common(1)[0]
    limits = {
        "max_turns": f"task.max_turns={task.max_turns if task else '?'}",
        "max_episode_tokens": f"task.max_episode_tokens={task.max_episode_tokens if task else '?'}",
        "context": "the model's context (train/context_limited; rollout.max_model_len with rollout.engine=vllm)",
    }
    # Any other stop reason of a truncated episode: its last model turn was cut at the per-turn limit.
    limit = limits.get(reason, f"rollout.max_tokens={max_tokens} (the per-turn limit)")
    return (
        f"{fraction:.0%} of the evaluation's episodes were cut before they ended, {count} of {len(records)} by "
        f"{limit}: raise it, or their rewards measure the limit rather than the policy"
    )
