"""Cross-field validation: every rule names the fields involved and what to write instead. validate_config, which
the CLI calls before any model loads, checks every field against its declaration first (declared.check_fields)."""

from __future__ import annotations

from typing import cast

from omegaconf import DictConfig, OmegaConf

from grpo_cli.config.batch_shape import BatchShape, loss_declarations, ratio_loss_types
from grpo_cli.config.declared import check_fields
from grpo_cli.config.fields import core_value
from grpo_cli.config.rollout_schemas import ROLLOUT_SCHEMAS, VLLMRolloutConfig
from grpo_cli.config.schemas import DISAGGREGATED, GRPOConfig, SyncConfig, TrainConfig
from grpo_cli.config.task_registry import check_task
from grpo_cli.errors import UserFacingError


def loss_options() -> dict[str, str]:
    """The optional loss.* options, name -> what each does (the LossSettings fields declared with loss_option,
    read when first needed); which loss reads which is each loss's declaration."""
    return core_value("loss_settings", "loss_options")()()


def _one_of(names: list[str] | tuple[str, ...]) -> str:
    """'a', 'a or b', 'a, b or c'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def use_ratio_loss() -> str:
    """What to write instead of a loss without an importance ratio: 'use loss=grpo_clip (...), gspo or cispo'."""
    ratio = ratio_loss_types()
    first = f"loss={ratio[0]} ({loss_declarations()[ratio[0]].summary})"
    return f"use {_one_of([first, *ratio[1:]])}"


def validate_sync(cfg: GRPOConfig) -> None:
    """The sync strategy's rules: how many optimizer steps per batch, which losses stay correct off-policy,
    and the replay buffer's bounds."""
    t, sync = cfg.train, cfg.sync
    if sync.strategy in DISAGGREGATED and getattr(cfg.rollout, "openai_server", None) == "vllm":
        raise UserFacingError(
            f"rollout.openai_server=vllm with sync={sync.strategy}: vLLM's own server is not started inside the "
            "generator's Ray actor yet: use rollout.openai_server=grpo_cli, or sync=on_policy / multi_epoch"
        )
    shape = BatchShape.from_config(cfg)
    steps = shape.optimizer_steps_per_rollout_batch
    if sync.strategy == "on_policy" and steps != 1:
        raise UserFacingError(
            f"sync=on_policy takes one optimizer step per rollout batch, but sync.epochs_per_rollout_batch="
            f"{shape.epochs_per_rollout_batch} and train.rollout_batch_size/train.train_batch_size="
            f"{t.rollout_batch_size // t.train_batch_size} give more: use sync=multi_epoch, or set "
            "train.train_batch_size=train.rollout_batch_size and one epoch"
        )
    ratio_losses = ratio_loss_types()
    if steps > 1 and cfg.loss.type not in ratio_losses:
        raise UserFacingError(
            f"{steps} optimizer steps per rollout batch make later steps off-policy, which "
            f"loss={cfg.loss.type} ignores: {use_ratio_loss()}"
        )
    if sync.strategy == "replay_buffer" and cfg.loss.type not in ratio_losses:
        raise UserFacingError(
            f"sync=replay_buffer trains on trajectories up to sync.max_staleness={sync.max_staleness} policy "
            f"versions old, which loss={cfg.loss.type} ignores: {use_ratio_loss()}"
        )
    if cfg.loss.type in ratio_losses and shape.off_policy and sync.old_log_probs is False:
        raise UserFacingError(
            f"loss={cfg.loss.type} with sync={sync.strategy} needs the old policy's log-probs for its ratios, but "
            "sync.old_log_probs=false: drop that override (null computes them when needed)"
        )
    if sync.strategy == "async":
        validate_async(cfg)
    else:
        defaults = SyncConfig()
        for key in ASYNC_ONLY_KEYS:
            value = getattr(sync, key)
            if value != getattr(defaults, key):
                shown = str(value).lower() if isinstance(value, bool) else value  # as it was typed
                raise UserFacingError(
                    f"sync.{key}={shown} acts only under sync=async, but sync={sync.strategy}: use sync=async, or "
                    f"drop sync.{key}"
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


# The sync=async keys that act only under sync=async (each set elsewhere is refused, as a silently ignored key would
# mislead a comparison), with their schema defaults.
ASYNC_ONLY_KEYS = (
    "on_stale",
    "partial_rollouts",
    "kv_after_update",
    "proximal",
    "generators",
    "decode_rows",
    "lockstep",
    "behaviour_weight_cap",
)


def validate_async(cfg: GRPOConfig) -> None:
    """sync=async: a ratio loss, a bound of at least 1, and the partial rollouts' engines."""
    sync, rollout = cfg.sync, cfg.rollout
    if cfg.loss.type not in ratio_loss_types():
        raise UserFacingError(
            f"sync=async trains on samples up to sync.max_staleness={sync.max_staleness} policy versions old and "
            f"clips each token's ratio against the proximal policy, which loss={cfg.loss.type} has none of: "
            f"{use_ratio_loss()}"
        )
    if sync.max_staleness < 1:
        raise UserFacingError(
            f"sync.max_staleness={sync.max_staleness}: sync=async needs at least 1 (the generator samples while "
            "the learner updates); use sync=on_policy for on-policy training"
        )
    if sync.decode_rows is not None and sync.decode_rows < cfg.train.group_size:
        raise UserFacingError(
            f"sync.decode_rows={sync.decode_rows} is smaller than a group (train.group_size={cfg.train.group_size}), "
            f"which starts whole: use sync.decode_rows>={cfg.train.group_size}"
        )
    if cfg.train.dynamic_sampling:
        raise UserFacingError(
            "train.dynamic_sampling with sync=async: the generator does not sample extra rounds for a step yet; "
            "use sync=one_behind or sync=on_policy with it, or drop train.dynamic_sampling"
        )
    if sync.lockstep and (sync.partial_rollouts or sync.on_stale == "drop" or sync.generators > 1):
        raise UserFacingError(
            "sync.lockstep=true samples each batch whole by one fixed version on one generator: it does not combine "
            "with sync.partial_rollouts=true, sync.on_stale=drop or sync.generators>1"
        )
    if sync.partial_rollouts and rollout.engine == "hf" and getattr(rollout, "decoder", "auto") == "generate":
        raise UserFacingError(
            "sync.partial_rollouts=true applies weight updates between decode steps, which transformers' generate() "
            "(rollout.decoder=generate) has none of: use rollout.decoder=auto (the decode loop)"
        )
    weighted = sync.proximal == "recompute" and rollout.importance_correction == "none"
    if sync.behaviour_weight_cap != SyncConfig().behaviour_weight_cap and not weighted:
        cap = "null" if sync.behaviour_weight_cap is None else sync.behaviour_weight_cap  # as the user writes it
        raise UserFacingError(
            f"sync.behaviour_weight_cap={cap} caps decoupled PPO's pi_prox / pi_behav, which "
            f"sync.proximal={sync.proximal} with rollout.importance_correction={rollout.importance_correction} does "
            "not weigh by (behaviour: the weight is 1; a correction: its own threshold caps it): drop "
            "sync.behaviour_weight_cap"
        )
    if weighted and sync.behaviour_weight_cap is None and rollout.importance_level == "sequence":
        raise UserFacingError(
            "sync.behaviour_weight_cap=null with rollout.importance_level=sequence: the uncapped product of a "
            "response's pi_prox / pi_behav overflows for long responses: set sync.behaviour_weight_cap (e.g. 5.0) "
            "or use rollout.importance_level=token"
        )
    per_token = sync.partial_rollouts or sync.proximal == "recompute"
    if per_token and rollout.engine == "vllm" and rollout.top_p < 1.0:
        raise UserFacingError(
            f"sync=async with rollout=vllm and rollout.top_p={rollout.top_p}: vLLM's log-probs are then "
            "renormalized over the nucleus, not the policy's, and the tokens' behaviour log-probs (decoupled PPO's "
            "pi_prox / pi_behav, partial rollouts) would be wrong: use rollout.top_p=1.0, or "
            "sync.proximal=behaviour with sync.partial_rollouts=false"
        )


def validate_algorithm(cfg: GRPOConfig) -> None:
    """The loss variants' own knobs, set only where they act (a silently ignored key would mislead a comparison)."""
    loss, rollout = cfg.loss, cfg.rollout
    declarations = loss_declarations()
    for option, does in loss_options().items():
        value = getattr(loss, option)
        if value is not None and not declarations[loss.type].uses(option):
            readers = [name for name, spec in declarations.items() if spec.uses(option)]
            raise UserFacingError(
                f"loss.{option}={value} {does}, but loss={loss.type}: use loss={_one_of(readers)}, or drop "
                f"loss.{option}"
            )
    low = rollout.importance_threshold_low
    if low is not None and low > rollout.importance_threshold:
        raise UserFacingError(
            f"rollout.importance_threshold_low={low} is above rollout.importance_threshold="
            f"{rollout.importance_threshold}: the band [low, C] is empty"
        )
    kl = cfg.kl
    if kl.beta_schedule == "constant" and kl.beta_final is not None:
        raise UserFacingError(
            f"kl.beta_final={kl.beta_final} is where a KL schedule ends, but kl.beta_schedule=constant: use "
            "kl.beta_schedule=linear or cosine, or drop kl.beta_final"
        )
    if kl.beta_schedule != "constant" and kl.beta_final is None:
        raise UserFacingError(
            f"kl.beta_schedule={kl.beta_schedule} moves the KL coefficient from kl.beta to kl.beta_final over "
            "train.steps: set kl.beta_final (e.g. kl.beta_final=0)"
        )


def validate_distributed(cfg: GRPOConfig) -> None:
    """distributed.*: sizes that split into equal rank shares, and the combinations that work with several ranks."""
    d = cfg.distributed
    if d.strategy == "none":
        if d.nproc_per_node != 1 or d.nnodes != 1:
            raise UserFacingError(
                f"distributed.nproc_per_node={d.nproc_per_node} and distributed.nnodes={d.nnodes} need "
                "distributed=ddp or distributed=fsdp (one process otherwise)"
            )
        return
    if d.node_rank >= d.nnodes:
        raise UserFacingError(f"distributed.node_rank={d.node_rank} must be in [0, distributed.nnodes={d.nnodes})")
    shape = BatchShape.from_config(cfg)
    if shape.ranks == 1:
        return
    if cfg.sync.strategy in DISAGGREGATED:
        raise UserFacingError(
            f"sync={cfg.sync.strategy} runs its generator and learner as Ray actors and does not combine with "
            f"distributed={d.strategy} over {shape.ranks} ranks yet: use sync=on_policy or sync=multi_epoch"
        )
    # rollout.engine=vllm: validate_config checked that the rollout is then the vLLM schema.
    if isinstance(cfg.rollout, VLLMRolloutConfig) and cfg.rollout.openai_server == "vllm":
        raise UserFacingError(
            f"rollout.openai_server=vllm with distributed={d.strategy} over {shape.ranks} ranks: vLLM's own server "
            "runs its engine in a process of its own, which does not join the ranks' group: use "
            "rollout.openai_server=grpo_cli (an endpoint per rank)"
        )
    if isinstance(cfg.rollout, VLLMRolloutConfig) and cfg.rollout.tensor_parallel_size != 1:
        raise UserFacingError(
            f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size} with distributed={d.strategy}: each "
            "rank runs its own vLLM engine on its own device and samples its own prompts, so tensor parallelism "
            "across ranks does not apply: use rollout.tensor_parallel_size=1"
        )
    if not _splits_among_ranks(cfg.train, shape.ranks):
        changes = rank_split_sizes(cfg.train, shape.ranks)
        t = cfg.train
        raise UserFacingError(
            f"distributed={d.strategy} over {shape.ranks} ranks needs a batch that splits into {shape.ranks} equal "
            f"shares (whole groups of train.group_size={t.group_size}, whole microbatches), and "
            f"train.rollout_batch_size={t.rollout_batch_size} (= {shape.prompts_per_rollout_batch} groups), "
            f"train.train_batch_size={t.train_batch_size}, train.gradient_accumulation_steps="
            f"{t.gradient_accumulation_steps} do not: run with "
            + " ".join(f"train.{key}={value}" for key, value in changes.items())
            + " (the smallest sizes at or above these that do, with the same optimizer steps per rollout batch)"
        )


