"""The GRPO loop (design.md section 1), read top to bottom like Algorithm 1:

    for each step: sample prompts -> generate G completions each -> score -> group-relative advantages
                   -> (old log-probs, reference log-probs) -> epochs x train batches x microbatches of updates

What it leaves out on purpose: no value model (the group mean is the baseline), no per-token rewards (one
scalar per completion, broadcast over its tokens), and no re-tokenization of sampled text (the trainer scores
the exact token ids the rollout engine sampled, so the response mask cannot drift from what was generated).
"""

from __future__ import annotations

import copy
import json
import math
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console

from grpo_cli.checkpoint import CheckpointError, list_checkpoints, load_checkpoint, save_checkpoint, verify_checkpoint
from grpo_cli.config import BatchShape
from grpo_cli.core import compute_entropy, grpo_microbatch_train_step, normalize_group_rewards
from grpo_cli.core.advantages import fraction_of_zero_std_groups
from grpo_cli.core.logprobs import get_response_log_probs_from_logits
from grpo_cli.core.tokenization import tokenize_prompt_and_output_ids
from grpo_cli.errors import RunStopped
from grpo_cli.evaluate import evaluate, reward_metrics, score_responses
from grpo_cli.models import apply_lora, check_quantization, load_policy, resolve_device, resolve_dtype
from grpo_cli.rollout import RolloutEngine, SamplingSettings, build_rollout_engine, render_prompts
from grpo_cli.tasks import Example, load_examples, make_reward_fn, stop_strings
from grpo_cli.tracking import build_metrics_sink
from grpo_cli.tracking.console import StepProgress, format_eval_line, format_step_line, generation_progress


