"""Scoring and held-out evaluation: shared by the training loop and `job=baseline_eval`."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_cli.rollout import RolloutBatch, RolloutEngine, SamplingSettings, render_prompts
from grpo_cli.tasks import OPTIONAL_REWARD_KEYS, REWARD_KEYS, Example, RewardFn, RewardTimeout

ZERO_REWARD = dict.fromkeys(REWARD_KEYS, 0.0)
# Held-out prompts per generate() call: a progress bar can move between calls on large eval sets (MATH-500),
# while the default 64-example set is still one call.
EVAL_CHUNK_PROMPTS = 64


@dataclass
class Scores:
    # One dict per response: the three REWARD_KEYS, plus "unparseable" and "reward/<component>" when the
    # reward function returns them (a missing optional key counts as 0).
    rewards: list[dict[str, float]]
    n_errors: int  # reward-function calls that raised and were scored 0
    n_timeouts: int = 0  # calls that ran past task.reward_timeout_s and were scored 0

    def mean(self, key: str) -> float:
        return sum(r.get(key, 0.0) for r in self.rewards) / max(len(self.rewards), 1)

    def component_keys(self) -> list[str]:
        """The "reward/<component>" keys of a composite reward (task.reward_weights), in first-seen order."""
        return list(dict.fromkeys(key for r in self.rewards for key in r if key.startswith("reward/")))


def _kept_keys(result: dict[str, Any]) -> dict[str, float]:
    kept = {key: float(result[key]) for key in REWARD_KEYS}
    kept.update({k: float(v) for k, v in result.items() if k in OPTIONAL_REWARD_KEYS or k.startswith("reward/")})
    return kept


def score_responses(reward_fn: RewardFn, responses: list[str], ground_truths: list[Any]) -> Scores:
    """Call the reward function on every response; a crash or a timeout scores 0 and is counted, never kills
    the run."""
    rewards, n_errors, n_timeouts = [], 0, 0
    for response, truth in zip(responses, ground_truths, strict=True):
        try:
            rewards.append(_kept_keys(reward_fn(response, truth)))
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
    metrics.update({f"{prefix}/{key}": scores.mean(key) for key in scores.component_keys()})
    metrics[f"{prefix}/reward_errors"] = scores.n_errors
    metrics[f"{prefix}/reward_timeouts"] = scores.n_timeouts
    return metrics


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


def run_baseline_eval(cfg: Any, output_dir: Path, console: Any) -> dict[str, Any]:
    """`job=baseline_eval`: the untrained model on the held-out set; generations + rewards as JSONL."""
    import torch

    from grpo_cli.models import load_policy, resolve_device, resolve_dtype
    from grpo_cli.rollout import build_rollout_engine
    from grpo_cli.tasks import load_examples, make_reward_fn, stop_strings
    from grpo_cli.tracking import write_jsonl
    from grpo_cli.tracking.console import generation_progress

    reward_fn = make_reward_fn(cfg.task)
    examples = load_examples(cfg.task, "eval")[: cfg.job.n_examples or None]
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.model.device)
    model, tokenizer = load_policy(
        cfg.model.name_or_path, device, resolve_dtype(cfg.model.dtype, device), seed=cfg.model.init_seed
    )
    engine = build_rollout_engine(cfg, model, tokenizer)
    r = cfg.rollout
    settings = SamplingSettings(
        n=1,
        temperature=r.eval_temperature,
        top_p=r.top_p,
        min_tokens=r.min_tokens,
        max_tokens=r.max_tokens,
        stop=stop_strings(r.stop, cfg.task.prompt),
        seed=cfg.seed,
    )
    t0 = time.perf_counter()
    try:
        with generation_progress(console, len(examples), "baseline eval") as advance:
            metrics, records = evaluate(engine, tokenizer, reward_fn, examples, settings, on_generated=advance)
    finally:
        engine.close()
    metrics["time/eval_s"] = time.perf_counter() - t0
    write_jsonl(output_dir / "baseline_eval.jsonl", records)
    summary = {**summarize_records(records), "metrics": metrics}
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(
        f"baseline eval of {cfg.model.name} on {cfg.task.name}: {summary['n']} examples "
        f"in {metrics['time/eval_s']:.1f}s\n"
        f"  accuracy {summary['accuracy']:.3f}  format rate {summary['format_rate']:.3f}  "
        f"answer reward {summary['answer_reward']:.3f}  unparseable {summary['unparseable_rate']:.3f}\n"
        f"  format 1 & answer 1: {summary['counts']['format_1_answer_1']}   "
        f"format 1 & answer 0: {summary['counts']['format_1_answer_0']}   format 0: {summary['counts']['format_0']}",
        highlight=False,
    )
    for name, rows in summary["examples"].items():
        for row in rows:
            console.print(
                f"  [{name}] {row['response'][:160]!r}  (truth: {row['ground_truth']})", highlight=False, markup=False
            )
    console.print(f"wrote {output_dir / 'baseline_eval.jsonl'} and {output_dir / 'summary.json'}", highlight=False)
    return summary
