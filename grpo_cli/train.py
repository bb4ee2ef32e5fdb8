"""The GRPO loop (design.md section 1), read top to bottom like Algorithm 1:

    for each step: sample prompts -> generate G completions each -> score -> group-relative advantages
                   -> (old log-probs, reference log-probs) -> epochs x train batches x microbatches of updates

A step has two phases with one owner each: `RolloutWorker.produce` makes a scored rollout batch (the first
line) and `Learner.learn` learns from it (the second). `GRPOTrainer` runs both in this process, taking turns
(sync=on_policy, multi_epoch); `grpo_cli.disaggregated` runs them as Ray actors that overlap (one_behind,
replay_buffer).

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
from grpo_cli.core import compute_entropy, grpo_microbatch_train_step, masked_mean, normalize_group_rewards
from grpo_cli.core.advantages import fraction_of_zero_std_groups
from grpo_cli.core.logprobs import get_response_log_probs_from_logits
from grpo_cli.core.tokenization import tokenize_prompt_and_output_ids
from grpo_cli.errors import RunStopped
from grpo_cli.evaluate import evaluate, reward_metrics, score_responses
from grpo_cli.models import apply_lora, check_quantization, load_policy, resolve_device, resolve_dtype
from grpo_cli.prompt_sharing import shared_prompt_response_hidden, worth_sharing
from grpo_cli.rollout import RolloutEngine, SamplingSettings, WeightSyncError, build_rollout_engine, render_prompts
from grpo_cli.sync import DISAGGREGATED, lag, overlap_fraction
from grpo_cli.tasks import Example, load_examples, make_reward_fn, stop_strings
from grpo_cli.tracking import build_metrics_sink, read_metrics
from grpo_cli.tracking.console import (
    StepProgress,
    format_eval_line,
    format_step_line,
    generation_progress,
    step_time_table,
)


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
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the labels at response positions only, as a (B, T) tensor that is 0 elsewhere.

    The LM head and log-softmax run only on response tokens: over a 49k vocabulary they cost as much as the
    rest of the model, and prompt positions are never scored. Right padding needs no attention mask: causal
    attention never lets a real token see the padding after it. With `share_prompts`, rows with the same
    prompt share one forward pass of it (grpo_cli/prompt_sharing.py; same numbers, fewer FLOPs).
    """
    mask = response_mask.bool()
    decoder = model.get_decoder()
    # Gradient checkpointing turns the KV cache off, and the shared pass needs it.
    if share_prompts and not _recomputes_activations(model) and worth_sharing(input_ids, mask):
        hidden = shared_prompt_response_hidden(decoder, input_ids, labels, mask, pad_id=0)  # (N, H)
    else:
        hidden = decoder(input_ids=input_ids).last_hidden_state[mask]  # (N, H)
    logits = model.get_output_embeddings()(hidden)  # (N, V), N = response tokens in the batch
    out = get_response_log_probs_from_logits(logits, labels[mask], return_token_entropy=False)
    log_probs = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
    log_probs[mask] = out["log_probs"].float()
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = compute_entropy(logits.detach().float()).mean()
    return log_probs, entropy


def tokens_through_model(data: RolloutData, indices: list[int], share_prompts: bool) -> int:
    """Tokens one forward pass over the microbatch `indices` processes (without padding)."""
    completions = sum(len(data.completion_ids[i]) for i in indices)
    if share_prompts:
        distinct = {tuple(data.prompt_ids[i]) for i in indices}
        if len(distinct) < len(indices):  # response_log_probs shares only then
            return completions + sum(len(p) for p in distinct)
    return completions + sum(len(data.prompt_ids[i]) for i in indices)


def _recomputes_activations(model: torch.nn.Module) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # the newer name first
        if hasattr(type(base), name):
            return bool(getattr(base, name))
    return False


