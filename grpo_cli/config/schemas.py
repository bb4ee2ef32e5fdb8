"""The schema of every config group (conf/<group>/*.yaml fill them in) and of the whole config, GRPOConfig.

Because the primary config extends `grpo_config_schema`, a typo'd key (`optim.lrr=1`) or a wrong type
(`train.steps=ten`) fails when Hydra composes the config, before anything is loaded. Two groups have one schema
per choice: `task` (each task's schema lives next to the task; the tasks package registers them in
config/task_registry.py's TASK_SCHEMAS) and `rollout` (config/rollout_schemas.py: the sampling keys every engine
shares, plus the vLLM keys for rollout=vllm, ROLLOUT_SCHEMAS), so `task=keyword task.min_words=3` fails as a typo
would. Every option says what it is for where it is defined, as
data (`help=`, as TRL's GRPOConfig does): `grpo-run --help <group>` and docs/config-reference.md print it; what it
accepts is declared with it (grpo_cli/config/fields.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from grpo_cli.config.fields import (
    any_value,
    choice,
    flag,
    from_core,
    help_from_core,
    in_range,
    non_negative,
    path,
    positive,
)
from grpo_cli.config.rollout_schemas import ROLLOUT_SCHEMAS, SamplingConfig
from grpo_cli.config.sync_schema import DISAGGREGATED as DISAGGREGATED
from grpo_cli.config.sync_schema import KV_AFTER_UPDATE as KV_AFTER_UPDATE
from grpo_cli.config.sync_schema import ON_STALE as ON_STALE
from grpo_cli.config.sync_schema import PROXIMAL_POLICIES as PROXIMAL_POLICIES
from grpo_cli.config.sync_schema import SYNC_STRATEGIES as SYNC_STRATEGIES
from grpo_cli.config.sync_schema import SyncConfig as SyncConfig
from grpo_cli.config.task_registry import TASK_SCHEMAS


@dataclass
class LoraSettings:
    """model.lora.*: low-rank adapters (peft) instead of full fine-tuning (docs/memory.md)."""

    enabled: bool = flag(
        False,
        help="Train low-rank adapters (peft) instead of every weight; the reference policy for KL is then the base "
        "model with the adapters switched off, so no second copy is kept.",
    )
    r: int = positive(16, help="Rank of each adapter's two low-rank matrices.")
    alpha: int = positive(32, help="LoRA's scale: an adapter's output is multiplied by alpha / r.")
    dropout: float = in_range(0.0, 0, 1, high_open=True, help="Dropout on each adapter's input, in [0, 1).")
    target_modules: list[str] = any_value(
        factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        help="Names of the linear layers that get adapters (peft's target_modules).",
    )


# model.mixed_precision's values (job.precisions names them too): bf16 autocast, none, or bf16 where it is fast.
MIXED_PRECISIONS = ("auto", "no", "bf16")


@dataclass
class ModelConfig:
    """model.*: the policy model, how it is stored and where it runs (model=<choice> picks one)."""

    name: str = any_value(MISSING, help="Short name of the model choice, used in run names and reports.")
    name_or_path: str = path(
        MISSING,
        "model",
        help='"embedded:smollm2-135m-instruct" (the packaged default), "random:tiny-llama" (tests), a hub id, a '
        "local HF directory, or a .gguf file.",
    )
    dtype: str = choice(
        "auto",
        ("auto", "float32", "bfloat16", "float16"),
        help="The dtype the weights (and AdamW's state) are stored in. auto: float32 on every device (the "
        "optimizer's master copy); bf16 speed comes from autocast (model.mixed_precision). bfloat16 / float16: "
        "pure half-precision weights, only when asked for (one warning line: small updates round away).",
    )
    device: str = choice("auto", ("auto", "cpu", "cuda"), help="auto: CUDA when available.")
    gradient_checkpointing: bool = flag(
        False, help="Recompute activations in the backward pass: less memory, ~30% more compute."
    )
    init_seed: int = non_negative(0, help="Seed for the weights of randomly initialised models (model=tiny_random).")
    mixed_precision: str = choice(
        "auto",
        MIXED_PRECISIONS,
        help="bf16: autocast forward passes to bf16 while weights and optimizer state stay in model.dtype. auto: "
        "bf16 where it is fast (CUDA with bf16; CPUs with AVX-512 BF16 or AMX), else no (AVX2-only CPUs emulate "
        "bf16 matmuls hundreds of times slower than fp32).",
    )
    quantization: str = choice(
        "none",
        ("none", "4bit"),
        help="4bit: load the base weights in 4-bit NF4 (QLoRA, bitsandbytes, CUDA only; needs LoRA).",
    )
    lora: LoraSettings = field(default_factory=LoraSettings)


@dataclass
class LossConfig:
    """loss.*: the policy-gradient loss (loss=<choice> picks a preset)."""

    type: str = choice(
        "reinforce_with_baseline",
        # The registered losses, each with its summary, read where each loss is declared (grpo_cli.core.losses).
        from_core("losses", "LOSSES"),
        help=help_from_core("losses", "loss_types_help"),
    )
    cliprange: float = in_range(
        0.2,
        0,
        1,
        low_open=True,
        high_open=True,
        help="Clip range epsilon (eps_low with cliprange_high): grpo_clip / gspo clip ratios to [1 - eps_low, 1 + "
        "eps_high].",
    )
    cliprange_high: float | None = positive(
        None,
        hint="null: symmetric (= loss.cliprange)",
        help="eps_high, DAPO's clip-higher (0.28 in the paper); null: symmetric, = cliprange. For cispo: the cap of "
        "its importance weight, 1 + cliprange_high (null: 1 + cliprange).",
    )
    dual_clip: float | None = in_range(
        None,
        1,
        None,
        low_open=True,
        help="Dual-clip constant c > 1 (Ye et al. 2020; 3 in the paper) for grpo_clip: a negative advantage's loss "
        "is bounded by -c * A however large the ratio; null: off.",
    )


@dataclass
class NormalizationConfig:
    """normalization.*: how rewards become advantages and how a response's token losses are aggregated."""

    advantage: str = choice(
        "std",
        from_core("advantages", "ADVANTAGE_NORMALIZATIONS"),
        help="std: (r - mean) / (std + eps) (GRPO) | mean: r - mean (Dr. GRPO) | rloo: r - mean of the other "
        "responses (RLOO) | batch_std: (r - group mean) / (std of the whole batch + eps) (TRL's "
        'scale_rewards="batch")',
    )
    advantage_eps: float = non_negative(1e-6, help="Added to the standard deviation that divides (std, batch_std).")
    length: str = choice(
        "sequence_mean",
        from_core("aggregation", "LENGTH_NORMALIZATIONS"),
        help="sequence_mean: per-response masked mean | constant: masked sum / length_constant (Dr. GRPO) | "
        "token_mean: every response token of the optimizer step counts once (DAPO), over all microbatches and ranks",
    )
    length_constant: float | None = positive(
        None, help="The constant of length=constant; null means rollout.max_tokens."
    )


