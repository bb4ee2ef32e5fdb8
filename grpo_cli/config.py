"""Structured-config schemas for every config group, registered in Hydra's ConfigStore.

Each dataclass is the schema of one group (conf/<group>/*.yaml fill it in). Because the primary config
extends `grpo_config_schema`, a typo'd key (`optim.lrr=1`) or a wrong type (`train.steps=ten`) fails when
Hydra composes the config, before anything is loaded. Cross-field rules that a type cannot express live in
`validate_config`, which the CLI calls before any model loads.

Every option is documented where it is defined (as in TRL's GRPOConfig).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from grpo_cli.errors import UserFacingError


@dataclass
class LoraSettings:
    # Train low-rank adapters (peft) instead of every weight; the reference policy for KL is then the base
    # model with the adapters switched off, so no second copy is kept.
    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class ModelConfig:
    # Short name of the model choice, used in run names and reports.
    name: str = MISSING
    # "embedded:smollm2-135m-instruct" (the packaged default), "random:tiny-llama" (tests), a hub id,
    # a local HF directory, or a .gguf file.
    name_or_path: str = MISSING
    # auto | float32 | bfloat16 | float16. auto: bfloat16 on CUDA, float32 on CPU.
    dtype: str = "auto"
    # auto | cpu | cuda. auto: CUDA when available.
    device: str = "auto"
    # Recompute activations in the backward pass: less memory, ~30% more compute.
    gradient_checkpointing: bool = False
    # Seed for the weights of randomly initialised models (model=tiny_random).
    init_seed: int = 0
    # auto | no | bf16: autocast forward passes to bf16 while weights and optimizer state stay in model.dtype.
    # auto: bf16 where it is fast (CUDA with bf16; CPUs with AVX-512 BF16 or AMX), else no (AVX2-only CPUs
    # emulate bf16 matmuls hundreds of times slower than fp32).
    mixed_precision: str = "auto"
    # none | 4bit: load the base weights in 4-bit NF4 (QLoRA, bitsandbytes, CUDA only; needs LoRA).
    quantization: str = "none"
    lora: LoraSettings = field(default_factory=LoraSettings)


@dataclass
class RewardWeightsConfig:
    """task.reward_weights: one weight per reward component (0: not used). grpo-run task.reward_weights.format=0.1"""

    # The task's own reward (r1_zero: format AND correct answer).
    correctness: float = 1.0
    # The task's format_reward alone (shaping toward the format).
    format: float = 0.0
    # The task's answer_reward alone (keyword: fraction of keywords present; json: fraction of right values).
    answer: float = 0.0
    # gsm8k, regex_sum: 1 when the answer is within task.numeric_tolerance of the truth.
    numeric_close: float = 0.0


@dataclass
class TaskConfig:
    # Task registry name: keyword | math | gsm8k | lipogram | json | regex_sum.
    name: str = MISSING
    # Prompt style: chat (the tokenizer's chat template) | r1_zero | question_only. With r1_zero, generation
    # also stops at "</answer>" (kept in the output).
    prompt: str = "chat"
    # Local JSONL files overriding the task's own data (null: the task's default source).
    train_path: str | None = None
    eval_path: str | None = None
    # How many examples to build or read for each split (null: all the source has).
    n_train: int | None = 2000
    n_eval: int | None = 64
    # Seed of the synthetic data generator (independent of the training seed, so the eval set is stable).
    data_seed: int = 1234
    # keyword task: how many keywords each prompt asks for.
    keywords_per_prompt: int = 2
    # math / gsm8k: the hub dataset read through `datasets` when no local path is given.
    hub_dataset: str | None = None
    hub_config: str | None = None
    hub_train_split: str = "train"
    hub_eval_split: str = "test"
    # lipogram: the fewest words an answer may have (with the topic word) to be rewarded.
    min_words: int = 10
    # json: how many of the five fields (name, age, city, occupation, start_year) each prompt asks for.
    fields_per_prompt: int = 3
    # regex_sum: numbers per paragraph, each in 1..max_number.
    numbers_per_prompt: int = 4
    max_number: int = 99
    # Weights of the reward components (RewardWeightsConfig); their weighted sum is the reward advantages use.
    reward_weights: RewardWeightsConfig = field(default_factory=RewardWeightsConfig)
    # numeric_close: relative tolerance (0.01: within 1% of the truth).
    numeric_tolerance: float = 0.01
    # Wall-clock limit per reward call; a timeout scores 0 and is counted (train/reward_timeouts). 0: none.
    reward_timeout_s: float = 10.0


@dataclass
class LossConfig:
    # no_baseline | reinforce_with_baseline | grpo_clip
    type: str = "reinforce_with_baseline"
    # PPO clip range epsilon for grpo_clip: ratios are clipped to [1 - cliprange, 1 + cliprange].
    cliprange: float = 0.2


@dataclass
class NormalizationConfig:
    # std: (r - mean) / (std + eps) (GRPO) | mean: r - mean (Dr. GRPO)
    advantage: str = "std"
    advantage_eps: float = 1e-6
    # sequence_mean: per-response masked mean | constant: masked sum / length_constant (Dr. GRPO)
    length: str = "sequence_mean"
    # The constant of length=constant; null means rollout.max_tokens.
    length_constant: float | None = None


@dataclass
class KLConfig:
    # Weight of the KL penalty to the frozen initial policy; 0 disables the penalty.
    beta: float = 0.0
    # k1: log p - log p_ref | k3: Schulman's non-negative estimator.
    estimator: str = "k3"
    # Measure KL every step even when beta == 0 (costs one reference forward per step).
    monitor: bool = False


@dataclass
class SyncConfig:
    # How rollouts and updates interleave (README "Sync strategies"):
    #   on_policy: generate a rollout batch, take one optimizer step on it, repeat (one process).
    #   multi_epoch: several epochs / optimizer steps over each rollout batch (one process; needs grpo_clip).
    #   one_behind: the generator samples batch k+1 while the learner trains on batch k (Ray actors); the
    #     generator is never more than one policy version behind.
    #   replay_buffer: the generator keeps filling a bounded buffer of scored trajectories and each step trains
    #     on a uniform sample of it (Ray actors; needs grpo_clip).
    strategy: str = "on_policy"
    # Passes over each rollout batch (each pass takes rollout_batch_size / train_batch_size optimizer steps).
    epochs_per_rollout_batch: int = 1
    # Compute the old (behaviour) policy's log-probs once per rollout batch: null (default) when the loss needs
    # them, i.e. grpo_clip with an off-policy strategy; true also for other losses (logs train/old_policy_kl);
    # false never (then grpo_clip is only valid on-policy). With one_behind / replay_buffer the generator
    # computes them with the exact weights that sampled.
    old_log_probs: bool | None = None
    # replay_buffer: trajectories (completions) the buffer holds; the oldest are dropped when it is full.
    # At least train.rollout_batch_size, the sample each step trains on.
    buffer_size: int = 64
    # replay_buffer: trajectories sampled more than this many policy versions ago are dropped unused.
    max_staleness: int = 2
    # one_behind / replay_buffer: the Ray cluster to use (e.g. "ray://head:10001" or "auto"); null starts a
    # local Ray on this machine for the run and shuts it down afterwards.
    ray_address: str | None = None
    # CPUs reserved for each actor (generator, learner) and torch threads in it. null: half this machine's
    # cores (at least 1), so the two actors do not fight over every core.
    actor_cpus: int | None = None
    # GPUs for each actor. null: 1 when this machine has CUDA and model.device is not cpu, else 0.
    actor_gpus: float | None = None


@dataclass
class RolloutConfig:
    # hf: transformers generate.
    engine: str = "hf"
    temperature: float = 1.0
    top_p: float = 1.0
    min_tokens: int = 4
    max_tokens: int = 48
    # Stop strings; the stop string is kept in the output. EOS always stops.
    stop: list[str] = field(default_factory=list)
    # Evaluation decoding temperature: 0 is greedy.
    eval_temperature: float = 0.0
    # Prompts per generate() call (null: the whole batch at once). Caps generation memory.
    max_batch_prompts: int | None = None
    # --- vLLM only (rollout=vllm); see grpo_cli/rollout/vllm_engine.py ---
    # Fraction of GPU memory vLLM may take. It shares the GPU with the trainer (colocated), hence well below 0.9.
    gpu_memory_utilization: float = 0.4
    # KV cache size in GiB; null: from gpu_memory_utilization on GPU, 1 GiB on CPU (RAM is shared with training).
    kv_cache_memory_gb: float | None = None
    # Longest prompt + completion vLLM must hold; null: the model's own limit.
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    # Free vLLM's KV cache while the trainer runs (GPU only; vLLM ignores it on CPU).
    enable_sleep_mode: bool = False
    # Eager mode starts in seconds; CUDA graphs (false) start slower and decode faster on a GPU.
    enforce_eager: bool = True
    # Post-sync probe: largest allowed |log p_vLLM - log p_trainer|; null: 1e-3 in fp32, 0.5 in bf16.
    sync_tolerance: float | None = None
    sync_probe: bool = True
    # A weight sync taking longer than this stops the run instead of hanging it.
    sync_timeout_s: float = 300.0
    # Anything else for vllm.LLM(...), e.g. {enable_prefix_caching: false}.
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainConfig:
    # Number of GRPO steps (rollout batches). CPU-sized: 30 steps take ~12 minutes on 2 cores.
    steps: int = 30
    # Completions per rollout batch (= prompts per batch * group_size).
    rollout_batch_size: int = 16
    # Completions sampled per prompt (G).
    group_size: int = 4
    # Completions per optimizer step.
    train_batch_size: int = 16
    # Microbatches per optimizer step (train_batch_size / this = microbatch size).
    gradient_accumulation_steps: int = 2
    max_grad_norm: float = 1.0
    # Run each distinct prompt of a microbatch through the model once and share its keys/values among its G
    # completions (same numbers, ~G x fewer prompt FLOPs). Off with gradient checkpointing (no KV cache then).
    share_prompt_forward: bool = True
    # Evaluate every N steps (also at step 0 and at the end); 0 means only at the start and the end.
    eval_every: int = 10
    # Held-out examples per evaluation (null: all of task.n_eval).
    eval_examples: int | None = None
    # Save a checkpoint every N steps and at the end (0: only at the end); keep the newest K (K >= 2 leaves a
    # fallback if the newest is damaged).
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    # Skip an update whose loss or gradients are not finite; stop the run after this many in a row.
    max_nonfinite_steps: int = 3


@dataclass
class OptimConfig:
    # 2e-5 suits the CPU-sized batch of 16 completions; the handouts use 1e-5 at 256.
    lr: float = 2e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])


@dataclass
class LoggerConfig:
    # none: metrics.jsonl only | wandb: metrics.jsonl and Weights & Biases.
    backend: str = "none"
    # W&B project, entity (user or team; null: your default) and group. A multirun fills a null group with
    # the sweep's name, so the runs of one sweep sit together.
    project: str = "grpo-cli"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    # W&B run name; null: the run directory's name (e.g. 3_optim.lr=1e-05,seed=1 in a multirun).
    name: str | None = None
    # online | offline | disabled. online without an API key, or without a server answering within
    # init_timeout_s, logs offline instead (upload later with `wandb sync`).
    mode: str = "offline"
    init_timeout_s: float = 15.0
    # Log a W&B table of eval completions at evaluations whose step is a multiple of this (0: no tables),
    # with at most samples_rows rows each.
    samples_every: int = 1
    samples_rows: int = 32


@dataclass
class JobConfig:
    # train | baseline_eval | report | check_reward | benchmark
    name: str = "train"
    # baseline_eval: how many held-out examples to evaluate (null: all of task.n_eval).
    n_examples: int | None = None
    # benchmark: rollout engines to compare (auto: hf, plus vllm when installed), unmeasured warm-up steps,
    # measured steps per engine.
    engines: list[str] = field(default_factory=lambda: ["auto"])
    warmup_steps: int = 1
    steps: int = 5


@dataclass
class ReportConfig:
    # job=report: run directories to compare, or one multirun directory (every run below it). A single path
    # may be given without brackets: report.runs=outputs/multirun/2026-11-22_07-00-00
    runs: Any = field(default_factory=list)
    # Where report.md and the plots go; null: the report job's own run directory (outputs/report/<time>).
    out: str | None = None


@dataclass
class GRPOConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    normalization: NormalizationConfig = field(default_factory=NormalizationConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    job: JobConfig = field(default_factory=JobConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    seed: int = 0
    # null: a new run | true: continue the newest run under the same output root | a run directory.
    resume: Any = None
    # Run directory; Hydra's ${hydra:runtime.output_dir} by default.
    output_dir: str = MISSING
    # Print a per-step metrics line on the console.
    verbose: bool = True


@dataclass(frozen=True)
class BatchShape:
    """The batch arithmetic of a run, derived once from the config (printed before any model loads)."""

    prompts_per_rollout_batch: int
    completions_per_rollout_batch: int
    group_size: int
    train_batch_size: int
    microbatch_size: int
    gradient_accumulation_steps: int
    epochs_per_rollout_batch: int
    optimizer_steps_per_rollout_batch: int
    max_new_tokens: int

    @classmethod
    def from_config(cls, cfg: Any) -> BatchShape:
        t = cfg.train
        epochs = cfg.sync.epochs_per_rollout_batch
        return cls(
            prompts_per_rollout_batch=t.rollout_batch_size // t.group_size,
            completions_per_rollout_batch=t.rollout_batch_size,
            group_size=t.group_size,
            train_batch_size=t.train_batch_size,
            microbatch_size=t.train_batch_size // t.gradient_accumulation_steps,
            gradient_accumulation_steps=t.gradient_accumulation_steps,
            epochs_per_rollout_batch=epochs,
            optimizer_steps_per_rollout_batch=epochs * t.rollout_batch_size // t.train_batch_size,
            max_new_tokens=cfg.rollout.max_tokens,
        )

    def rows(self) -> list[tuple[str, Any]]:
        return [
            ("prompts per rollout batch", self.prompts_per_rollout_batch),
            ("completions per prompt (group size)", self.group_size),
            ("completions per rollout batch", self.completions_per_rollout_batch),
            ("completions per optimizer step", self.train_batch_size),
            (
                "microbatch size (x gradient accumulation)",
                f"{self.microbatch_size} (x{self.gradient_accumulation_steps})",
            ),
            ("epochs per rollout batch", self.epochs_per_rollout_batch),
            ("optimizer steps per rollout batch", self.optimizer_steps_per_rollout_batch),
            ("max new tokens per completion", self.max_new_tokens),
            ("max generated tokens per step", self.completions_per_rollout_batch * self.max_new_tokens),
        ]


def register_configs() -> None:
    """Register the schemas so conf/config.yaml can extend `grpo_config_schema`."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="grpo_config_schema", node=GRPOConfig)