@dataclass
class RolloutData:
    """One scored rollout batch, per completion, ready to be cut into microbatches."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    raw_rewards: torch.Tensor  # (n,)
    advantages: torch.Tensor  # (n,)
    old_log_probs: list[torch.Tensor] | None = None  # per completion, (len_i,)
    ref_log_probs: list[torch.Tensor] | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # rollout statistics and the producer's timings
    policy_version: int = 0  # the version of the weights that sampled it (the oldest, for a replay sample)


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
    model: torch.nn.Module,
    data: RolloutData,
    microbatch_size: int,
    pad_token_id: int,
    device: torch.device,
    share_prompts: bool = False,
) -> list[torch.Tensor]:
    """Response-token log-probs of every completion under `model` (old or reference policy), no grad."""
    result: list[torch.Tensor] = []
    for start in range(0, len(data.completion_ids), microbatch_size):
        indices = list(range(start, min(start + microbatch_size, len(data.completion_ids))))
        batch = make_microbatch(data, indices, pad_token_id, device)
        log_probs, _ = response_log_probs(
            model, batch["input_ids"], batch["labels"], batch["response_mask"], share_prompts=share_prompts
        )
        mask = batch["response_mask"].bool()
        result.extend(row[row_mask].cpu() for row, row_mask in zip(log_probs, mask, strict=True))
    return result


def sampling_settings(cfg: Any, n: int, seed: int, for_eval: bool = False) -> SamplingSettings:
    """How to sample: rollout.* for training batches, greedy (rollout.eval_temperature) for evaluation."""
    r = cfg.rollout
    return SamplingSettings(
        n=n,
        temperature=r.eval_temperature if for_eval else r.temperature,
        top_p=r.top_p,
        min_tokens=r.min_tokens,
        max_tokens=r.max_tokens,
        stop=stop_strings(r.stop, cfg.task.prompt),
        seed=seed,
    )


def load_policy_for(cfg: Any, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """The policy model (with LoRA adapters when asked) and its tokenizer, as model.* describes them."""
    check_quantization(cfg.model.quantization, device)
    model, tokenizer = load_policy(
        cfg.model.name_or_path,
        device,
        resolve_dtype(cfg.model.dtype, device),
        seed=cfg.model.init_seed,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        quantization=cfg.model.quantization,
    )
    lora = cfg.model.lora
    if lora.enabled:
        model = apply_lora(
            model, lora.r, lora.alpha, lora.dropout, lora.target_modules, quantized=cfg.model.quantization != "none"
        )
    return model, tokenizer


def wants_old_log_probs(cfg: Any, shape: BatchShape) -> bool:
    """Whether old (behaviour) log-probs are computed once per rollout batch (sync.old_log_probs, null: when
    needed). grpo_clip needs them whenever an update may run on a policy that moved since the rollout: several
    optimizer steps per batch, or a generator that runs behind the learner (one_behind, replay_buffer). With
    one on-policy step the ratio is exactly 1 and the current log-probs serve (detached)."""
    if cfg.sync.old_log_probs is not None:
        return bool(cfg.sync.old_log_probs)
    off_policy = shape.optimizer_steps_per_rollout_batch > 1 or cfg.sync.strategy in DISAGGREGATED
    return cfg.loss.type == "grpo_clip" and off_policy


class RolloutWorker:
    """Phase 1 of a step: produce one scored rollout batch. Prompts -> generate G completions each -> score
    -> group-relative advantages (-> the behaviour policy's log-probs, for disaggregated strategies).

    In-process (on_policy, multi_epoch) it samples from the learner's own model; as a Ray actor (one_behind,
    replay_buffer) it loads its own copy of the policy and receives new weights through `load_weights`.
    """

    def __init__(self, cfg: Any, model: torch.nn.Module | None = None, tokenizer: Any = None, threads: int = 0):
        if threads:
            torch.set_num_threads(threads)  # two actors on one machine must not fight over every core
        self.cfg = cfg
        self.shape = BatchShape.from_config(cfg)
        self.device = resolve_device(cfg.model.device)
        if model is None:
            seed_everything(cfg.seed)
            model, tokenizer = load_policy_for(cfg, self.device)
        self.model, self.tokenizer = model, tokenizer
        self.reward_fn = make_reward_fn(cfg.task)
        self.autocast = autocast_factory(self.device, cfg.model.mixed_precision)
        self.engine: RolloutEngine = build_rollout_engine(cfg, self.model, self.tokenizer)
        self.version = 0  # the policy version the engine samples from (its copy's; in-process: the learner's)
        self.load_s = 0.0  # weight loads since the last batch: reported with the next batch

    def describe(self) -> str:
        return f"{self.device} ({next(self.model.parameters()).dtype})"

    def produce(self, examples: list[Example], seed_step: int, with_old_log_probs: bool = False) -> RolloutData:
        """Generate, score and compute advantages for one rollout batch; its metrics hold rollout statistics and
        the time of each phase. seed_step fixes the sampling seed (the step number for one batch per step)."""
        cfg, shape = self.cfg, self.shape
        busy_start = time.perf_counter()
        prompt_ids = render_prompts([e.prompt for e in examples], self.tokenizer)
        t0 = time.perf_counter()
        sampling = sampling_settings(cfg, shape.group_size, seed=cfg.seed * 1_000_003 + seed_step)
        with self.autocast():
            rollout = self.engine.generate(prompt_ids, sampling)
        generation_s = time.perf_counter() - t0

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
        data.policy_version = self.version

        # The behaviour policy's log-probs, by the exact weights that sampled (the learner may have moved on).
        t0 = time.perf_counter()
        if with_old_log_probs:
            with self.autocast():
                data.old_log_probs = per_completion_log_probs(
                    self.model, data, shape.microbatch_size, self.tokenizer.pad_token_id, self.device
                )
        old_log_probs_s = time.perf_counter() - t0

        lengths = [len(ids) for ids in rollout.completion_ids]
        data.metrics = {
            **reward_metrics(scores, "train"),
            "train/reward_std": raw_rewards.std().item() if len(raw_rewards) > 1 else 0.0,
            "train/frac_zero_std_groups": fraction_of_zero_std_groups(raw_rewards, shape.group_size),
            "train/response_length_mean": sum(lengths) / len(lengths),
            "train/response_length_max": max(lengths),
            "train/truncated_frac": sum(rollout.truncated) / len(lengths),
            "time/generation_s": generation_s,
            "time/scoring_s": scoring_s,
            "time/old_log_probs_s": old_log_probs_s,
            "time/weight_load_s": self.load_s,
            "time/produce_s": time.perf_counter() - busy_start + self.load_s,
            "throughput/generation_tokens_per_s": sum(lengths) / max(generation_s, 1e-9),
            "n_tokens": float(sum(lengths)),
        }
        self.load_s = 0.0
        return data

    def sync_weights(self, version: int) -> dict[str, float]:
        """In-process: the engine picks up the learner's updated weights (nothing to copy for rollout=hf)."""
        self.version = version
        return self.engine.sync_weights()

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> float:
        """As a Ray actor: load the learner's trainable weights into this copy, then into the engine.
        Returns the seconds it took (also reported with the next batch)."""
        t0 = time.perf_counter()
        own = dict(self.model.named_parameters())
        unknown = sorted(set(tensors) - set(own))
        if unknown:
            raise RuntimeError(f"the generator's policy copy has no parameters named {unknown[:3]}")
        with torch.no_grad():
            for name, value in tensors.items():
                own[name].copy_(value)
        self.engine.sync_weights()
        self.version = version
        seconds = time.perf_counter() - t0
        self.load_s += seconds
        return seconds

    def evaluate(
        self, examples: list[Example], on_generated: Callable[[int], None] | None = None
    ) -> tuple[dict[str, float], list[dict[str, Any]], int]:
        """Greedy held-out evaluation of the weights this worker holds: (metrics, records, policy version)."""
        sampling = sampling_settings(self.cfg, 1, seed=self.cfg.seed, for_eval=True)
        metrics, records = evaluate(
            self.engine, self.tokenizer, self.reward_fn, examples, sampling, on_generated=on_generated
        )
        return metrics, records, self.version

    def close(self) -> None:
        self.engine.close()