@dataclass
class KLConfig:
    """kl.*: the KL penalty to the frozen initial policy."""

    beta: float = non_negative(
        0.0, help="Weight of the KL penalty to the frozen initial policy; 0 disables the penalty."
    )
    estimator: str = choice(
        "k3", from_core("kl", "KL_ESTIMATORS"), help="k1: log p - log p_ref | k3: Schulman's non-negative estimator."
    )
    monitor: bool = flag(
        False, help="Measure KL every step even when beta == 0 (costs one reference forward per step)."
    )
    beta_schedule: str = choice(
        "constant",
        from_core("kl", "KL_BETA_SCHEDULES"),
        help="How the KL coefficient moves over the run: constant: kl.beta at every step | linear / cosine: from "
        "kl.beta at the first step to kl.beta_final at the last (train.steps), along a straight line / a half "
        "cosine. Each step's coefficient is logged as train/kl_beta.",
    )
    beta_final: float | None = non_negative(
        None,
        hint="null: no schedule (kl.beta_schedule=constant)",
        help="The coefficient at the last step of a linear / cosine kl.beta_schedule.",
    )


@dataclass
class TrainConfig:
    """train.*: the step's sizes (global, across all ranks), evaluation, checkpoints and the step's options."""

    steps: int = positive(
        30, help="Number of GRPO steps (rollout batches). CPU-sized: 30 steps take ~12 minutes on 2 cores."
    )
    rollout_batch_size: int = positive(16, help="Completions per rollout batch (= prompts per batch * group_size).")
    group_size: int = positive(4, help="Completions sampled per prompt (G).")
    train_batch_size: int = positive(16, help="Completions per optimizer step.")
    gradient_accumulation_steps: int = positive(
        2,
        help="Microbatches per optimizer step (train_batch_size / this = microbatch size); with "
        "train.microbatch_tokens the microbatches are cut by tokens instead.",
    )
    microbatch_tokens: int | None = positive(
        None,
        hint="null: train_batch_size / gradient_accumulation_steps completions per microbatch",
        help="Token-budget microbatches: each optimizer step's completions (and the old/reference log-prob passes') "
        "cut into microbatches of at most this many positions processed (rows x the longest row, padding included; "
        "a completion longer than this is a microbatch of its own), runs of alike lengths, instead of "
        "gradient_accumulation_steps runs of equal row counts; with the shared-prompt forward, a prompt's "
        "completions are kept together where that processes fewer positions (logged once). Under distributed=ddp|"
        "fsdp the step's completions are also exchanged after generation and spread over the ranks by tokens. The "
        "gradients are the same (exact step totals); perf/padding_frac shows the padding left. null: the fixed "
        "row count.",
    )
    max_grad_norm: float = positive(1.0, help="Clip the gradients' global norm to this before each optimizer step.")
    share_prompt_forward: bool = flag(
        True,
        help="Run each distinct prompt of a microbatch through the model once for its G completions (same numbers, "
        "~G x fewer prompt FLOPs). With sdpa or eager attention and full attention in every layer (a probe at start "
        "checks the model), as one packed row of the prompt and all its completions, each seeing its prompt and "
        "itself (no padding: docs/performance.md#the-prompt-tree); otherwise the prompt's keys/values are shared "
        "and the completions padded to the longest. Off for models with layers other than attention (linear "
        "attention, convolutions, SSMs; one log line), and with gradient checkpointing where the model's probe "
        "fails (the padded way needs a KV cache).",
    )
    pack_sequences: bool = flag(
        False,
        help="Concatenate a microbatch's sequences (prompt + completion, unpadded) into a few rows, position ids "
        "restarting per sequence and attention within each, so the forward computes no padding (same log-probs; "
        "one row on flash-attention's variable-length path). A probe at start checks the model scores packed rows "
        "like separate sequences; one that does not (recurrent or chunked layers, ...) stays padded, said in one "
        "log line. With share_prompt_forward on too, the prompt tree packs and shares at once where the model takes "
        "it; elsewhere each microbatch takes whichever of packing and sharing computes fewer positions "
        "(docs/performance.md#packed-rows).",
    )
    logits_chunk_tokens: int = non_negative(
        1024,
        hint="0: unchunked, all response tokens' logits at once",
        help="Response tokens whose logits exist at once: the LM head and the log-softmax run chunk by chunk, "
        "recomputed in backward, so no (tokens x vocabulary) tensor of a whole microbatch is held (same numbers; "
        "docs/memory.md has the measured memory and time). 0: the whole microbatch at once, the old path, kept for "
        "comparison. Equal to grpo_cli.core.LOGITS_CHUNK_TOKENS (tested): the config stays importable without "
        "torch.",
    )
    eval_every: int = non_negative(
        10,
        hint="0: evaluate only at the start and the end",
        help="Evaluate every N steps (also at step 0 and at the end); 0 means only at the start and the end.",
    )
    eval_examples: int | None = positive(
        None, hint="null: all of task.n_eval", help="Held-out examples per evaluation (null: all of task.n_eval)."
    )
    checkpoint_every: int = non_negative(
        10,
        hint="0: only at the end",
        help="Save a checkpoint every N steps and at the end (0: only at the end).",
    )
    keep_checkpoints: int = positive(
        2, help="Checkpoints kept: the newest K (K >= 2 leaves a fallback if the newest is damaged)."
    )
    max_nonfinite_steps: int = positive(
        3, help="Skip an update whose loss or gradients are not finite; stop the run after this many in a row."
    )
    skip_zero_weight_rows: bool = flag(
        True,
        help="Neither forward nor back-propagate a completion whose loss weight is exactly 0 (its advantage; its raw "
        "reward under loss=no_baseline): a flat group's rows, whose gradient is exactly 0 without a KL term. They "
        "still count in every divisor, so the update is the same (to fp32 rounding); off with kl.beta > 0. Logged as "
        "perf/zero_weight_skipped_frac (docs/algorithm.md#rows-whose-loss-weight-is-zero).",
    )
    max_empty_steps: int = positive(
        5,
        help="Stop the run after this many steps in a row with nothing to train: no token in the loss (every episode "
        "skipped under task.on_reward_error=skip, or left out of the loss), so no optimizer step (train/empty_steps). "
        "A step whose every row has loss weight 0 (flat groups: train/flat_steps) takes no optimizer step either but "
        "does not count.",
    )
    mask_truncated: bool = flag(
        False,
        help="Leave completions cut at rollout.max_tokens out of the loss (DAPO's overlong filtering, TRL's "
        "mask_truncated_completions); they still count in their group's advantages. Logged as train/masked_frac.",
    )
    dynamic_sampling: bool = flag(
        False,
        help="DAPO's dynamic sampling: drop groups whose rewards are all equal (advantage 0: no signal) and sample "
        "more prompts until the step's batch is full of groups with signal, at most "
        "dynamic_sampling_max_extra_rounds extra generation rounds (then it trains on the groups it has; "
        "train/groups_dropped, train/extra_rounds).",
    )
    dynamic_sampling_max_extra_rounds: int = non_negative(
        3, help="train.dynamic_sampling: extra generation rounds per step at most, then it trains on the groups it has."
    )


