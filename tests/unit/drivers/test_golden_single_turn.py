"""A single-turn run is unchanged by refactors of the rollout path: a fixed-seed run's first 3 steps (the samples,
their log-probs, rewards, advantages, the learner's losses and every step metric but the timings, and each
evaluation's records) against a golden record committed before the one-rollout-path change (issue #41).

The record was written on the CPU in fp32 with ``GRPO_CLI_WRITE_GOLDEN=1 pytest <this file>``; rewrite it only for
a deliberate change of what a single-turn run computes, and say so in the commit. Token ids, texts and counts must
match exactly; floats to 1e-6 (relative and absolute), since CPUs differ in their fp32 kernels (AVX2 against
AVX-512) in the last bits. On the machine that wrote the record every value matched bit for bit.
"""

from __future__ import annotations

import json
import math
import os
from io import StringIO
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from grpo_cli.drivers.local import InProcessExecutor
from grpo_cli.learner.learner import Learner
from tests.conftest import FIXTURES, compose_config

GOLDEN = FIXTURES / "golden" / "single_turn_3_steps.json"
OVERRIDES = [
    "debug=smoke",
    "task.name=letter_e",
    "train.group_size=4",
    "train.rollout_batch_size=8",
    "train.train_batch_size=8",
    "loss=grpo_clip",
    "sync=multi_epoch",
    "train.steps=3",
    "train.eval_every=3",
    "rollout.max_tokens=12",
    "seed=7",
    "model.dtype=float32",
    "model.mixed_precision=no",
    # every row's old log-probs, compared below with an independent forward (the default skips the rows of loss
    # weight 0, whose update is the same: tests/unit/learner/test_zero_weight_rows.py)
    "train.skip_zero_weight_rows=false",
]
# Seconds, rates and memory differ between any two runs; everything else is the run's arithmetic.
_UNSTABLE_PREFIXES = ("time/", "perf/", "memory/", "throughput/")
_UNSTABLE_KEYS = ("tokens_per_s", "_per_s", "elapsed")


def _stable(metrics: dict[str, Any]) -> dict[str, Any]:
    return {
        key: value
        for key, value in sorted(metrics.items())
        if not key.startswith(_UNSTABLE_PREFIXES) and not any(part in key for part in _UNSTABLE_KEYS)
    }


def _floats(values: torch.Tensor | list | None) -> Any:
    if values is None:
        return None
    if isinstance(values, list):
        return [_floats(v) for v in values]
    return [float(v) for v in values.detach().float().flatten().tolist()]


def _independent_log_probs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> list[float]:
    """The completion tokens' log-probs under `model`, one unpadded row, full-vocabulary log-softmax."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + completion], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.float()[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt) :, None]).squeeze(1).tolist()


def record_run(tmp_path: Path, monkeypatch) -> dict[str, Any]:
    """Run `grpo-run <OVERRIDES>`'s training job in this process and record what each step computed."""
    from grpo_cli.jobs import train

    steps: list[dict[str, Any]] = []
    evaluations: list[list[dict[str, Any]]] = []
    learn = Learner.learn
    evaluate = InProcessExecutor.evaluate

    def recording_learn(self: Learner, data, step: int):
        was_training = self.model.training
        self.model.eval()
        independent = [
            _independent_log_probs(self.model, p, c) for p, c in zip(data.prompt_ids, data.completion_ids, strict=True)
        ]
        self.model.train(was_training)
        metrics, streak = learn(self, data, step)
        steps.append(
            {
                "step": step,
                "prompt_ids": data.prompt_ids,
                "completion_ids": data.completion_ids,
                "raw_rewards": _floats(data.raw_rewards),
                "advantages": _floats(data.advantages),
                "old_log_probs": _floats(data.old_log_probs),
                "independent_log_probs": independent,
                "learner_metrics": _stable(metrics),
            }
        )
        return metrics, streak

    def recording_evaluate(self, examples, on_generated):
        metrics, records = evaluate(self, examples, on_generated)
        evaluations.append([{"metrics": _stable(metrics)}, *records])
        return metrics, records

    monkeypatch.setattr(Learner, "learn", recording_learn)
    monkeypatch.setattr(InProcessExecutor, "evaluate", recording_evaluate)
    cfg = compose_config(OVERRIDES, output_dir=str(tmp_path))
    train.run(cfg, tmp_path, Console(file=StringIO()))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return {
        "overrides": OVERRIDES,
        "steps": steps,
        "evaluations": json.loads(json.dumps(evaluations, default=str)),
        "metrics_jsonl": [_stable(line) for line in lines],
    }


def differences(expected: Any, actual: Any, where: str = "") -> list[str]:
    """Every place the two records differ: exactly for ints, strings and structure, to 1e-6 for floats."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        found = [f"{where}.{k}: missing" for k in expected.keys() - actual.keys()]
        found += [f"{where}.{k}: unexpected" for k in actual.keys() - expected.keys()]
        for key in expected.keys() & actual.keys():
            found += differences(expected[key], actual[key], f"{where}.{key}")
        return found
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return [f"{where}: {len(actual)} items, expected {len(expected)}"]
        return [
            d for i, (e, a) in enumerate(zip(expected, actual, strict=True)) for d in differences(e, a, f"{where}[{i}]")
        ]
    if isinstance(expected, float) or isinstance(actual, float):
        if not isinstance(actual, int | float) or not isinstance(expected, int | float):
            return [f"{where}: {actual!r}, expected {expected!r}"]
        if math.isnan(expected) and math.isnan(actual):
            return []
        if math.isclose(expected, actual, rel_tol=1e-6, abs_tol=1e-6):
            return []
        return [f"{where}: {actual!r}, expected {expected!r}"]
    return [] if expected == actual else [f"{where}: {actual!r}, expected {expected!r}"]


def test_single_turn_run_matches_its_golden_record(tmp_path, monkeypatch, letter_e_task):
    record = record_run(tmp_path, monkeypatch)
    if os.environ.get("GRPO_CLI_WRITE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(record, indent=None, separators=(",", ":")) + "\n")
    golden = json.loads(GOLDEN.read_text())
    found = differences(golden, json.loads(json.dumps(record)))
    assert not found, f"{len(found)} differences from {GOLDEN.name}; first: {found[:10]}"
    # The record holds what it says: three steps of samples scored by the learner as one unpadded forward scores them.
    assert [s["step"] for s in golden["steps"]] == [1, 2, 3]
    for step in golden["steps"]:
        for old, independent in zip(step["old_log_probs"], step["independent_log_probs"], strict=True):
            assert max(abs(a - b) for a, b in zip(old, independent, strict=True)) < 1e-4
