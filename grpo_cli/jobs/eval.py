"""`job=eval`: a trained model on the held-out set (and task.eval_sets), evaluated exactly as training evaluates:
`grpo-run job=eval eval.model=<run dir | checkpoint | Hugging Face folder>`.

What it evaluates (docs/evaluation.md#evaluating-a-trained-model-jobeval):
- a run directory: its newest complete checkpoint (eval.step=N: that one), on the policy the run's saved model.*
  builds, with the checkpoint's trained weights copied in (a LoRA run: its adapters);
- one checkpoint (<run>/checkpoints/step_N): the same, of that checkpoint;
- a Hugging Face folder (config.json and weights, e.g. an exported model/): loaded as model=hf
  model.name_or_path=<folder> would be.
A run's (or checkpoint's) task.*, rollout.* and eval.* are the run's own, so the default is the run's own held-out
set, prompt format and sampling; a key on the command line overrides it (task=gsm8k, eval.n_samples=8). Keys
that built the trained weights (model.name_or_path, model.lora.*, ...) cannot change: the checkpoint holds
weights of that model only. A folder's own run (<run>/model/) lends its task the same way; another folder takes
the command line's task.

The evaluation and its files are job=baseline_eval's (one implementation, `evaluate_and_write`): <stem>.jsonl
per set, one metrics.jsonl line at the checkpoint's step (job=report reads it), summary.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from grpo_cli.config.job_keys import PRESET_GROUPS, override_key
from grpo_cli.config.saved import load_saved_config
from grpo_cli.errors import UserFacingError

if TYPE_CHECKING:
    from grpo_cli.config.schemas import GRPOConfig
    from grpo_cli.rollout.worker import RolloutWorker

# model.* keys an evaluation may change: where and at what precision the same weights run. Every other model key
# built the weights the checkpoint holds.
EVAL_MAY_CHANGE_MODEL = ("model.device", "model.mixed_precision", "model.dtype")
# Keys of the command line that are this job's own, never the evaluated run's.
_OWN_KEYS = ("job", "eval.model", "eval.step", "output_dir")


def is_checkpoint(path: Path) -> bool:
    return (path / "COMPLETE").exists() or path.name.startswith("step_")


def is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file()


def resolve_source(given: str, step: int | None) -> tuple[Path | None, Path | None, Path | None]:
    """(the run directory whose config applies, the checkpoint to load, the model folder to load) for eval.model."""
    from grpo_cli.learner.checkpoint import verify_checkpoint

    path = Path(given).expanduser().absolute()
    if not path.is_dir():
        raise UserFacingError(
            f"eval.model={given}: no such directory: give a run directory, one of its checkpoints "
            "(<run>/checkpoints/step_N) or a Hugging Face model folder"
        )
    if is_model_folder(path):
        run_dir = path.parent if (path.parent / "config.yaml").is_file() else None
        return run_dir, None, path
    if is_checkpoint(path):
        if step is not None:
            raise UserFacingError(f"eval.step={step}: eval.model={given} is one checkpoint already: drop eval.step")
        problem = verify_checkpoint(path)
        if problem is not None:
            raise UserFacingError(f"eval.model={given}: {problem}: give a complete checkpoint or its run directory")
        if not (path.parent.parent / "config.yaml").is_file():  # the checkpoint holds weights, not their model
            raise UserFacingError(
                f"eval.model={given}: {path.parent.parent} has no config.yaml, which names the model the checkpoint's "
                "weights belong to: give a checkpoint inside its run directory, or an exported model folder"
            )
        return path.parent.parent, path, None
    if (path / "adapter_config.json").is_file():
        raise UserFacingError(
            f"eval.model={given} is a LoRA adapter without its base model: give the run directory it was exported "
            "from, or a merged export (export.merge_lora=true)"
        )
    if not (path / "config.yaml").is_file():
        raise UserFacingError(
            f"eval.model={given} is neither a run directory (config.yaml), a checkpoint (COMPLETE) nor a Hugging "
            "Face model folder (config.json): give one of those"
        )
    from grpo_cli.learner.checkpoint import chosen_checkpoint

    checkpoint = chosen_checkpoint(path, step, "eval.step", given)
    if checkpoint is not None:
        return path, checkpoint, None
    if (path / "model" / "config.json").is_file():  # the run's exported model, its checkpoints gone or off
        return path, None, path / "model"
    raise UserFacingError(
        f"eval.model={given} has no complete checkpoint and no exported model/: give a run that saved one "
        "(train.checkpoint_every), or one of its checkpoints"
    )


def _plain(value: object) -> object:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def eval_config(composed: DictConfig, overrides: list[str], output_dir: Path) -> DictConfig:
    """job=eval's config: the evaluated run's saved config (model, task, rollout, eval, seed) with the command
    line's keys on top, eval.model rewritten to the checkpoint or folder to load. Without a run (a bare model
    folder): this command's own config with model=hf model.name_or_path=<folder>."""
    given = composed.eval.model
    if given is None:
        raise UserFacingError(
            "job=eval needs eval.model=<run dir | checkpoint | model folder>: the model to evaluate "
            "(job=baseline_eval evaluates the untrained model)"
        )
    run_dir, checkpoint, folder = resolve_source(str(given), composed.eval.step)
    keys = [override_key(o) for o in overrides if not override_key(o).startswith("hydra")]
    for key in keys:
        if key in PRESET_GROUPS:
            raise UserFacingError(
                f"{key}=...: job=eval evaluates with the run's own config, which a preset over several groups would "
                f"rewrite wholesale: set the keys you mean to change instead (task.n_eval=..., eval.n_samples=...)"
            )
    if run_dir is None:
        cfg = composed.copy()
        from grpo_cli.config.schemas import ModelConfig

        model = OmegaConf.structured(ModelConfig)
        model.name, model.name_or_path = "hf", str(folder)
        cfg.model = model
        for key in keys:
            if key.startswith("model."):
                OmegaConf.update(cfg, key, OmegaConf.select(composed, key), force_add=True)
    else:
        cfg = load_saved_config(run_dir / "config.yaml")
        for key in keys:
            if key in _OWN_KEYS or key.startswith("job."):
                continue
            new = OmegaConf.select(composed, key, default=None)
            if (key == "model" or key.startswith("model.")) and key not in EVAL_MAY_CHANGE_MODEL and checkpoint:
                old = OmegaConf.select(cfg, key, default=None)
                if _plain(new) != _plain(old):
                    lora = " (a LoRA run's checkpoint holds only its adapters)" if cfg.model.lora.enabled else ""
                    raise UserFacingError(
                        f"{key}={_plain(new)}: {checkpoint} holds weights trained with {key}={_plain(old)}{lora}: "
                        f"drop the override (job=eval builds the run's own model; {', '.join(EVAL_MAY_CHANGE_MODEL)} "
                        "may change)"
                    )
                continue
            OmegaConf.update(cfg, key, new, merge=False, force_add=True)
        if folder is not None:  # the run's exported model, as model=hf would load it (its precision is the export's)
            cfg.model.name, cfg.model.name_or_path = "hf", str(folder)
            cfg.model.lora.enabled = False
            cfg.model.quantization = "none"
        cfg.job = composed.job
        for key in ("logger", "distributed", "verbose"):  # how this command reports and runs, not the run's
            cfg[key] = composed[key]
    cfg.eval.model = str(checkpoint or folder)
    cfg.eval.step = _checkpoint_step(checkpoint) if checkpoint is not None else None
    cfg.output_dir = str(output_dir)
    cfg.resume = None
    cfg.init_from = None
    return cfg