@dataclass
class OptimConfig:
    """optim.*: the AdamW optimizer."""

    # 2e-5 suits the CPU-sized batch of 16 completions; the handouts use 1e-5 at 256.
    lr: float = positive(2e-5, help="AdamW's learning rate (constant).")
    weight_decay: float = non_negative(0.0, help="AdamW's decoupled weight decay.")
    betas: list[float] = in_range(
        low=0, high=1, high_open=True, factory=lambda: [0.9, 0.95], help="Adam's two betas, each in [0, 1)."
    )


@dataclass
class LoggerConfig:
    """logger.*: where metrics go beside metrics.jsonl (docs/tracking.md)."""

    backend: str = choice(
        "none",
        ("none", "wandb", "tensorboard"),
        help="none: metrics.jsonl only | wandb: metrics.jsonl and Weights & Biases | tensorboard: metrics.jsonl and "
        "TensorBoard event files in <run dir>/tensorboard (the `tensorboard` extra).",
    )
    project: str = any_value("grpo-cli", help="W&B project.")
    entity: str | None = any_value(None, help="W&B entity (user or team); null: your default.")
    group: str | None = any_value(
        None, help="W&B group; null: none, and in a multirun the sweep's name, so the runs of one sweep sit together."
    )
    tags: list[str] = any_value(factory=list, help="W&B tags of the run.")
    name: str | None = any_value(
        None, help="W&B run name; null: the run directory's name (e.g. 3_optim.lr@1e-05+seed@1 in a multirun)."
    )
    mode: str = choice(
        "online",
        ("online", "offline", "disabled"),
        help="W&B's mode; logger=wandb sets it to $WANDB_MODE when that is set, else online. online: to the server "
        "| offline: written locally (upload later with `wandb sync`) | disabled: no W&B. online without an API "
        "key, or without a server answering within logger.init_timeout_s, logs offline instead.",
    )
    init_timeout_s: float = positive(
        15.0, help="logger.mode=online: how long W&B's init may take to reach the server before the run logs offline."
    )
    samples_every: int = non_negative(
        1,
        hint="0: no sample tables",
        help="Log a W&B table (TensorBoard: a text entry) of eval completions at evaluations whose step is a "
        "multiple of this (0: none), with at most samples_rows rows each.",
    )
    samples_rows: int = positive(32, help="Rows (eval completions) per samples table at most.")