# ----------------------------------------------------------------------------------------------------------
# Cross-field validation: every rule names the fields involved and what to write instead.

CHOICES: dict[str, tuple[str, ...]] = {
    "loss.type": ("no_baseline", "reinforce_with_baseline", "grpo_clip"),
    "normalization.advantage": ("std", "mean"),
    "normalization.length": ("sequence_mean", "constant"),
    "kl.estimator": ("k1", "k3"),
    "sync.strategy": ("on_policy", "multi_epoch", "one_behind", "replay_buffer"),
    "rollout.engine": ("hf", "vllm"),
    "model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "model.device": ("auto", "cpu", "cuda"),
    "model.mixed_precision": ("auto", "no", "bf16"),
    "model.quantization": ("none", "4bit"),
    "task.prompt": ("chat", "r1_zero", "question_only"),
    "logger.backend": ("none", "wandb"),
    "logger.mode": ("online", "offline", "disabled"),
    "job.name": ("train", "baseline_eval", "report", "check_reward", "benchmark"),
}


def _get(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def validate_sync(cfg: Any) -> None:
    """The sync strategy's rules: how many optimizer steps per batch, which losses stay correct off-policy,
    and the replay buffer's bounds."""
    t, sync = cfg.train, cfg.sync
    epochs = sync.epochs_per_rollout_batch
    optimizer_steps_per_batch = epochs * t.rollout_batch_size // t.train_batch_size
    if sync.strategy == "on_policy" and optimizer_steps_per_batch != 1:
        raise UserFacingError(
            f"sync=on_policy takes one optimizer step per rollout batch, but sync.epochs_per_rollout_batch={epochs} "
            f"and train.rollout_batch_size/train.train_batch_size={t.rollout_batch_size // t.train_batch_size} "
            "give more: use sync=multi_epoch, or set train.train_batch_size=train.rollout_batch_size and one epoch"
        )
    if optimizer_steps_per_batch > 1 and cfg.loss.type != "grpo_clip":
        raise UserFacingError(
            f"{optimizer_steps_per_batch} optimizer steps per rollout batch make later steps off-policy, which "
            f"loss={cfg.loss.type} ignores: use loss=grpo_clip (importance ratios with clipping)"
        )
    if sync.strategy == "replay_buffer" and cfg.loss.type != "grpo_clip":
        raise UserFacingError(
            f"sync=replay_buffer trains on trajectories up to sync.max_staleness={sync.max_staleness} policy "
            f"versions old, which loss={cfg.loss.type} ignores: use loss=grpo_clip (importance ratios with clipping)"
        )
    off_policy = optimizer_steps_per_batch > 1 or sync.strategy in ("one_behind", "replay_buffer")
    if cfg.loss.type == "grpo_clip" and off_policy and sync.old_log_probs is False:
        raise UserFacingError(
            f"loss=grpo_clip with sync={sync.strategy} needs the old policy's log-probs for its ratios, but "
            "sync.old_log_probs=false: drop that override (null computes them when needed)"
        )
    if sync.strategy == "replay_buffer":
        if sync.buffer_size < t.rollout_batch_size:
            raise UserFacingError(
                f"sync.buffer_size={sync.buffer_size} is smaller than a batch (train.rollout_batch_size="
                f"{t.rollout_batch_size}, the sample each step trains on): use sync.buffer_size>={t.rollout_batch_size}"
            )
        if sync.max_staleness < 1:
            raise UserFacingError(
                f"sync.max_staleness={sync.max_staleness}: the replay buffer needs at least 1 (the generator "
                "samples the next batch while the learner updates); use sync=on_policy for on-policy training"
            )
    if sync.actor_cpus is not None and sync.actor_cpus < 1:
        raise UserFacingError(f"sync.actor_cpus={sync.actor_cpus} must be >= 1 (null: half this machine's cores)")
    if sync.actor_gpus is not None and sync.actor_gpus < 0:
        raise UserFacingError(f"sync.actor_gpus={sync.actor_gpus} must be >= 0")


def validate_config(cfg: Any) -> None:
    """Check the rules a schema cannot express. Raises UserFacingError with a one-line message."""
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise UserFacingError(f"{key}={value!r} is not one of {', '.join(allowed)}")

    if cfg.model.quantization == "4bit" and not cfg.model.lora.enabled:
        raise UserFacingError(
            "model.quantization=4bit freezes the quantized base weights, so only adapters can train: "
            "set model.lora.enabled=true"
        )
    if cfg.model.lora.enabled and (cfg.model.lora.r <= 0 or not cfg.model.lora.target_modules):
        raise UserFacingError(
            f"model.lora.r={cfg.model.lora.r} must be positive and model.lora.target_modules non-empty"
        )
    t = cfg.train
    positive = {
        "train.steps": t.steps,
        "train.rollout_batch_size": t.rollout_batch_size,
        "train.group_size": t.group_size,
        "train.train_batch_size": t.train_batch_size,
        "train.gradient_accumulation_steps": t.gradient_accumulation_steps,
        "sync.epochs_per_rollout_batch": cfg.sync.epochs_per_rollout_batch,
        "sync.buffer_size": cfg.sync.buffer_size,
        "rollout.max_tokens": cfg.rollout.max_tokens,
        "optim.lr": cfg.optim.lr,
        "logger.init_timeout_s": cfg.logger.init_timeout_s,
        "logger.samples_rows": cfg.logger.samples_rows,
    }
    for key, value in positive.items():
        if value <= 0:
            raise UserFacingError(f"{key}={value} must be positive")
    if t.checkpoint_every < 0 or t.keep_checkpoints < 1 or t.max_nonfinite_steps < 1:
        raise UserFacingError(
            f"train.checkpoint_every={t.checkpoint_every} must be >= 0, train.keep_checkpoints={t.keep_checkpoints} "
            f"and train.max_nonfinite_steps={t.max_nonfinite_steps} >= 1"
        )
    if t.eval_every < 0:
        raise UserFacingError(f"train.eval_every={t.eval_every} must be >= 0 (0: evaluate only at start and end)")
    if cfg.logger.samples_every < 0:
        raise UserFacingError(f"logger.samples_every={cfg.logger.samples_every} must be >= 0 (0: no sample tables)")
    if t.rollout_batch_size % t.group_size:
        raise UserFacingError(
            f"train.rollout_batch_size={t.rollout_batch_size} is not divisible by train.group_size={t.group_size}: "
            f"use a multiple of {t.group_size}"
        )
    if t.train_batch_size % t.gradient_accumulation_steps:
        raise UserFacingError(
            f"train.train_batch_size={t.train_batch_size} is not divisible by "
            f"train.gradient_accumulation_steps={t.gradient_accumulation_steps}: pick a divisor of {t.train_batch_size}"
        )
    if t.train_batch_size < t.group_size:
        raise UserFacingError(
            f"train.train_batch_size={t.train_batch_size} is smaller than train.group_size={t.group_size}: "
            "a train batch must hold at least one whole group"
        )
    if t.rollout_batch_size % t.train_batch_size:
        raise UserFacingError(
            f"train.rollout_batch_size={t.rollout_batch_size} is not divisible by "
            f"train.train_batch_size={t.train_batch_size}: each rollout batch must split into whole train batches"
        )
    if t.group_size < 2 and cfg.normalization.advantage == "std":
        raise UserFacingError(
            f"train.group_size={t.group_size} with normalization.advantage=std: the std of one sample is "
            "undefined; use train.group_size>=2"
        )
    if cfg.rollout.min_tokens > cfg.rollout.max_tokens:
        raise UserFacingError(
            f"rollout.min_tokens={cfg.rollout.min_tokens} exceeds rollout.max_tokens={cfg.rollout.max_tokens}"
        )
    if not 0.0 < cfg.rollout.top_p <= 1.0:
        raise UserFacingError(f"rollout.top_p={cfg.rollout.top_p} must be in (0, 1]")
    if cfg.rollout.temperature < 0 or cfg.rollout.eval_temperature < 0:
        raise UserFacingError("rollout.temperature and rollout.eval_temperature must be >= 0 (0 is greedy)")
    if cfg.rollout.temperature == 0:
        raise UserFacingError(
            "rollout.temperature=0 makes every completion of a group identical (zero advantage): use a "
            "temperature > 0 for training rollouts (rollout.eval_temperature controls evaluation)"
        )
    if not 0.0 < cfg.loss.cliprange < 1.0:
        raise UserFacingError(f"loss.cliprange={cfg.loss.cliprange} must be in (0, 1)")
    if cfg.kl.beta < 0:
        raise UserFacingError(f"kl.beta={cfg.kl.beta} must be >= 0")

    validate_sync(cfg)
    if len(cfg.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.optim.betas):
        raise UserFacingError(f"optim.betas={list(cfg.optim.betas)} must be two numbers in [0, 1)")
    if cfg.normalization.length_constant is not None and cfg.normalization.length_constant <= 0:
        raise UserFacingError(f"normalization.length_constant={cfg.normalization.length_constant} must be positive")
    from grpo_cli.tasks import validate_task_config  # the task registry knows each task's reward components

    validate_task_config(cfg.task)