def _splits_among_ranks(t: TrainConfig, ranks: int) -> bool:
    """Whether each rank gets whole groups of the rollout batch and a whole number of each optimizer step's
    microbatches (the sizes are totals over the ranks)."""
    prompts = t.rollout_batch_size // t.group_size
    return prompts % ranks == 0 and t.gradient_accumulation_steps % ranks == 0


def rank_split_sizes(t: TrainConfig, ranks: int) -> dict[str, int]:
    """The train.* sizes to write so that `ranks` ranks split the batch equally, all in one answer (a user who got
    one refusal per size had to run three times): the fewest prompts per rollout batch at or above today's that is
    a multiple of `ranks`, the same number of optimizer steps per rollout batch (so sync=on_policy's equal batches
    stay equal), and the most microbatches' worth of memory today's microbatch allows. Only the keys that change."""
    group = t.group_size
    prompts = t.rollout_batch_size // group
    steps = max(1, t.rollout_batch_size // t.train_batch_size)
    microbatch = max(1, t.train_batch_size // t.gradient_accumulation_steps)
    candidate = -(-prompts // ranks) * ranks
    # A train batch is rollout/steps completions and must itself split among the ranks.
    while (candidate * group) % (steps * ranks):
        candidate += ranks
    rollout = candidate * group
    train = rollout // steps
    # Microbatches per optimizer step: a multiple of the ranks that divides the train batch, the fewest whose
    # microbatch is no larger than today's (the memory a microbatch needs), else the smallest microbatch.
    accumulations = [g for g in range(ranks, train + 1, ranks) if train % g == 0]
    accumulation = next((g for g in accumulations if train // g <= microbatch), accumulations[-1])
    sizes = {"rollout_batch_size": rollout, "train_batch_size": train, "gradient_accumulation_steps": accumulation}
    return {key: value for key, value in sizes.items() if getattr(t, key) != value}


def validate_config(config: GRPOConfig | DictConfig) -> None:
    """Check every field against its declared constraint, then the rules between fields. Raises
    UserFacingError with a one-line message naming the key. A DictConfig is converted to the schema dataclass
    first (OmegaConf.to_object builds a GRPOConfig from a config composed under grpo_config_schema)."""
    cfg = cast(GRPOConfig, OmegaConf.to_object(config)) if isinstance(config, DictConfig) else config
    check_fields(cfg)
    engine_schema = ROLLOUT_SCHEMAS[cfg.rollout.engine]
    if not isinstance(cfg.rollout, engine_schema):
        chosen = next((name for name, s in ROLLOUT_SCHEMAS.items() if type(cfg.rollout) is s), "?")
        raise UserFacingError(
            f"rollout.engine={cfg.rollout.engine} with rollout={chosen}: pick the engine and its keys together "
            f"with rollout={cfg.rollout.engine}"
        )

    if cfg.model.quantization == "4bit" and not cfg.model.lora.enabled:
        raise UserFacingError(
            "model.quantization=4bit freezes the quantized base weights, so only adapters can train: "
            "set model.lora.enabled=true"
        )
    if cfg.model.lora.enabled and not cfg.model.lora.target_modules:
        raise UserFacingError("model.lora.target_modules=[] with model.lora.enabled=true: name the modules to adapt")
    t = cfg.train
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
    if t.group_size < 2 and (cfg.normalization.advantage == "rloo" or t.dynamic_sampling):
        what = "train.dynamic_sampling=true" if t.dynamic_sampling else "normalization.advantage=rloo"
        raise UserFacingError(
            f"train.group_size={t.group_size} with {what}: it compares each response with the other responses to "
            "its prompt; use train.group_size>=2"
        )
    validate_algorithm(cfg)
    if cfg.rollout.min_tokens > cfg.rollout.max_tokens:
        raise UserFacingError(
            f"rollout.min_tokens={cfg.rollout.min_tokens} exceeds rollout.max_tokens={cfg.rollout.max_tokens}"
        )

    validate_sync(cfg)
    validate_distributed(cfg)
    if len(cfg.optim.betas) != 2:
        raise UserFacingError(f"optim.betas={list(cfg.optim.betas)} must be two numbers (Adam's beta1 and beta2)")
    n_samples = cfg.eval.n_samples
    if n_samples > 1 and cfg.rollout.eval_temperature <= 0:
        raise UserFacingError(
            f"eval.n_samples={n_samples} samples at rollout.eval_temperature={cfg.rollout.eval_temperature:g}, "
            "where every sample is the same greedy answer: set rollout.eval_temperature>0 (e.g. 1.0 or 0.6)"
        )
    pass_k = cfg.eval.pass_k or []
    if any(k > n_samples for k in pass_k):
        raise UserFacingError(f"eval.pass_k={list(pass_k)}: each k must be in 1..eval.n_samples={n_samples}")
    buffer = cfg.task.overlong_buffer
    if buffer is not None and buffer > cfg.rollout.max_tokens:
        raise UserFacingError(
            f"task.overlong_buffer={buffer} must be between 1 and rollout.max_tokens={cfg.rollout.max_tokens} "
            "(the overlong penalty ramps over that many tokens before the limit)"
        )
    check_task(cfg.task)  # the check the tasks package registered: the task's reward components, tools, ...