class Learner:
    """Phase 2 of a step: learn from one scored rollout batch. (Old log-probs if needed and not given,)
    reference log-probs, then epochs x train batches x microbatches of updates. Owns the trained policy, the
    optimizer, the KL reference, and the checkpoints (weights, optimizer, RNG states).

    In-process for on_policy and multi_epoch; a Ray actor for one_behind and replay_buffer.
    """

    def __init__(self, cfg: Any, output_dir: Path, threads: int = 0) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.cfg = cfg
        self.output_dir = Path(output_dir)
        self.shape = BatchShape.from_config(cfg)
        seed_everything(cfg.seed)
        self.device = resolve_device(cfg.model.device)
        load_start = time.perf_counter()
        self.model, self.tokenizer = load_policy_for(cfg, self.device)
        self.load_s = time.perf_counter() - load_start
        self.autocast = autocast_factory(self.device, cfg.model.mixed_precision)
        self.needs_reference = cfg.kl.beta > 0 or cfg.kl.monitor
        # With LoRA the reference is the base model with adapters switched off: no second copy in memory.
        lora = cfg.model.lora.enabled
        self.reference = frozen_copy(self.model) if self.needs_reference and not lora else None
        self.trainable_parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.trainable_parameters,
            lr=cfg.optim.lr,
            weight_decay=cfg.optim.weight_decay,
            betas=tuple(cfg.optim.betas),
            # One fused kernel over all parameters instead of a loop of per-tensor ops: 0.08 s instead of
            # 0.41 s per step for SmolLM2-135M on this CPU (same update rule).
            fused=self.device.type in ("cpu", "cuda"),
        )
        self.pad_token_id = self.tokenizer.pad_token_id
        self.length_constant = cfg.normalization.length_constant or cfg.rollout.max_tokens
        self.needs_old_log_probs = wants_old_log_probs(cfg, self.shape)
        self.nonfinite_streak = 0
        self.version = 0  # optimizer passes over rollout batches so far: the step of the weights

    def describe(self) -> str:
        return f"{self.device} ({next(self.model.parameters()).dtype})"

    # --- checkpoints ----------------------------------------------------------------------------------------
    def resume(self) -> tuple[int, dict[str, Any], list[str]]:
        """Load the newest usable checkpoint of the run directory: (its step, trainer state, messages)."""
        messages = []
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
                messages.append(f"skipping checkpoint {path}: {problem}; trying the previous one")
                continue
            self.nonfinite_streak = int(checkpoint.state.get("nonfinite_streak", 0))
            self.version = checkpoint.step
            messages.append(f"resumed {self.output_dir} from {path.name} (step {checkpoint.step})")
            return checkpoint.step, checkpoint.state, messages
        raise CheckpointError(
            f"no usable checkpoint in {self.output_dir / 'checkpoints'}: start a new run without resume=..."
        )

    def save_checkpoint(self, step: int, state: dict[str, Any]) -> Path:
        state = {**state, "nonfinite_streak": self.nonfinite_streak}
        return save_checkpoint(
            self.output_dir, step, self.model, self.optimizer, state, keep=self.cfg.train.keep_checkpoints
        )

    def trainable_weights(self) -> dict[str, torch.Tensor]:
        """CPU copies of the trained weights (only the adapters with LoRA), for the generator's copy."""
        return {name: p.detach().to("cpu", copy=True) for name, p in self.model.named_parameters() if p.requires_grad}

    @contextmanager
    def reference_policy(self) -> Iterator[torch.nn.Module]:
        """The frozen initial policy: a copy, or with LoRA the same model with its adapters switched off."""
        if self.reference is not None:
            yield self.reference
        else:
            with self.model.disable_adapter():
                yield self.model

    # --- learning -----------------------------------------------------------------------------------------
    def learn(self, data: RolloutData, step: int) -> tuple[dict[str, float], int]:
        """Old and reference log-probs, then the updates. Returns (metrics, consecutive non-finite updates)."""
        shape = self.shape
        self.model.train()
        # Old log-probs once per rollout batch, reused by every epoch; a disaggregated generator sends the
        # behaviour policy's own, computed with the weights that sampled (the learner's may have moved on).
        t0 = time.perf_counter()
        if self.needs_old_log_probs and data.old_log_probs is None:
            with self.autocast():
                data.old_log_probs = per_completion_log_probs(
                    self.model, data, shape.microbatch_size, self.pad_token_id, self.device,
                    share_prompts=self.cfg.train.share_prompt_forward,
                )
        old_log_probs_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if self.needs_reference:
            with self.reference_policy() as reference, self.autocast():
                data.ref_log_probs = per_completion_log_probs(
                    reference, data, shape.microbatch_size, self.pad_token_id, self.device,
                    share_prompts=self.cfg.train.share_prompt_forward,
                )
        ref_log_probs_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        metrics = self.update(data, step)
        self.version = step
        metrics.update(
            {
                "train/lr": self.optimizer.param_groups[0]["lr"],
                "time/old_log_probs_s": old_log_probs_s,
                "time/ref_log_probs_s": ref_log_probs_s,
                "time/training_s": time.perf_counter() - t0,
            }
        )
        return metrics, self.nonfinite_streak

    def update(self, data: RolloutData, step: int) -> dict[str, float]:
        cfg, shape = self.cfg, self.shape
        n = len(data.completion_ids)
        rng = random.Random(cfg.seed * 7919 + step)
        totals: dict[str, list[float]] = {}

        skipped = 0  # updates skipped for non-finite loss or gradients
        update_start, optimizer_s, computed_tokens = time.perf_counter(), 0.0, 0

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
                    computed_tokens += tokens_through_model(data, indices, cfg.train.share_prompt_forward)
                    mb = make_microbatch(data, indices, self.pad_token_id, self.device)
                    with self.autocast():
                        policy_log_probs, entropy = response_log_probs(
                            self.model,
                            mb["input_ids"],
                            mb["labels"],
                            mb["response_mask"],
                            with_entropy=True,
                            share_prompts=cfg.train.share_prompt_forward,
                        )
                    old = mb.get("old_log_probs")
                    if old is not None:
                        # k1 estimate of KL(old || current) on the old policy's samples: how off-policy this is.
                        record("train/old_policy_kl", masked_mean(old - policy_log_probs.detach(), mb["response_mask"]))
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
                optimizer_start = time.perf_counter()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable_parameters, cfg.train.max_grad_norm)
                if math.isfinite(batch_loss) and torch.isfinite(grad_norm):
                    self.optimizer.step()
                    self.nonfinite_streak = 0
                else:
                    # One bad batch must not poison the weights (AdamW would spread NaN to every parameter).
                    self.optimizer.zero_grad(set_to_none=True)
                    self.nonfinite_streak += 1
                    skipped += 1
                optimizer_s += time.perf_counter() - optimizer_start
                record("train/loss", batch_loss)
                record("train/grad_norm", grad_norm)
        metrics = {key: sum(values) / len(values) for key, values in totals.items()}
        metrics["train/optimizer_steps"] = len(totals["train/loss"]) - skipped
        metrics["train/nonfinite_skipped"] = skipped
        metrics["time/optimizer_s"] = optimizer_s  # gradient clipping + the optimizer's step
        metrics["time/forward_backward_s"] = time.perf_counter() - update_start - optimizer_s
        # Tokens the model actually ran forward+backward on (all epochs; a shared prompt counts once per
        # microbatch) and response tokens scored, for throughput and FLOP accounting (job=benchmark).
        metrics["throughput/train_tokens"] = computed_tokens
        metrics["throughput/response_tokens"] = shape.epochs_per_rollout_batch * sum(
            len(c) for c in data.completion_ids
        )
        return metrics


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference


def step_metrics(
    rollout: dict[str, float], learned: dict[str, float], timing: dict[str, float], sync: dict[str, float]
) -> dict[str, float]:
    """One metrics.jsonl line: the rollout batch's statistics, the learner's, the time breakdown and the
    sync bookkeeping. time/step_s is the step's wall time; the phases may overlap (disaggregated strategies)."""
    rollout = dict(rollout)
    n_tokens = rollout.pop("n_tokens", 0.0)
    produce_s = rollout.pop("time/produce_s", 0.0)
    weight_load_s = rollout.pop("time/weight_load_s", 0.0)
    metrics = {**rollout, **learned, **timing, **sync}
    # Old log-probs come from the learner (in-process) or from the generator (disaggregated): one is 0.
    metrics["time/old_log_probs_s"] = rollout.get("time/old_log_probs_s", 0.0) + learned["time/old_log_probs_s"]
    # Weight sync: the learner publishing its weights plus the generator loading them (0 when they share them).
    metrics["time/sync_s"] = timing.get("time/sync_s", 0.0) + weight_load_s
    metrics["time/overlap_frac"] = overlap_fraction(produce_s, timing["time/waiting_s"])
    metrics["throughput/tokens_per_s"] = n_tokens / max(timing["time/step_s"], 1e-9)
    return metrics