@dataclass
class JobConfig:
    """job.*: what grpo-run does (job=<choice> picks one) and that job's own keys."""

    name: str = choice(
        "train",
        ("train", "baseline_eval", "eval", "export", "report", "check_reward", "benchmark"),
        help="The job: train | baseline_eval: held-out reward of the untrained model | eval: held-out reward of "
        "a trained run, checkpoint or exported model (eval.model) | export: a run's checkpoint as a Hugging Face "
        "model folder (export.run) | report: compare run directories | "
        "check_reward: the task's reward on cases | benchmark: time rollout engines.",
    )
    n_examples: int | None = positive(
        None,
        hint="null: all of task.n_eval",
        help="baseline_eval, eval: how many held-out examples to evaluate (null: train.eval_examples, else all of "
        "task.n_eval).",
    )
    engines: list[str] = choice(
        MISSING,
        lambda: ("auto", *ROLLOUT_SCHEMAS),
        factory=lambda: ["auto"],
        help="benchmark: rollout engines to compare (auto: hf, plus vllm when installed).",
    )
    warmup_steps: int = non_negative(
        0, help="benchmark: unmeasured warm-up steps per engine, before the measured ones."
    )
    steps: int = positive(6, help="benchmark: measured steps per engine.")
    precisions: list[str] = choice(
        MISSING,
        MIXED_PRECISIONS,
        factory=lambda: ["auto"],
        help="benchmark: the compute precisions measured, each engine at each (model.mixed_precision values: bf16 "
        "autocast, no: model.dtype's). auto: bf16 and no where bf16 is fast here (CUDA with bf16, a CPU with "
        "AVX-512 BF16 or AMX), no alone elsewhere (said in one line). Scaling runs use model.mixed_precision.",
    )
    scaling: bool = flag(
        False,
        help="benchmark: also measure how a step's cost grows with the rollout batch (at rollout.max_tokens) and "
        "with the completion length (at train.rollout_batch_size; every completion forced to max_tokens), "
        "scaling_steps each.",
    )
    scaling_batches: list[int] = positive(
        factory=lambda: [8, 16, 32, 64], help="benchmark with job.scaling: the rollout batch sizes measured."
    )
    scaling_max_tokens: list[int] = positive(
        factory=lambda: [32, 64, 128, 256], help="benchmark with job.scaling: the completion lengths measured."
    )
    scaling_steps: int = positive(2, help="benchmark with job.scaling: steps measured per batch size and per length.")
    length_profile: str = choice(
        "none",
        ("none", "long_tail"),
        help="benchmark: long_tail: instead of the engines, time the learner's microbatch layouts (today's fixed "
        "rows, train.microbatch_tokens' token budget, and the same tokens at equal lengths) on one forced batch "
        "whose completion lengths follow p(L) ~ 1/L on 16..512 tokens, job.steps updates each; on "
        "distributed.nproc_per_node gloo ranks under distributed=ddp|fsdp (docs/performance.md).",
    )
    objective: str = choice(
        "final_eval_reward",
        ("final_eval_reward", "best_eval_reward"),
        help="What the run returns to a Hydra sweeper (hydra/sweeper=optuna maximizes it): the eval reward of the "
        "last evaluation, or the highest of all evaluations (train; baseline_eval: its one eval reward).",
    )


