"""Held-out evaluation: generate for each held-out prompt, score, summarize. Used by training evaluations and
`job=baseline_eval` alike (both through `RolloutWorker.evaluate`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from grpo_cli.rollout.base import RolloutBatch, RolloutEngine, SamplingSettings, render_prompts
from grpo_cli.rollout.scoring import reward_metrics, score_responses
from grpo_cli.tasks import Example, RewardFn

# Held-out prompts per generate() call: a progress bar can move between calls on large eval sets (MATH-500),
# while the default 64-example set is still one call.
EVAL_CHUNK_PROMPTS = 64


def evaluate(
    engine: RolloutEngine,
    tokenizer: Any,
    reward_fn: RewardFn,
    examples: list[Example],
    settings: SamplingSettings,
    on_generated: Callable[[int], None] | None = None,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Generate one completion per held-out example and score it.

    on_generated(n) is called after each chunk of n completions (a progress bar).
    Returns (metrics named eval/*, one record per example for the eval JSONL).
    """
    prompt_ids = render_prompts([e.prompt for e in examples], tokenizer)
    rollout = generate_in_chunks(engine, prompt_ids, settings, on_generated)
    truths = [e.ground_truth for e in examples]
    scores = score_responses(reward_fn, rollout.texts, truths)
    metrics = reward_metrics(scores, "eval")
    lengths = [len(ids) for ids in rollout.completion_ids]
    metrics["eval/response_length_mean"] = sum(lengths) / len(lengths)
    metrics["eval/truncated_frac"] = sum(rollout.truncated) / len(lengths)
    records = [
        {
            "prompt": tokenizer.decode(p, skip_special_tokens=False),
            "response": text,
            "ground_truth": truth,
            **reward,
            "n_tokens": len(ids),
            "truncated": truncated,
        }
        for p, text, truth, reward, ids, truncated in zip(
            prompt_ids, rollout.texts, truths, scores.rewards, rollout.completion_ids, rollout.truncated, strict=True
        )
    ]
    return metrics, records


def generate_in_chunks(
    engine: RolloutEngine,
    prompt_ids: list[list[int]],
    settings: SamplingSettings,
    on_generated: Callable[[int], None] | None = None,
) -> RolloutBatch:
    """engine.generate over EVAL_CHUNK_PROMPTS prompts at a time, concatenated in prompt order."""
    out = RolloutBatch([], [], [], [])
    for start in range(0, len(prompt_ids), EVAL_CHUNK_PROMPTS):
        part = engine.generate(prompt_ids[start : start + EVAL_CHUNK_PROMPTS], settings)
        for name in ("prompt_ids", "completion_ids", "texts", "truncated"):
            getattr(out, name).extend(getattr(part, name))
        if on_generated is not None:
            on_generated(len(part.texts))
    return out


def summarize_records(records: list[dict[str, Any]], n_examples_per_category: int = 3) -> dict[str, Any]:
    """Accuracy, format rate and the three outcome categories, with a few examples of each."""
    categories = {
        "format_1_answer_1": [r for r in records if r["format_reward"] == 1 and r["answer_reward"] == 1],
        "format_1_answer_0": [r for r in records if r["format_reward"] == 1 and r["answer_reward"] != 1],
        "format_0": [r for r in records if r["format_reward"] != 1],
    }
    n = max(len(records), 1)
    return {
        "n": len(records),
        "accuracy": sum(r["reward"] for r in records) / n,
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