def _checkpoint_step(checkpoint: Path) -> int:
    try:
        step = json.loads((checkpoint / "state.json").read_text())["step"]
        return int(step)
    except (OSError, ValueError, KeyError, TypeError):
        return int(checkpoint.name.removeprefix("step_"))


def run(cfg: GRPOConfig, output_dir: Path, console: Console) -> dict[str, Any]:
    from grpo_cli.learner.checkpoint import load_weights
    from grpo_cli.models import build_policy
    from grpo_cli.models.runtime import resolve_device, seed_everything
    from grpo_cli.rollout.worker import RolloutWorker

    source = Path(str(cfg.eval.model))
    seed_everything(cfg.seed)
    model, tokenizer = build_policy(cfg.model, resolve_device(cfg.model.device))
    step = 0
    label = str(source)
    if is_checkpoint(source):
        load_weights(source, model)  # the trained weights: the whole point of this job
        step = cfg.eval.step if cfg.eval.step is not None else _checkpoint_step(source)
        label = f"{source.parent.parent.name} at step {step}"
    worker = RolloutWorker(cfg, model, tokenizer)
    return evaluate_and_write(cfg, worker, output_dir, console, title=f"eval of {label}", stem="eval", step=step)


def evaluate_and_write(
    cfg: GRPOConfig, worker: RolloutWorker, output_dir: Path, console: Console, *, title: str, stem: str, step: int
) -> dict[str, Any]:
    """Evaluate the weights `worker` holds on the task's held-out set and task.eval_sets, as training's evaluation
    does (eval.n_samples, pass@k, maj@n), and write <stem>.jsonl (and <stem>.<set>.jsonl), one metrics.jsonl line
    at `step` and summary.json; print the summary. The worker is closed."""
    from grpo_cli.models.runtime import timed
    from grpo_cli.rollout.evaluation import prefixed, summarize_records, truncation_warning
    from grpo_cli.tasks import load_eval_sets, load_examples
    from grpo_cli.tracking import write_jsonl
    from grpo_cli.tracking.console import generation_progress, sample_metrics_line

    limit = cfg.job.n_examples or cfg.train.eval_examples or None  # training's evaluation takes train.eval_examples
    examples = load_examples(cfg.task, "eval")[:limit]
    # task.eval_sets: evaluated after the task's own set, their metrics under eval/<name>/...
    eval_sets = {name: rows[:limit] for name, rows in load_eval_sets(cfg.task).items()}
    timings: dict[str, float] = {}
    set_results: dict[str, tuple[dict[str, float], list[dict[str, Any]]]] = {}
    total = len(examples) + sum(map(len, eval_sets.values()))
    try:
        with timed(timings, "time/eval_s"), generation_progress(console, total, stem.replace("_", " ")) as advance:
            metrics, records, _version = worker.evaluate(examples, on_generated=advance)
            for name, set_examples in eval_sets.items():
                set_metrics, set_records, _version = worker.evaluate(set_examples, on_generated=advance)
                set_results[name] = (set_metrics, set_records)
                metrics.update(prefixed(set_metrics, name))
    finally:
        worker.close()
    metrics.update(timings)
    warning = truncation_warning(metrics, cfg.rollout.max_tokens, records, cfg.task)
    if warning is not None:
        console.print(f"warning: {warning}", highlight=False, markup=False)
    write_jsonl(output_dir / f"{stem}.jsonl", records)
    for name, (_, set_records) in set_results.items():
        write_jsonl(output_dir / f"{stem}.{name}.jsonl", set_records)
    # One metrics.jsonl line, as a training run's evaluation at that step (job=report reads it).
    write_jsonl(output_dir / "metrics.jsonl", [{"step": step, **metrics}])
    # n counts completions (n_prompts x n_samples); accuracy and the rates are means over them (= mean@n).
    summary = {
        **summarize_records(records),
        "n_prompts": len(examples),
        "n_samples": cfg.eval.n_samples,
        "model": cfg.eval.model if stem == "eval" else cfg.model.name_or_path,
        "step": step,
        "metrics": metrics,
    }
    if set_results:
        summary["eval_sets"] = {name: summarize_records(rows) for name, (_, rows) in set_results.items()}
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    samples = f" x {cfg.eval.n_samples} samples" if cfg.eval.n_samples > 1 else ""
    console.print(
        f"{title} on {cfg.task.name}: {len(examples)} examples{samples} in {metrics['time/eval_s']:.1f}s\n"
        f"  accuracy {summary['accuracy']:.3f}  format rate {summary['format_rate']:.3f}  "
        f"answer reward {summary['answer_reward']:.3f}  unparseable {summary['unparseable_rate']:.3f}\n"
        f"  format 1 & answer 1: {summary['counts']['format_1_answer_1']}   "
        f"format 1 & answer 0: {summary['counts']['format_1_answer_0']}   format 0: {summary['counts']['format_0']}",
        highlight=False,
    )
    if sampled := sample_metrics_line(metrics, "eval/"):
        console.print(f"  {sampled}", highlight=False)
    for name, (set_metrics, _) in set_results.items():
        console.print(
            f"  {name}: {len(set_results[name][1])} completions, reward {set_metrics['eval/reward']:.3f}  "
            + sample_metrics_line(set_metrics, "eval/"),
            highlight=False,
        )
    for name, rows in summary["examples"].items():
        for row in rows:
            console.print(
                f"  [{name}] {row['response'][:160]!r}  (truth: {row['ground_truth']})", highlight=False, markup=False
            )
    console.print(f"wrote {output_dir / f'{stem}.jsonl'} and {output_dir / 'summary.json'}", highlight=False)
    return summary