@dataclass
class EvalConfig:
    """eval.*: how each held-out prompt is answered and scored (docs/evaluation.md)."""

    n_samples: int = positive(
        1,
        hint="1: one answer per held-out prompt",
        help="Completions per held-out prompt, in training evaluations and job=baseline_eval. 1: one answer each "
        "at rollout.eval_temperature (greedy by default), "
        "scored as eval/reward. n > 1: n samples at rollout.eval_temperature (> 0), also scored as eval/mean@n, "
        "eval/pass@k and eval/maj@n.",
    )
    pass_k: list[int] | None = positive(None, help="The k of eval/pass@k, each in 1..n_samples; null: 1 and n_samples.")
    model: str | None = path(
        None,
        "dir",
        help="job=eval: the model to evaluate: a run directory (its newest complete checkpoint, or eval.step's), one "
        "checkpoint (<run>/checkpoints/step_N), or a Hugging Face folder (an exported model/). A run's or "
        "checkpoint's model.*, task.*, rollout.* and eval.* are the run's own; command-line keys override them.",
    )
    step: int | None = non_negative(
        None,
        hint="null: the newest complete checkpoint",
        help="job=eval: the checkpoint step of the run eval.model names.",
    )


@dataclass
class ReportConfig:
    """report.*: job=report's runs and output (docs/tracking.md#reports-jobreport)."""

    runs: Any = path(
        None,
        "dir",
        factory=list,
        help="job=report: run directories to compare, or one multirun directory (every run below it). A single path "
        "may be given without brackets: report.runs=outputs/multirun/2026-11-22_07-00-00",
    )
    out: str | None = path(
        None,
        "output",
        help="Where report.md and the plots go; null: the report job's own run directory (outputs/report/<time>).",
    )