class GRPOTrainer:
    """The driver of a run: draws prompts, runs the steps, evaluates, checkpoints, logs, stops cleanly.

    This class runs on_policy and multi_epoch in one process: generation and training take turns on one model.
    `grpo_cli.disaggregated.DisaggregatedTrainer` runs one_behind and replay_buffer with the generator and the
    learner as Ray actors; `build_trainer` picks the right one.
    """

    def __init__(self, cfg: Any, output_dir: Path, console: Console) -> None:
        self.cfg = cfg
        self.output_dir = output_dir
        self.console = console
        self.shape = BatchShape.from_config(cfg)
        self.train_examples = load_examples(cfg.task, "train")
        eval_examples = load_examples(cfg.task, "eval")
        self.eval_examples = eval_examples[: cfg.train.eval_examples or None]
        self.sampler = PromptSampler(self.train_examples, seed=cfg.seed)
        self.nonfinite_streak = 0
        self.stop_signal: str | None = None
        self.metrics_sink = None
        try:
            self.start_components()
            # A resumed run restores weights, optimizer, RNG and data position, and forgets the metrics logged
            # after its checkpoint (they are logged again, identically) before the metrics sink opens the file.
            self.start_step = self._resume() if cfg.resume else 0
            self.after_start()
            # metrics.jsonl always, plus W&B with logger=wandb; closed (W&B finished) in train()'s `finally`.
            self.metrics_sink = build_metrics_sink(cfg, output_dir, console)
        except BaseException:
            self.close()
            raise

    # --- the parts: learner and rollout worker in this process ------------------------------------------
    def start_components(self) -> None:
        self.learner = Learner(self.cfg, self.output_dir)
        self.worker = RolloutWorker(self.cfg, self.learner.model, self.learner.tokenizer)
        self.load_s = self.learner.load_s
        self.device_text = self.learner.describe()

    def after_start(self) -> None:
        """Runs once the weights are final (fresh or resumed): the worker samples from the learner's version."""
        self.worker.version = self.start_step

    def close(self) -> None:
        if getattr(self, "worker", None) is not None:
            self.worker.close()

    @property
    def model(self) -> torch.nn.Module:
        return self.learner.model

    @property
    def reference(self) -> torch.nn.Module | None:
        return self.learner.reference

    # --- checkpoints --------------------------------------------------------------------------------------
    def _resume(self) -> int:
        """Load the newest usable checkpoint of this run directory; returns its step."""
        step, state, messages = self.resume_learner()
        for message in messages:
            self.console.print(message, highlight=False)
        self.sampler.load_state(state["sampler"])
        self.nonfinite_streak = int(state.get("nonfinite_streak", 0))
        truncate_metrics(self.output_dir / "metrics.jsonl", step)
        return step

    def resume_learner(self) -> tuple[int, dict[str, Any], list[str]]:
        return self.learner.resume()

    def save_checkpoint(self, step: int) -> Path:
        return self.learner.save_checkpoint(step, {"sampler": self.sampler.state()})

    def _checkpoint_due(self, step: int) -> bool:
        every = self.cfg.train.checkpoint_every
        return step == self.cfg.train.steps or (every > 0 and step % every == 0)

    # --- the loop ------------------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        cfg = self.cfg
        self.console.print(
            f"policy {cfg.model.name} loaded in {self.load_s:.1f}s on {self.device_text}; "
            f"{len(self.train_examples)} train / {len(self.eval_examples)} eval examples; run dir {self.output_dir}",
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
                    try:
                        metrics = self.train_step(step)
                    except WeightSyncError as error:
                        # The update itself succeeded: keep it, then stop rather than sample from stale weights.
                        path = self.save_checkpoint(step)
                        raise RunStopped(
                            f"{error}; step {step}'s update is saved in {path}; after fixing it continue with: "
                            f"grpo-run resume={self.output_dir}",
                            exit_code=4,
                        ) from None
                    self.metrics_sink.log(metrics, step)
                    progress.print(format_step_line(step, metrics))
                    if cfg.train.eval_every and step % cfg.train.eval_every == 0 or step == cfg.train.steps:
                        summary.update(self.run_eval(step, progress))
                    progress.advance()
                    summary.update(metrics)
                    self._stop_if_asked(step)
        finally:
            _restore_signal_handlers(previous_handlers)
            if self.metrics_sink is not None:
                self.metrics_sink.close()
            self.close()
        if cfg.verbose:
            rows = [r for r in read_metrics(self.output_dir / "metrics.jsonl") if "train/loss" in r]
            title = f"time per step, mean over {len(rows)} steps ({cfg.sync.strategy})"
            self.console.print(step_time_table(rows, title=title))
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
        """One step in one process: produce a scored rollout batch with the current weights, learn from it."""
        step_start = time.perf_counter()
        examples = self.sampler.next_batch(self.shape.prompts_per_rollout_batch)
        data = self.worker.produce(examples, seed_step=step)
        # The learner sat idle for all of it: waiting == the producer's time, overlap 0.
        waiting_s = time.perf_counter() - step_start
        learned, self.nonfinite_streak = self.learner.learn(data, step)
        sync = self.worker.sync_weights(version=step)
        timing = {
            "time/step_s": time.perf_counter() - step_start,
            "time/waiting_s": waiting_s,
            "time/sync_s": sync.pop("time/sync_s", 0.0),
        }
        # Generation and training take turns on the same weights: every batch is trained on at lag 0.
        versions = {"sync/policy_version": data.policy_version, "sync/lag": lag(step - 1, data.policy_version)}
        return step_metrics(data.metrics, learned, timing, {**sync, **versions})

    # --- evaluation ---------------------------------------------------------------------------------------
    def evaluate_policy(
        self, step: int, progress: StepProgress | None
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        with generation_progress(self.console, len(self.eval_examples), f"eval @ {step}", within=progress) as advance:
            metrics, records, _version = self.worker.evaluate(self.eval_examples, on_generated=advance)
        return metrics, records

    def run_eval(self, step: int, progress: StepProgress | None = None) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics, records = self.evaluate_policy(step, progress)
        metrics["time/eval_s"] = time.perf_counter() - t0
        self.metrics_sink.log_samples(records, step)  # eval/step_<step>.jsonl, and a W&B table
        self.metrics_sink.log(metrics, step)
        line = format_eval_line(step, metrics)
        if progress is not None:
            progress.print(line)
        else:
            self.console.print(line, highlight=False)
        return metrics


def build_trainer(cfg: Any, output_dir: Path, console: Console) -> GRPOTrainer:
    """The driver for cfg.sync.strategy: in-process, or generator and learner as Ray actors."""
    if cfg.sync.strategy in DISAGGREGATED:
        from grpo_cli.disaggregated import DisaggregatedTrainer  # Ray is an optional extra

        return DisaggregatedTrainer(cfg, output_dir, console)
    return GRPOTrainer(cfg, output_dir, console)


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


def has_fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls run at least as fast as fp32 here: CUDA with bf16, or a CPU with AVX-512 BF16/AMX.

    Without those instructions (e.g. AVX2-only CPUs) PyTorch emulates bf16 matmuls, ~500x slower than fp32 on
    this project's AMD EPYC (0.3 vs 175 GFLOP/s), so `auto` keeps fp32 there.
    """
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(getattr(torch.cpu, name, lambda: False)() for name in checks)
    return False


def autocast_factory(device: torch.device, mixed_precision: str) -> Callable[[], AbstractContextManager]:
    """A factory of the context that forward passes run in: bf16 autocast, or nothing."""
    if mixed_precision == "auto":
        use_bf16 = has_fast_bf16(device)
    else:
        use_bf16 = mixed_precision == "bf16"
    if not use_bf16:
        return nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed)