class PromptSampler:
    """Draws prompts without replacement in a seeded order, reshuffling after each pass over the data."""

    def __init__(self, examples: list[Example], seed: int) -> None:
        self.examples = examples
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self.position = 0

    def next_batch(self, n: int) -> list[Example]:
        batch = []
        while len(batch) < n:
            if self.position >= len(self.order):
                self.order = list(range(len(self.examples)))
                self.rng.shuffle(self.order)
                self.position = 0
            batch.append(self.examples[self.order[self.position]])
            self.position += 1
        return batch

    def state(self) -> dict[str, Any]:
        """JSON-serializable position in the data, so a resumed run draws the same prompts."""
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss], "order": self.order, "position": self.position}

    def load_state(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.order, self.position = list(state["order"]), int(state["position"])


def response_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    response_mask: torch.Tensor,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the labels at response positions only, as a (B, T) tensor that is 0 elsewhere.

    The LM head and log-softmax run only on response tokens: over a 49k vocabulary they cost as much as the
    rest of the model, and prompt positions are never scored. Right padding needs no attention mask: causal
    attention never lets a real token see the padding after it.
    """
    hidden = model.get_decoder()(input_ids=input_ids).last_hidden_state  # (B, T, H)
    mask = response_mask.bool()
    logits = model.get_output_embeddings()(hidden[mask])  # (N, V), N = response tokens in the batch
    out = get_response_log_probs_from_logits(logits, labels[mask], return_token_entropy=False)
    log_probs = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
    log_probs[mask] = out["log_probs"].float()
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = compute_entropy(logits.detach().float()).mean()
    return log_probs, entropy


@dataclass
class RolloutData:
    """One scored rollout batch, per completion, ready to be cut into microbatches."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    raw_rewards: torch.Tensor  # (n,)
    advantages: torch.Tensor  # (n,)
    old_log_probs: list[torch.Tensor] | None = None  # per completion, (len_i,)
    ref_log_probs: list[torch.Tensor] | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def make_microbatch(data: RolloutData, indices: list[int], pad_token_id: int, device: torch.device) -> dict:
    batch = tokenize_prompt_and_output_ids(
        [data.prompt_ids[i] for i in indices], [data.completion_ids[i] for i in indices], pad_token_id
    )
    batch = {k: v.to(device) for k, v in batch.items()}
    mask = batch["response_mask"].bool()
    for name in ("old_log_probs", "ref_log_probs"):
        per_sample = getattr(data, name)
        if per_sample is not None:
            # Row-major order of mask positions == per-completion order of the stored token log-probs.
            full = torch.zeros(mask.shape, dtype=torch.float32, device=device)
            full[mask] = torch.cat([per_sample[i] for i in indices]).to(device)
            batch[name] = full
    batch["raw_rewards"] = data.raw_rewards[indices].unsqueeze(1).to(device)  # (B, 1)
    batch["advantages"] = data.advantages[indices].unsqueeze(1).to(device)  # (B, 1)
    return batch


@torch.inference_mode()
def per_completion_log_probs(
    model: torch.nn.Module, data: RolloutData, microbatch_size: int, pad_token_id: int, device: torch.device
) -> list[torch.Tensor]:
    """Response-token log-probs of every completion under `model` (old or reference policy), no grad."""
    result: list[torch.Tensor] = []
    for start in range(0, len(data.completion_ids), microbatch_size):
        indices = list(range(start, min(start + microbatch_size, len(data.completion_ids))))
        batch = make_microbatch(data, indices, pad_token_id, device)
        log_probs, _ = response_log_probs(model, batch["input_ids"], batch["labels"], batch["response_mask"])
        mask = batch["response_mask"].bool()
        result.extend(row[row_mask].cpu() for row, row_mask in zip(log_probs, mask, strict=True))
    return result


class GRPOTrainer:
    def __init__(self, cfg: Any, output_dir: Path, console: Console) -> None:
        self.cfg = cfg
        self.output_dir = output_dir
        self.console = console
        self.shape = BatchShape.from_config(cfg)
        # The task's reward for task.prompt, weighted per task.reward_weights, time-limited per call.
        self.reward_fn = make_reward_fn(cfg.task)
        self.train_examples = load_examples(cfg.task, "train")
        eval_examples = load_examples(cfg.task, "eval")
        self.eval_examples = eval_examples[: cfg.train.eval_examples or None]

        seed_everything(cfg.seed)
        self.device = resolve_device(cfg.model.device)
        dtype = resolve_dtype(cfg.model.dtype, self.device)
        load_start = time.perf_counter()
        check_quantization(cfg.model.quantization, self.device)
        self.model, self.tokenizer = load_policy(
            cfg.model.name_or_path,
            self.device,
            dtype,
            seed=cfg.model.init_seed,
            gradient_checkpointing=cfg.model.gradient_checkpointing,
            quantization=cfg.model.quantization,
        )
        lora = cfg.model.lora
        if lora.enabled:
            self.model = apply_lora(
                self.model,
                lora.r,
                lora.alpha,
                lora.dropout,
                lora.target_modules,
                quantized=cfg.model.quantization != "none",
            )
        self.load_s = time.perf_counter() - load_start
        self.autocast = autocast_factory(self.device, cfg.model.mixed_precision)
        self.needs_reference = cfg.kl.beta > 0 or cfg.kl.monitor
        # With LoRA the reference is the base model with adapters switched off: no second copy in memory.
        self.reference = self._frozen_copy(self.model) if self.needs_reference and not lora.enabled else None
        self.engine: RolloutEngine = build_rollout_engine(cfg, self.model, self.tokenizer)
        self.trainable_parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.trainable_parameters,
            lr=cfg.optim.lr,
            weight_decay=cfg.optim.weight_decay,
            betas=tuple(cfg.optim.betas),
        )
        self.sampler = PromptSampler(self.train_examples, seed=cfg.seed)
        self.pad_token_id = self.tokenizer.pad_token_id
        self.length_constant = cfg.normalization.length_constant or cfg.rollout.max_tokens
        # grpo_clip needs old log-probs only when some update runs on a policy that moved since the rollout;
        # with one optimizer step per batch the ratio is exactly 1 and the current log-probs serve (detached).
        self.needs_old_log_probs = cfg.loss.type == "grpo_clip" and self.shape.optimizer_steps_per_rollout_batch > 1
        self.nonfinite_streak = 0
        self.stop_signal: str | None = None
        # A resumed run restores weights, optimizer, RNG and data position, and forgets the metrics logged
        # after its checkpoint (they are logged again, identically) before the metrics sink opens the file.
        self.start_step = self._resume() if cfg.resume else 0
        # metrics.jsonl always, plus W&B with logger=wandb; closed (W&B finished) in train()'s `finally`.
        self.metrics_sink = build_metrics_sink(cfg, output_dir, console)

    # --- checkpoints --------------------------------------------------------------------------------------
    def _resume(self) -> int:
        """Load the newest usable checkpoint of this run directory; returns its step."""
        for path in reversed(list_checkpoints(self.output_dir)):
            problem = verify_checkpoint(path)
            if problem is None:
                try:
                    checkpoint = load_checkpoint(path, self.model, self.optimizer)
                except CheckpointError:
                    raise
                except Exception as error:  # noqa: BLE001 - a damaged file: fall back to the previous one
                    problem = f"it cannot be read ({type(error).__name__}: {str(error)[:120]})"
            if problem is not None:
                self.console.print(f"skipping checkpoint {path}: {problem}; trying the previous one", highlight=False)
                continue
            self.sampler.load_state(checkpoint.state["sampler"])
            self.nonfinite_streak = int(checkpoint.state.get("nonfinite_streak", 0))
            truncate_metrics(self.output_dir / "metrics.jsonl", checkpoint.step)
            self.console.print(f"resumed {self.output_dir} from {path.name} (step {checkpoint.step})", highlight=False)
            return checkpoint.step
        raise CheckpointError(
            f"no usable checkpoint in {self.output_dir / 'checkpoints'}: start a new run without resume=..."
        )

    def save_checkpoint(self, step: int) -> Path:
        state = {"sampler": self.sampler.state(), "nonfinite_streak": self.nonfinite_streak}
        return save_checkpoint(
            self.output_dir, step, self.model, self.optimizer, state, keep=self.cfg.train.keep_checkpoints
        )

    def _checkpoint_due(self, step: int) -> bool:
        every = self.cfg.train.checkpoint_every
        return step == self.cfg.train.steps or (every > 0 and step % every == 0)

    @contextmanager
    def reference_policy(self) -> Iterator[torch.nn.Module]:
        """The frozen initial policy: a copy, or with LoRA the same model with its adapters switched off."""
        if self.reference is not None:
            yield self.reference
        else:
            with self.model.disable_adapter():
                yield self.model

    @staticmethod
    def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
        reference = copy.deepcopy(model).eval()
        reference.requires_grad_(False)
        return reference

    def sampling(self, n: int, seed: int, for_eval: bool = False) -> SamplingSettings:
        r = self.cfg.rollout
        return SamplingSettings(
            n=n,
            temperature=r.eval_temperature if for_eval else r.temperature,
            top_p=r.top_p,
            min_tokens=r.min_tokens,
            max_tokens=r.max_tokens,
            stop=stop_strings(r.stop, self.cfg.task.prompt),
            seed=seed,
        )

    # --- the loop ------------------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        cfg = self.cfg
        self.console.print(
            f"policy {cfg.model.name} loaded in {self.load_s:.1f}s on {self.device} "
            f"({next(self.model.parameters()).dtype}); {len(self.train_examples)} train / "
            f"{len(self.eval_examples)} eval examples; run dir {self.output_dir}",
            highlight=False,
        )
        summary: dict[str, float] = {}
        previous_handlers = self._install_signal_handlers()
        try:
            if self.start_step == 0:
                summary.update(self.run_eval(step=0))
            summary["baseline/eval_reward"] = baseline_eval_reward(self.output_dir / "metrics.jsonl")
            with StepProgress(cfg.train.steps, self.console, enabled=cfg.verbose) as progress:
                progress.advance(self.start_step)
                for step in range(self.start_step + 1, cfg.train.steps + 1):
                    metrics = self.train_step(step)
                    self.metrics_sink.log(metrics, step)
                    progress.print(format_step_line(step, metrics))
                    if cfg.train.eval_every and step % cfg.train.eval_every == 0 or step == cfg.train.steps:
                        summary.update(self.run_eval(step, progress))
                    progress.advance()
                    summary.update(metrics)
                    self._stop_if_asked(step)
        finally:
            _restore_signal_handlers(previous_handlers)
            self.metrics_sink.close()
            self.engine.close()
        return summary

    # --- safe points: checkpoints, signals, non-finite numbers ---------------------------------------------
    def _stop_if_asked(self, step: int) -> None:
        """After a whole step (the safe point): checkpoint when due, and stop on a signal or on divergence."""
        limit = self.cfg.train.max_nonfinite_steps
        stopping = self.stop_signal is not None or self.nonfinite_streak >= limit
        if stopping or self._checkpoint_due(step):
            path = self.save_checkpoint(step)
        if self.stop_signal is not None:
            code = 130 if self.stop_signal == "SIGINT" else 143
            raise RunStopped(
                f"stopped by {self.stop_signal} after step {step}; checkpoint {path}; "
                f"continue with: grpo-run resume={self.output_dir}",
                exit_code=code,
            )
        if self.nonfinite_streak >= limit:
            raise RunStopped(
                f"loss or gradients were not finite in {limit} consecutive steps (last: step {step}); those "
                f"updates were skipped and the weights in {path} are the last good ones: lower optim.lr or check "
                "the reward function, then continue with: grpo-run resume=" + str(self.output_dir),
                exit_code=3,
            )

    def _install_signal_handlers(self) -> dict[int, Any]:
        """SIGINT/SIGTERM finish the current step, checkpoint and exit; a second SIGINT interrupts at once."""
        if threading.current_thread() is not threading.main_thread():
            return {}

        def request_stop(signum: int, _frame: Any) -> None:
            if self.stop_signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.stop_signal = signal.Signals(signum).name
            self.console.print(
                f"{self.stop_signal} received: finishing this step, then writing a checkpoint "
                "(press Ctrl-C again to stop at once, without one)",
                highlight=False,
            )

        return {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}

    def train_step(self, step: int) -> dict[str, float]:
        cfg, shape = self.cfg, self.shape
        step_start = time.perf_counter()
        self.model.train()

        # 1. Sample prompts and generate G completions each from the current (old) policy.
        examples = self.sampler.next_batch(shape.prompts_per_rollout_batch)
        prompt_ids = render_prompts([e.prompt for e in examples], self.tokenizer)
        t0 = time.perf_counter()
        sampling = self.sampling(shape.group_size, seed=cfg.seed * 1_000_003 + step)
        with self.autocast():
            rollout = self.engine.generate(prompt_ids, sampling)
        generation_s = time.perf_counter() - t0

        # 2. Score, then group-relative advantages.
        t0 = time.perf_counter()
        truths = [e.ground_truth for e in examples for _ in range(shape.group_size)]
        scores = score_responses(self.reward_fn, rollout.texts, truths)
        raw_rewards = torch.tensor([r["reward"] for r in scores.rewards], dtype=torch.float32)
        advantages = normalize_group_rewards(
            raw_rewards,
            shape.group_size,
            cfg.normalization.advantage_eps,
            normalize_by_std=cfg.normalization.advantage == "std",
        )
        scoring_s = time.perf_counter() - t0
        data = RolloutData(rollout.prompt_ids, rollout.completion_ids, raw_rewards, advantages)

        # 3. Old log-probs (once per rollout batch, reused by every epoch) and reference log-probs.
        t0 = time.perf_counter()
        if self.needs_old_log_probs:
            with self.autocast():
                data.old_log_probs = per_completion_log_probs(
                    self.model, data, shape.microbatch_size, self.pad_token_id, self.device
                )
        old_log_probs_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if self.needs_reference:
            with self.reference_policy() as reference, self.autocast():
                data.ref_log_probs = per_completion_log_probs(
                    reference, data, shape.microbatch_size, self.pad_token_id, self.device
                )
        ref_log_probs_s = time.perf_counter() - t0

        # 4. Updates: epochs x train batches x microbatches.
        t0 = time.perf_counter()
        update_metrics = self.update(data, step)
        training_s = time.perf_counter() - t0
        sync_metrics = self.engine.sync_weights()

        lengths = [len(ids) for ids in rollout.completion_ids]
        n_tokens = sum(lengths)
        step_s = time.perf_counter() - step_start
        metrics = {
            **reward_metrics(scores, "train"),
            "train/reward_std": raw_rewards.std().item() if len(raw_rewards) > 1 else 0.0,
            "train/frac_zero_std_groups": fraction_of_zero_std_groups(raw_rewards, shape.group_size),
            "train/response_length_mean": n_tokens / len(lengths),
            "train/response_length_max": max(lengths),
            "train/truncated_frac": sum(rollout.truncated) / len(lengths),
            **update_metrics,
            "train/lr": self.optimizer.param_groups[0]["lr"],
            "time/step_s": step_s,
            "time/generation_s": generation_s,
            "time/scoring_s": scoring_s,
            "time/old_log_probs_s": old_log_probs_s,
            "time/ref_log_probs_s": ref_log_probs_s,
            "time/training_s": training_s,
            **sync_metrics,
            "throughput/generation_tokens_per_s": n_tokens / max(generation_s, 1e-9),
            "throughput/tokens_per_s": n_tokens / max(step_s, 1e-9),
        }
        return metrics

    def update(self, data: RolloutData, step: int) -> dict[str, float]:
        cfg, shape = self.cfg, self.shape
        n = len(data.completion_ids)
        rng = random.Random(cfg.seed * 7919 + step)
        totals: dict[str, list[float]] = {}

        skipped = 0  # updates skipped for non-finite loss or gradients

        def record(key: str, value: float) -> None:
            totals.setdefault(key, []).append(float(value))

        for _epoch in range(shape.epochs_per_rollout_batch):
            order = list(range(n))
            if shape.optimizer_steps_per_rollout_batch > 1:
                rng.shuffle(order)  # whole groups need not stay together: advantages are already computed
            for batch_start in range(0, n, shape.train_batch_size):
                batch_indices = order[batch_start : batch_start + shape.train_batch_size]
                self.optimizer.zero_grad(set_to_none=True)
                batch_loss = 0.0
                for mb_start in range(0, len(batch_indices), shape.microbatch_size):
                    indices = batch_indices[mb_start : mb_start + shape.microbatch_size]
                    mb = make_microbatch(data, indices, self.pad_token_id, self.device)
                    with self.autocast():
                        policy_log_probs, entropy = response_log_probs(
                            self.model, mb["input_ids"], mb["labels"], mb["response_mask"], with_entropy=True
                        )
                    old = mb.get("old_log_probs")
                    if old is None and cfg.loss.type == "grpo_clip":
                        old = policy_log_probs.detach()  # one update per rollout batch: ratio is exactly 1
                    loss, meta = grpo_microbatch_train_step(
                        policy_log_probs=policy_log_probs,
                        response_mask=mb["response_mask"],
                        gradient_accumulation_steps=shape.gradient_accumulation_steps,
                        loss_type=cfg.loss.type,
                        raw_rewards=mb["raw_rewards"],
                        advantages=mb["advantages"],
                        old_log_probs=old,
                        cliprange=cfg.loss.cliprange,
                        length_normalization=cfg.normalization.length,
                        normalize_constant=self.length_constant,
                        ref_log_probs=mb.get("ref_log_probs"),
                        kl_beta=cfg.kl.beta,
                        kl_estimator=cfg.kl.estimator,
                    )
                    batch_loss += float(loss)
                    record("train/entropy", entropy)
                    for key in ("kl", "clip_fraction", "ratio_mean"):
                        if key in meta:
                            record(f"train/{key}", meta[key])
                grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable_parameters, cfg.train.max_grad_norm)
                if math.isfinite(batch_loss) and torch.isfinite(grad_norm):
                    self.optimizer.step()
                    self.nonfinite_streak = 0
                else:
                    # One bad batch must not poison the weights (AdamW would spread NaN to every parameter).
                    self.optimizer.zero_grad(set_to_none=True)
                    self.nonfinite_streak += 1
                    skipped += 1
                record("train/loss", batch_loss)
                record("train/grad_norm", grad_norm)
        metrics = {key: sum(values) / len(values) for key, values in totals.items()}
        metrics["train/optimizer_steps"] = len(totals["train/loss"]) - skipped
        metrics["train/nonfinite_skipped"] = skipped
        return metrics

    # --- evaluation ---------------------------------------------------------------------------------------
    def run_eval(self, step: int, progress: StepProgress | None = None) -> dict[str, float]:
        t0 = time.perf_counter()
        with generation_progress(self.console, len(self.eval_examples), f"eval @ {step}", within=progress) as advance:
            metrics, records = evaluate(
                self.engine,
                self.tokenizer,
                self.reward_fn,
                self.eval_examples,
                self.sampling(1, seed=self.cfg.seed, for_eval=True),
                on_generated=advance,
            )
        metrics["time/eval_s"] = time.perf_counter() - t0
        self.metrics_sink.log_samples(records, step)  # eval/step_<step>.jsonl, and a W&B table
        self.metrics_sink.log(metrics, step)
        line = format_eval_line(step, metrics)
        if progress is not None:
            progress.print(line)
        else:
            self.console.print(line, highlight=False)
        return metrics


def _restore_signal_handlers(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop metrics.jsonl lines logged after `last_step` (a resumed run logs them again)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


def baseline_eval_reward(path: Path) -> float:
    """The step-0 evaluation's reward from metrics.jsonl (also right after a resume)."""
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["step"] == 0 and "eval/reward" in row:
            return float(row["eval/reward"])
    return float("nan")


def autocast_factory(device: torch.device, mixed_precision: str) -> Callable[[], AbstractContextManager]:
    """A factory of the context that forward passes run in: bf16 autocast, or nothing."""
    if mixed_precision == "auto":
        use_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    else:
        use_bf16 = mixed_precision == "bf16"
    if not use_bf16:
        return nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed)