# export.dtype: the exported weights' dtype; auto: the base model's own (its config's dtype / torch_dtype).
EXPORT_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class ExportConfig:
    """export.*: a run's trained model as a Hugging Face folder (docs/after-training.md): job=export, and the
    model/ folder every training run ends with."""

    run: str | None = path(
        None, "run", help="job=export: the run directory whose checkpoint is exported (required for job=export)."
    )
    step: int | None = positive(
        None, hint="null: the newest complete checkpoint", help="job=export: the checkpoint step to export."
    )
    merge_lora: bool = flag(
        False,
        help="A LoRA run: true writes the adapters merged into the base (a plain model); false writes the adapter "
        "in PEFT's format (adapter_config.json naming the base's hub id). A base without a hub id (the embedded "
        "default, model=tiny_random, a local folder) is always merged, said in one line.",
    )
    dtype: str = choice(
        "auto",
        EXPORT_DTYPES,
        help="The exported weights' dtype. auto: the base model's own (its config's dtype; float32 for the embedded "
        "default and model=tiny_random), whatever the run trained in.",
    )
    out: str | None = path(
        None,
        "output",
        help="job=export: the folder written; null: <run>/model for the newest complete checkpoint, "
        "<run>/model_step_N for an older one.",
    )
    max_shard_size: str = any_value("5GB", help='The largest weights file ("5GB", "500MB"): transformers\' shards.')
    push_to_hub: str | None = any_value(
        None, help="job=export: a Hub repo id (<user or org>/<name>) to upload the folder to, in one commit."
    )
    private: bool = flag(True, help="export.push_to_hub: create the repo private.")
    at_end: bool = flag(
        True,
        help="job=train: write <run>/model/ from the newest checkpoint when the run ends (also on a signal, "
        "reward-error or non-finite stop); false: only the checkpoints (job=export writes it later).",
    )


# distributed.strategy: how the learner spreads over devices (torch.distributed).
DISTRIBUTED_STRATEGIES = ("none", "ddp", "fsdp")


@dataclass
class DistributedConfig:
    """distributed.*: data-parallel GRPO over several processes (docs/distributed.md). train.* sizes stay global
    (the whole step across all ranks); each rank takes an equal share of the step's prompts."""

    strategy: str = choice(
        "none",
        DISTRIBUTED_STRATEGIES,
        help="none: one process | ddp: DistributedDataParallel | fsdp: FSDP2 fully_shard (per decoder layer, then "
        "the root), parameters, gradients and optimizer state sharded across ranks.",
    )
    nproc_per_node: int = positive(
        1,
        help="Ranks (processes) per node that `grpo-run` starts (one per GPU on CUDA); ignored under an external "
        "torchrun or srun, which set RANK/WORLD_SIZE themselves.",
    )
    nnodes: int = positive(1, help="Nodes (machines) of the run.")
    node_rank: int = non_negative(0, help="This node's index, 0 .. nnodes - 1; node 0 hosts the rendezvous.")
    master_addr: str = any_value("127.0.0.1", help="Address of node 0's rendezvous (loopback on one machine).")
    master_port: int = in_range(29511, 1, 65535, help="Port of node 0's rendezvous.")
    rdzv_id: str | None = any_value(
        None,
        help="The c10d rendezvous id the nodes of one run share (torchrun's --rdzv-id). null: derived from what "
        "every node is given, master_addr:master_port and the run directory (the same shared hydra.run.dir on every "
        "node).",
    )
    rdzv_timeout_s: int = positive(
        600,
        help="How long a node waits at the rendezvous for all distributed.nnodes nodes (elastic's join_timeout; a "
        "node also waits this long to reach node 0's rendezvous store) before stopping with one line.",
    )
    backend: str = choice("auto", ("auto", "nccl", "gloo"), help="auto: nccl on CUDA, gloo on CPU.")
    timeout_min: float = positive(
        60.0, help="How long a rank waits for the others at a collective (e.g. while rank 0 evaluates) before failing."
    )


@dataclass
class GRPOConfig:
    """The run's own keys; every other key belongs to a group (model.*, task.*, ...)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    # One of TASK_SCHEMAS, picked by task=<name> (conf/task/<name>.yaml extends <name>_schema). Typed Any, not
    # TaskConfig: OmegaConf would build a TaskConfig node first and keep its fields' types through the merge, and
    # task=custom's reward_weights is a mapping of the user's reward names, not RewardWeightsConfig.
    task: Any = MISSING
    loss: LossConfig = field(default_factory=LossConfig)
    normalization: NormalizationConfig = field(default_factory=NormalizationConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    # One of ROLLOUT_SCHEMAS, picked by rollout=<engine>.
    rollout: SamplingConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    job: JobConfig = field(default_factory=JobConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    seed: int = non_negative(
        0,
        help="Seed of the run: torch's RNGs, prompt order and sampling (model weights: model.init_seed; data: "
        "task.data_seed).",
    )
    resume: Any = path(
        None,
        "run",
        help="null: a new run | true: continue the newest run under the same output root | a run directory.",
    )
    init_from: str | None = path(
        None,
        "dir",
        help="A new run (step 0, fresh optimizer) that starts from the trained weights of another run's newest "
        "complete checkpoint (a run directory) or of one checkpoint (<run>/checkpoints/step_N): how to branch a run "
        "with settings a resume may not change. null: the weights model.* names.",
    )
    output_dir: str = path(MISSING, "output", help="Run directory; Hydra's ${hydra:runtime.output_dir} by default.")
    verbose: bool = flag(True, help="Print a per-step metrics line on the console.")


# Groups with one schema per choice: group -> {choice: schema}.
GROUP_SCHEMAS: dict[str, dict[str, type]] = {"task": TASK_SCHEMAS, "rollout": ROLLOUT_SCHEMAS}
