"""Structured-config schemas for every config group, registered in Hydra's ConfigStore.

Each dataclass is the schema of one group (conf/<group>/*.yaml fill it in). Because the primary config
extends `grpo_config_schema`, a typo'd key (`optim.lrr=1`) or a wrong type (`train.steps=ten`) fails when
Hydra composes the config, before anything is loaded. Two groups have one schema per choice: `task` (each task
has its own keys, `TASK_SCHEMAS`) and `rollout` (the sampling keys every engine shares, plus the vLLM keys
for rollout=vllm, `ROLLOUT_SCHEMAS`), so `task=keyword task.min_words=3` fails as a typo would.

What each key accepts is declared once with its field: `choice(default, allowed)` for a fixed set of values
(`grpo-run --help` and `allowed_values(key)` read it too), `positive`, `non_negative`, `unit_interval`,
`in_range`, `finite`, `path(default, kind)`, or `any_value`. `validate_config`, which the CLI calls before any
model loads, checks every field against its declaration, then the cross-field rules a declaration cannot express.

Every option is documented where it is defined (as in TRL's GRPOConfig).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from grpo_cli.errors import UserFacingError

Choices = tuple[str, ...] | Callable[[], tuple[str, ...]]

# ----------------------------------------------------------------------------------------------------------
# Constraints: what each field accepts, declared once with the field (`steps: int = positive(30)`). The generic
# check (`_check_fields`, called by validate_config) enforces them for every key, `grpo-run --help` lists them,
# and tests/test_bad_input.py feeds every field the values its declaration rules out. A bool field and a nested
# schema need none (the type says it all); every other field declares one, or says `any_value(...)`.

CONSTRAINT = "constraint"
# path(kind=...): file: an existing file | dir: an existing directory | output: a directory that is or can be
# made (not a file) | model: a local model directory or .gguf file when the value is a path (a hub id or a
# built-in name is checked by models.check_model_source) | run: a run directory to resume (or true).
PATH_KINDS = ("file", "dir", "output", "model", "run")


@dataclass(frozen=True)
class Constraint:
    """The values a config field accepts. For a list field it applies to each item; None (where the type allows
    it) always passes."""

    # range: a finite number in [low, high] (an end is open where *_open; None: unbounded) | choice: one of
    # `choices` | path: a path of `path_kind` | any: any value of the field's type (checked where it is used,
    # by a cross-field rule, or not at all).
    kind: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: Choices | None = None
    path_kind: str | None = None
    # Said after the rule in the error message: what the edge value means, or what to write instead.
    hint: str = ""

    def describe(self, integer: bool = False) -> str:
        """'positive', '>= 1' (a positive integer), '>= 0', 'in (0, 1]', 'one of a, b', 'an existing file'."""
        if self.kind == "choice":
            return f"one of {', '.join(_resolve(self.choices or ()))}"
        if self.kind == "path":
            return {
                "file": "an existing file",
                "dir": "an existing directory",
                "output": "a directory (existing or new)",
                "model": "a model directory, a .gguf file, a hub id or a built-in model",
                "run": "a run directory with checkpoints (or true)",
            }[self.path_kind or "file"]
        if self.kind == "any":
            return "any value"
        low, high = self.low, self.high
        if integer and low is not None and self.low_open and float(low).is_integer():
            low, low_open = low + 1, False  # an integer > 0 is an integer >= 1
        else:
            low_open = self.low_open
        if high is None:
            if low is None:
                return "a finite number"
            return "positive" if low == 0 and low_open else f"{'>' if low_open else '>='} {_number(low)}"
        if low is None:
            return f"{'<' if self.high_open else '<='} {_number(high)}"
        return f"in {'(' if low_open else '['}{_number(low)}, {_number(high)}{')' if self.high_open else ']'}"

    def problem(self, value: Any) -> str | None:
        """Why `value` (one value, not a list) is not allowed ('must be positive', 'no such file or directory',
        ...), None when it is."""
        if self.kind == "choice":
            values = _resolve(self.choices or ())
            return None if value in values else f"is not one of {', '.join(values)}"
        if self.kind == "path":
            if isinstance(value, bool):  # resume=true: the newest run; resume=false: a new run
                return None if self.path_kind == "run" else "must be a path"
            return path_problem(str(value), self.path_kind or "file")
        if self.kind == "range":
            number = isinstance(value, int | float) and not isinstance(value, bool)
            rule = self.describe(integer=isinstance(value, int))
            if not number or not math.isfinite(value):
                return f"must be {rule}" if rule == "a finite number" else f"must be finite and {rule}"
            if not self._in_range(value):
                return f"must be {rule}"
        return None

    def _in_range(self, value: float) -> bool:
        low_ok = self.low is None or (value > self.low if self.low_open else value >= self.low)
        high_ok = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return low_ok and high_ok


def _number(value: float) -> str:
    return f"{value:g}"


def _declare(default: Any, constraint: Constraint, factory: Callable[[], Any] | None) -> Any:
    metadata: dict[str, Any] = {CONSTRAINT: constraint}
    if constraint.kind == "choice":
        metadata["choices"] = constraint.choices
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def choice(default: Any, allowed: Choices, *, factory: Callable[[], Any] | None = None) -> Any:
    """A plain `str` field (or a list of them, given `factory`) whose value must be one of `allowed`: what users
    type and `--cfg job` prints.

    `allowed` is a tuple, or a function returning one where the list lives elsewhere (the torch core, a registry
    defined below), so that the list is written once and importing this module stays free of torch.
    """
    return _declare(default, Constraint("choice", choices=allowed), factory)


def in_range(
    default: Any = MISSING,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    hint: str = "",
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A number (or a list of numbers) in [low, high], an end open where asked; None means no bound."""
    return _declare(default, Constraint("range", low, high, low_open, high_open, hint=hint), factory)


def positive(default: Any = MISSING, *, hint: str = "", factory: Callable[[], Any] | None = None) -> Any:
    """> 0 (for an integer field: >= 1)."""
    return in_range(default, 0, low_open=True, hint=hint, factory=factory)


def non_negative(default: Any = MISSING, *, hint: str = "") -> Any:
    """>= 0."""
    return in_range(default, 0, hint=hint)


def unit_interval(default: Any = MISSING, *, hint: str = "") -> Any:
    """In (0, 1]: a fraction that may not be 0."""
    return in_range(default, 0, 1, low_open=True, hint=hint)


def finite(default: Any = MISSING) -> Any:
    """Any finite number (no nan, no inf)."""
    return in_range(default)


def path(default: Any, kind: str, *, factory: Callable[[], Any] | None = None) -> Any:
    """A path of `kind` (PATH_KINDS), or a list of them given `factory`; checked before anything loads."""
    assert kind in PATH_KINDS, kind
    return _declare(default, Constraint("path", path_kind=kind), factory)


def any_value(default: Any = MISSING, *, factory: Callable[[], Any] | None = None) -> Any:
    """Explicitly no constraint beyond the field's type (a name, a free text, a dict passed through)."""
    return _declare(default, Constraint("any"), factory)


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def path_problem(value: str, kind: str) -> str | None:
    """What is wrong with path `value` for a field of `kind`, None when nothing is (see PATH_KINDS)."""
    target = Path(value).expanduser()
    if kind == "model":
        looks_local = value.startswith(("/", ".", "~")) or value.endswith(".gguf") or value.count("/") > 1
        if value.startswith(("embedded:", "random:")) or not (target.exists() or looks_local):
            return None  # a built-in model or a hub id: models.check_model_source checks them before loading
        if not target.exists():
            return "no such file or directory: give a model directory, a .gguf file, a hub id, or model=smollm2_135m"
        if target.is_dir() and not any(p.name.endswith(_WEIGHT_SUFFIXES) for p in target.iterdir()):
            return "a directory without model weights (*.safetensors, *.bin or *.gguf): give the one holding them"
        if target.is_file() and target.suffix != ".gguf":
            return "a file but not a .gguf file: give a model directory or a .gguf file"
        return None
    if kind == "output":
        existing = next((p for p in (target, *target.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            return f"{existing} is a file, so no directory can be made there: give a directory path"
        return None
    if kind == "run":
        if not (target / "config.yaml").is_file() or not any((target / "checkpoints").glob("step_*")):
            return (
                "no run with checkpoints there (expected config.yaml and checkpoints/step_*): give a run "
                "directory of an earlier grpo-run, or resume=true for the newest one"
            )
        return None
    if not target.exists():
        return f"no such file or directory: give an existing {'file' if kind == 'file' else 'directory'}"
    if kind == "file" and not target.is_file():
        return "a directory, not a file: give a file"
    if kind == "dir" and not target.is_dir():
        return "a file, not a directory: give a directory"
    return None


def _from_core(module: str, name: str) -> Callable[[], tuple[str, ...]]:
    """The tuple `grpo_cli.core.<module>.<name>`, imported on first use (the core imports torch)."""
    return lambda: tuple(getattr(importlib.import_module(f"grpo_cli.core.{module}"), name))


# Sync strategies; the DISAGGREGATED ones run a generator and a learner as Ray actors.
DISAGGREGATED: tuple[str, ...] = ("one_behind", "replay_buffer")
SYNC_STRATEGIES: tuple[str, ...] = ("on_policy", "multi_epoch", *DISAGGREGATED)
PROMPT_STYLES: tuple[str, ...] = ("chat", "r1_zero", "question_only")


@dataclass
class LoraSettings:
    # Train low-rank adapters (peft) instead of every weight; the reference policy for KL is then the base
    # model with the adapters switched off, so no second copy is kept.
    enabled: bool = False
    r: int = positive(16)
    alpha: int = positive(32)
    dropout: float = in_range(0.0, 0, 1, high_open=True)
    target_modules: list[str] = any_value(
        factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class ModelConfig:
    # Short name of the model choice, used in run names and reports.
    name: str = any_value(MISSING)
    # "embedded:smollm2-135m-instruct" (the packaged default), "random:tiny-llama" (tests), a hub id,
    # a local HF directory, or a .gguf file.
    name_or_path: str = path(MISSING, "model")
    # auto: bfloat16 on CUDA, float32 on CPU.
    dtype: str = choice("auto", ("auto", "float32", "bfloat16", "float16"))
    # auto: CUDA when available.
    device: str = choice("auto", ("auto", "cpu", "cuda"))
    # Recompute activations in the backward pass: less memory, ~30% more compute.
    gradient_checkpointing: bool = False
    # Seed for the weights of randomly initialised models (model=tiny_random).
    init_seed: int = non_negative(0)
    # bf16: autocast forward passes to bf16 while weights and optimizer state stay in model.dtype.
    # auto: bf16 where it is fast (CUDA with bf16; CPUs with AVX-512 BF16 or AMX), else no (AVX2-only CPUs
    # emulate bf16 matmuls hundreds of times slower than fp32).
    mixed_precision: str = choice("auto", ("auto", "no", "bf16"))
    # 4bit: load the base weights in 4-bit NF4 (QLoRA, bitsandbytes, CUDA only; needs LoRA).
    quantization: str = choice("none", ("none", "4bit"))
    lora: LoraSettings = field(default_factory=LoraSettings)


@dataclass
class RewardWeightsConfig:
    """task.reward_weights: one weight per reward component (0: not used). grpo-run task.reward_weights.format=0.1"""

    # The task's own reward (r1_zero: format AND correct answer).
    correctness: float = finite(1.0)
    # The task's format_reward alone (shaping toward the format).
    format: float = finite(0.0)
    # The task's answer_reward alone (keyword: fraction of keywords present; json: fraction of right values).
    answer: float = finite(0.0)
    # gsm8k, regex_sum: 1 when the answer is within task.numeric_tolerance of the truth; medcalc: within an
    # absolute task.answer_atol.
    numeric_close: float = finite(0.0)
    # Shaping terms of every task, penalties in [-1, 0] (docs/evaluation.md#reward-shaping). overlong: DAPO's
    # soft linear penalty over the last task.overlong_buffer tokens before rollout.max_tokens (-1 at the limit).
    overlong: float = finite(0.0)
    # repetition: open-r1's n-gram repetition penalty, -(1 - distinct / total word n-grams), n = task.repetition_ngram.
    repetition: float = finite(0.0)


# ----------------------------------------------------------------------------------------------------------
# Task schemas: TaskConfig holds the keys every task keeps; each task's schema adds the keys its TaskSpec reads
# (TaskSpec.options and .reward_options, as `cfg.task.<key>`). To add a task `foo` with a key `foo_size`:
#   1. here:  @dataclass class FooTaskConfig(TaskConfig): foo_size: int = 3   (a comment above each key)
#             and "foo": FooTaskConfig in TASK_SCHEMAS below (registered as `foo_schema` in group `task`);
#   2. conf/task/foo.yaml starts with   defaults: [foo_schema, _self_]   then `name: foo` and the values
#      that differ from the schema's defaults.
# The yaml files of `task` (and `rollout`) hold only the values of that choice; keys and defaults live here.


@dataclass
class TaskConfig:
    """task.*: the keys every task has."""

    # Task registry name (grpo_cli.tasks.TASKS).
    name: str = choice(MISSING, lambda: tuple(importlib.import_module("grpo_cli.tasks").TASKS))
    # chat: the tokenizer's chat template. With r1_zero, generation also stops at "</answer>" (kept in the output).
    prompt: str = choice("chat", PROMPT_STYLES)
    # Local JSONL files overriding the task's own data (null: the task's default source).
    train_path: str | None = path(None, "file")
    eval_path: str | None = path(None, "file")
    # How many examples to build or read for each split (null: all the source has).
    n_train: int | None = positive(2000)
    n_eval: int | None = positive(64)
    # Seed of the synthetic data generator (independent of the training seed, so the eval set is stable).
    data_seed: int = non_negative(1234)
    # Weights of the reward components (RewardWeightsConfig); their weighted sum is the reward advantages use.
    reward_weights: RewardWeightsConfig = field(default_factory=RewardWeightsConfig)
    # Wall-clock limit per reward call; a timeout scores 0 and is counted (train/reward_timeouts). 0: none.
    reward_timeout_s: float = non_negative(10.0, hint="0: no time limit")
    # Extra held-out sets, each evaluated beside the task's own and logged under eval/<name>/...: a local JSONL
    # file (*.jsonl), a split of the task's hub dataset, or <dataset>:<split> / <dataset>:<config>:<split>.
    # grpo-run task=math +task.eval_sets.math500=test +task.eval_sets.gsm8k=tests/fixtures/gsm8k_sample.jsonl
    eval_sets: dict[str, str] = any_value(factory=dict)
    # reward_weights.overlong: the penalty ramps from 0 to -1 over the last overlong_buffer tokens before
    # rollout.max_tokens (null: a quarter of rollout.max_tokens).
    overlong_buffer: int | None = positive(None)
    # reward_weights.repetition: the n of the word n-grams whose repeats are penalized.
    repetition_ngram: int = positive(3)


@dataclass
class NumericCloseOptions:
    """The numeric_close reward component's key (a mixin of the task schemas that offer numeric_close)."""

    # numeric_close: relative tolerance (0.01: within 1% of the truth).
    numeric_tolerance: float = non_negative(0.01)


@dataclass
class KeywordTaskConfig(TaskConfig):
    # How many keywords each prompt asks for.
    keywords_per_prompt: int = positive(2)


@dataclass
class HubTaskConfig(TaskConfig):
    """A task read from a hub dataset through `datasets` when no local path is given."""

    hub_dataset: str | None = any_value(None)
    hub_config: str | None = any_value(None)
    hub_train_split: str = any_value("train")
    hub_eval_split: str = any_value("test")


@dataclass
class MathTaskConfig(HubTaskConfig):
    """task=math: the hub keys, nothing of its own."""


@dataclass
class GSM8KTaskConfig(NumericCloseOptions, HubTaskConfig):
    """task=gsm8k: the hub keys and the numeric tolerance."""


@dataclass
class LipogramTaskConfig(TaskConfig):
    # The fewest words an answer may have (with the topic word) to be rewarded.
    min_words: int = positive(10)


@dataclass
class JsonTaskConfig(TaskConfig):
    # How many of the five fields (name, age, city, occupation, start_year) each prompt asks for.
    fields_per_prompt: int = positive(3)


@dataclass
class RegexSumTaskConfig(NumericCloseOptions, TaskConfig):
    # Numbers per paragraph, each in 1..max_number.
    numbers_per_prompt: int = positive(4)
    max_number: int = positive(99)


@dataclass
class AdditionTaskConfig(TaskConfig):
    """task=addition: synthetic data from task.data_seed, nothing of its own."""


@dataclass
class MedcalcTaskConfig(HubTaskConfig):
    # numeric_close: largest absolute difference from the ground truth's number that still counts.
    answer_atol: float = non_negative(0.5)


# task name -> its schema, stored as `<name>_schema` in group `task` (conf/task/<name>.yaml extends it).
TASK_SCHEMAS: dict[str, type[TaskConfig]] = {
    "keyword": KeywordTaskConfig,
    "math": MathTaskConfig,
    "gsm8k": GSM8KTaskConfig,
    "lipogram": LipogramTaskConfig,
    "json": JsonTaskConfig,
    "regex_sum": RegexSumTaskConfig,
    "addition": AdditionTaskConfig,
    "medcalc": MedcalcTaskConfig,
}


@dataclass
class LossConfig:
    # no_baseline: -R log pi | reinforce_with_baseline: -A log pi | grpo_clip: PPO-style clipped ratio.
    type: str = choice("reinforce_with_baseline", _from_core("losses", "POLICY_GRADIENT_LOSS_TYPES"))
    # PPO clip range epsilon for grpo_clip: ratios are clipped to [1 - cliprange, 1 + cliprange].
    cliprange: float = in_range(0.2, 0, 1, low_open=True, high_open=True)


@dataclass
class NormalizationConfig:
    # std: (r - mean) / (std + eps) (GRPO) | mean: r - mean (Dr. GRPO)
    advantage: str = choice("std", ("std", "mean"))
    advantage_eps: float = non_negative(1e-6)
    # sequence_mean: per-response masked mean | constant: masked sum / length_constant (Dr. GRPO)
    length: str = choice("sequence_mean", _from_core("train_step", "LENGTH_NORMALIZATIONS"))
    # The constant of length=constant; null means rollout.max_tokens.
    length_constant: float | None = positive(None)


@dataclass
class KLConfig:
    # Weight of the KL penalty to the frozen initial policy; 0 disables the penalty.
    beta: float = non_negative(0.0)
    # k1: log p - log p_ref | k3: Schulman's non-negative estimator.
    estimator: str = choice("k3", _from_core("kl", "KL_ESTIMATORS"))
    # Measure KL every step even when beta == 0 (costs one reference forward per step).
    monitor: bool = False


@dataclass
class SyncConfig:
    # How rollouts and updates interleave (docs/sync.md):
    #   on_policy: generate a rollout batch, take one optimizer step on it, repeat (one process).
    #   multi_epoch: several epochs / optimizer steps over each rollout batch (one process; needs grpo_clip).
    #   one_behind: the generator samples batch k+1 while the learner trains on batch k (Ray actors); the
    #     generator is never more than one policy version behind.
    #   replay_buffer: the generator keeps filling a bounded buffer of scored trajectories and each step trains
    #     on a uniform sample of it (Ray actors; needs grpo_clip).
    strategy: str = choice("on_policy", SYNC_STRATEGIES)
    # Passes over each rollout batch (each pass takes rollout_batch_size / train_batch_size optimizer steps).
    epochs_per_rollout_batch: int = positive(1)
    # Compute the old (behaviour) policy's log-probs once per rollout batch: null (default) when the loss needs
    # them, i.e. grpo_clip with an off-policy strategy; true also for other losses (logs train/old_policy_kl);
    # false never (then grpo_clip is only valid on-policy). With one_behind / replay_buffer the generator
    # computes them with the exact weights that sampled.
    old_log_probs: bool | None = None
    # replay_buffer: trajectories (completions) the buffer holds; the oldest are dropped when it is full.
    # At least train.rollout_batch_size, the sample each step trains on.
    buffer_size: int = positive(64)
    # replay_buffer: trajectories sampled more than this many policy versions ago are dropped unused.
    max_staleness: int = non_negative(2)
    # one_behind / replay_buffer: the Ray cluster to use (e.g. "ray://head:10001" or "auto"); null starts a
    # local Ray on this machine for the run and shuts it down afterwards.
    ray_address: str | None = any_value(None)
    # CPUs reserved for each actor (generator, learner) and torch threads in it. null: half this machine's
    # cores (at least 1), so the two actors do not fight over every core.
    actor_cpus: int | None = positive(None, hint="null: half this machine's cores")
    # GPUs for each actor. null: 1 when this machine has CUDA and model.device is not cpu, else 0.
    actor_gpus: float | None = non_negative(None)


# ----------------------------------------------------------------------------------------------------------
# Rollout schemas: SamplingConfig holds the keys every engine has (all at rollout.<key> on the command line);
# each engine's schema adds its own, registered as `<engine>_schema` in group `rollout`.


@dataclass
class SamplingConfig:
    """rollout.*: the engine and the sampling keys every engine has."""

    # hf: transformers generate on the policy | vllm: vLLM's offline engine (its own keys: VLLMRolloutConfig).
    engine: str = choice("hf", lambda: tuple(ROLLOUT_SCHEMAS))
    # Training rollouts' temperature: at 0 every completion of a group would be the same (zero advantage).
    temperature: float = positive(1.0, hint="use a temperature > 0 for training rollouts; eval_temperature=0 is greedy")
    top_p: float = unit_interval(1.0)
    min_tokens: int = non_negative(4)
    max_tokens: int = positive(48)
    # Stop strings; the stop string is kept in the output. EOS always stops.
    stop: list[str] = any_value(factory=list)
    # Evaluation decoding temperature: 0 is greedy.
    eval_temperature: float = non_negative(0.0, hint="0 is greedy")
    # Prompts per generate() call (null: the whole batch at once). Caps generation memory.
    max_batch_prompts: int | None = positive(None)


@dataclass
class HFRolloutConfig(SamplingConfig):
    """rollout=hf: the policy itself samples (static KV cache, grpo_cli/rollout/decode.py)."""

    # torch.compile the decode step: auto = on CUDA only (on the measured 2-core CPU it was no faster and took
    # minutes to compile; docs/performance.md).
    compile: str = choice("auto", ("auto", "always", "never"))


@dataclass
class VLLMRolloutConfig(SamplingConfig):
    """rollout=vllm: the vLLM-only keys (see grpo_cli/rollout/vllm_engine.py)."""

    # Fraction of GPU memory vLLM may take. It shares the GPU with the trainer (colocated), hence well below 0.9.
    gpu_memory_utilization: float = unit_interval(0.4)
    # KV cache size in GiB; null: from gpu_memory_utilization on GPU, 1 GiB on CPU (RAM is shared with training).
    kv_cache_memory_gb: float | None = positive(None)
    # Longest prompt + completion vLLM must hold; null: the model's own limit.
    max_model_len: int | None = positive(None)
    tensor_parallel_size: int = positive(1)
    # Free vLLM's KV cache while the trainer runs (GPU only; vLLM ignores it on CPU).
    enable_sleep_mode: bool = False
    # Eager mode starts in seconds; CUDA graphs (false) start slower and decode faster on a GPU.
    enforce_eager: bool = True
    # Post-sync probe: largest allowed |log p_vLLM - log p_trainer|; null: 1e-3 in fp32, 0.5 in bf16.
    sync_tolerance: float | None = non_negative(None)
    sync_probe: bool = True
    # Probe every this many steps (a multiple of it), and always at the first push of a process (a fresh or a
    # resumed run) and after the last step. 1: after every push (~1 s each on a 2-core CPU at 135M parameters).
    sync_probe_every: int = positive(10)
    # A weight sync taking longer than this stops the run instead of hanging it.
    sync_timeout_s: float = positive(300.0)
    # Anything else for vllm.LLM(...), e.g. {enable_prefix_caching: false}.
    vllm_kwargs: dict[str, Any] = any_value(factory=dict)


# rollout.engine -> its schema (the allowed values of rollout.engine), stored as `<engine>_schema`.
ROLLOUT_SCHEMAS: dict[str, type[SamplingConfig]] = {"hf": HFRolloutConfig, "vllm": VLLMRolloutConfig}


def rollout_config_for(rollout: SamplingConfig, engine: str) -> SamplingConfig:
    """`rollout` moved to another engine: the same sampling keys, that engine's schema and defaults for the rest
    (the benchmark runs one composed config on every engine)."""
    schema = ROLLOUT_SCHEMAS[engine]
    keep = {name: getattr(rollout, name) for name in _field_names(schema) if hasattr(rollout, name)}
    return schema(**{**keep, "engine": engine})


@dataclass
class TrainConfig:
    # Number of GRPO steps (rollout batches). CPU-sized: 30 steps take ~12 minutes on 2 cores.
    steps: int = positive(30)
    # Completions per rollout batch (= prompts per batch * group_size).
    rollout_batch_size: int = positive(16)
    # Completions sampled per prompt (G).
    group_size: int = positive(4)
    # Completions per optimizer step.
    train_batch_size: int = positive(16)
    # Microbatches per optimizer step (train_batch_size / this = microbatch size).
    gradient_accumulation_steps: int = positive(2)
    max_grad_norm: float = positive(1.0)
    # Run each distinct prompt of a microbatch through the model once and share its keys/values among its G
    # completions (same numbers, ~G x fewer prompt FLOPs). Off with gradient checkpointing (no KV cache then).
    share_prompt_forward: bool = True
    # Evaluate every N steps (also at step 0 and at the end); 0 means only at the start and the end.
    eval_every: int = non_negative(10, hint="0: evaluate only at the start and the end")
    # Held-out examples per evaluation (null: all of task.n_eval).
    eval_examples: int | None = positive(None, hint="null: all of task.n_eval")
    # Save a checkpoint every N steps and at the end (0: only at the end); keep the newest K (K >= 2 leaves a
    # fallback if the newest is damaged).
    checkpoint_every: int = non_negative(10, hint="0: only at the end")
    keep_checkpoints: int = positive(2)
    # Skip an update whose loss or gradients are not finite; stop the run after this many in a row.
    max_nonfinite_steps: int = positive(3)
    # Leave completions cut at rollout.max_tokens out of the loss (DAPO's overlong filtering, TRL's
    # mask_truncated_completions); they still count in their group's advantages. Logged as train/masked_frac.
    mask_truncated: bool = False


@dataclass
class OptimConfig:
    # 2e-5 suits the CPU-sized batch of 16 completions; the handouts use 1e-5 at 256.
    lr: float = positive(2e-5)
    weight_decay: float = non_negative(0.0)
    # Adam's two betas, each in [0, 1).
    betas: list[float] = in_range(low=0, high=1, high_open=True, factory=lambda: [0.9, 0.95])


@dataclass
class LoggerConfig:
    # none: metrics.jsonl only | wandb: metrics.jsonl and Weights & Biases | tensorboard: metrics.jsonl and
    # TensorBoard event files in <run dir>/tensorboard (the `tensorboard` extra).
    backend: str = choice("none", ("none", "wandb", "tensorboard"))
    # W&B project, entity (user or team; null: your default) and group. A multirun fills a null group with
    # the sweep's name, so the runs of one sweep sit together.
    project: str = any_value("grpo-cli")
    entity: str | None = any_value(None)
    group: str | None = any_value(None)
    tags: list[str] = any_value(factory=list)
    # W&B run name; null: the run directory's name (e.g. 3_optim.lr=1e-05,seed=1 in a multirun).
    name: str | None = any_value(None)
    # online without an API key, or without a server answering within init_timeout_s, logs offline instead
    # (upload later with `wandb sync`).
    mode: str = choice("offline", ("online", "offline", "disabled"))
    init_timeout_s: float = positive(15.0)
    # Log a W&B table (TensorBoard: a text entry) of eval completions at evaluations whose step is a multiple
    # of this (0: none), with at most samples_rows rows each.
    samples_every: int = non_negative(1, hint="0: no sample tables")
    samples_rows: int = positive(32)


@dataclass
class JobConfig:
    name: str = choice("train", ("train", "baseline_eval", "report", "check_reward", "benchmark"))
    # baseline_eval: how many held-out examples to evaluate (null: all of task.n_eval).
    n_examples: int | None = positive(None, hint="null: all of task.n_eval")
    # benchmark: rollout engines to compare (auto: hf, plus vllm when installed), unmeasured warm-up steps,
    # measured steps per engine.
    engines: list[str] = choice(MISSING, lambda: ("auto", *ROLLOUT_SCHEMAS), factory=lambda: ["auto"])
    warmup_steps: int = non_negative(0)
    steps: int = positive(6)
    # benchmark: also measure how a step's cost grows with the rollout batch (at rollout.max_tokens) and with the
    # completion length (at train.rollout_batch_size; every completion forced to max_tokens), scaling_steps each.
    scaling: bool = False
    scaling_batches: list[int] = positive(factory=lambda: [8, 16, 32, 64])
    scaling_max_tokens: list[int] = positive(factory=lambda: [32, 64, 128, 256])
    scaling_steps: int = positive(2)
    # What the run returns to a Hydra sweeper (hydra/sweeper=optuna maximizes it): the eval reward of the last
    # evaluation, or the highest of all evaluations (train; baseline_eval: its one eval reward).
    objective: str = choice("final_eval_reward", ("final_eval_reward", "best_eval_reward"))


@dataclass
class EvalConfig:
    """eval.*: how each held-out prompt is answered and scored (docs/evaluation.md)."""

    # Completions per held-out prompt. 1: one answer each at rollout.eval_temperature (greedy by default), scored
    # as eval/reward. n > 1: n samples at rollout.eval_temperature (> 0), also scored as eval/mean@n,
    # eval/pass@k and eval/maj@n.
    n_samples: int = positive(1, hint="1: one answer per held-out prompt")
    # The k of eval/pass@k, each in 1..n_samples; null: 1 and n_samples.
    pass_k: list[int] | None = positive(None)


@dataclass
class ReportConfig:
    # job=report: run directories to compare, or one multirun directory (every run below it). A single path
    # may be given without brackets: report.runs=outputs/multirun/2026-11-22_07-00-00
    runs: Any = path(None, "dir", factory=list)
    # Where report.md and the plots go; null: the report job's own run directory (outputs/report/<time>).
    out: str | None = path(None, "output")


# distributed.strategy: how the learner spreads over devices (torch.distributed).
DISTRIBUTED_STRATEGIES = ("none", "ddp", "fsdp")


@dataclass
class DistributedConfig:
    """distributed.*: data-parallel GRPO over several processes (docs/distributed.md). train.* sizes stay global
    (the whole step across all ranks); each rank takes an equal share of the step's prompts."""

    # none: one process | ddp: DistributedDataParallel | fsdp: FSDP2 fully_shard (per decoder layer, then the
    # root), parameters, gradients and optimizer state sharded across ranks.
    strategy: str = choice("none", DISTRIBUTED_STRATEGIES)
    # Ranks (processes) per node that `grpo-run` starts (one per GPU on CUDA); ignored under an external torchrun
    # or srun, which set RANK/WORLD_SIZE themselves.
    nproc_per_node: int = positive(1)
    # Nodes, this node's index, and the rendezvous address of node 0 (loopback on one machine).
    nnodes: int = positive(1)
    node_rank: int = non_negative(0)
    master_addr: str = any_value("127.0.0.1")
    master_port: int = in_range(29511, 1, 65535)
    # auto: nccl on CUDA, gloo on CPU.
    backend: str = choice("auto", ("auto", "nccl", "gloo"))
    # How long a rank waits for the others at a collective (e.g. while rank 0 evaluates) before failing.
    timeout_min: float = positive(60.0)


@dataclass
class GRPOConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    # One of TASK_SCHEMAS, picked by task=<name> (conf/task/<name>.yaml extends <name>_schema).
    task: TaskConfig = MISSING
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
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    seed: int = non_negative(0)
    # null: a new run | true: continue the newest run under the same output root | a run directory.
    resume: Any = path(None, "run")
    # Run directory; Hydra's ${hydra:runtime.output_dir} by default.
    output_dir: str = path(MISSING, "output")
    # Print a per-step metrics line on the console.
    verbose: bool = True


# Groups with one schema per choice: group -> {choice: schema}.
GROUP_SCHEMAS: dict[str, dict[str, type]] = {"task": TASK_SCHEMAS, "rollout": ROLLOUT_SCHEMAS}


@dataclass(frozen=True)
class BatchShape:
    """The batch arithmetic of a run and whether its updates are off-policy, derived once from the config
    (printed before any model loads; validation and training both read it)."""

    prompts_per_rollout_batch: int
    completions_per_rollout_batch: int
    group_size: int
    train_batch_size: int
    microbatch_size: int
    gradient_accumulation_steps: int
    epochs_per_rollout_batch: int
    optimizer_steps_per_rollout_batch: int
    max_new_tokens: int
    # sync.strategy
    sync_strategy: str
    # Data-parallel ranks sharing each step (1 without distributed.*): the sizes above stay global, each rank
    # takes an equal share of the prompts (whole groups) and of every train batch.
    ranks: int = 1

    @classmethod
    def from_config(cls, cfg: Any) -> BatchShape:
        t = cfg.train
        epochs = cfg.sync.epochs_per_rollout_batch
        distributed = cfg.distributed
        ranks = 1 if distributed.strategy == "none" else distributed.nproc_per_node * distributed.nnodes
        return cls(
            ranks=ranks,
            prompts_per_rollout_batch=t.rollout_batch_size // t.group_size,
            completions_per_rollout_batch=t.rollout_batch_size,
            group_size=t.group_size,
            train_batch_size=t.train_batch_size,
            microbatch_size=t.train_batch_size // t.gradient_accumulation_steps,
            gradient_accumulation_steps=t.gradient_accumulation_steps,
            epochs_per_rollout_batch=epochs,
            optimizer_steps_per_rollout_batch=epochs * t.rollout_batch_size // t.train_batch_size,
            max_new_tokens=cfg.rollout.max_tokens,
            sync_strategy=cfg.sync.strategy,
        )

    @property
    def prompts_per_rank(self) -> int:
        return self.prompts_per_rollout_batch // self.ranks

    @property
    def train_batch_per_rank(self) -> int:
        return self.train_batch_size // self.ranks

    @property
    def gradient_accumulation_per_rank(self) -> int:
        """Microbatches per rank and optimizer step: the microbatch keeps its one-process size, so the ranks'
        averaged gradient is the one-process gradient."""
        return max(1, self.train_batch_per_rank // self.microbatch_size)

    @property
    def off_policy(self) -> bool:
        """Whether an update may run on a policy that moved since the batch was sampled: several optimizer steps
        per rollout batch, or a generator that runs behind the learner (the DISAGGREGATED strategies)."""
        return self.optimizer_steps_per_rollout_batch > 1 or self.sync_strategy in DISAGGREGATED

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


def needs_old_log_probs(cfg: Any) -> bool:
    """Whether old (behaviour) log-probs are computed once per rollout batch (sync.old_log_probs, null: when
    needed). grpo_clip needs them whenever an update may run on a policy that moved since the rollout
    (BatchShape.off_policy). With one on-policy step the ratio is exactly 1 and the current log-probs serve
    (detached)."""
    if cfg.sync.old_log_probs is not None:
        return bool(cfg.sync.old_log_probs)
    return cfg.loss.type == "grpo_clip" and BatchShape.from_config(cfg).off_policy


# ----------------------------------------------------------------------------------------------------------
# The declared choices, read back from the schemas.


def _choices_of(cls: type, name: str) -> Choices | None:
    """The `choice(...)` declaration of field `name`, also when a subclass only changes its default."""
    constraint = constraint_of(cls, name)
    return constraint.choices if constraint is not None and constraint.kind == "choice" else None


def _resolve(allowed: Choices) -> tuple[str, ...]:
    return tuple(allowed()) if callable(allowed) else tuple(allowed)


def _schema_fields(cls: type) -> Iterator[tuple[str, type | None]]:
    """(field name, the field's dataclass type or None) for every field of a schema dataclass."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name)
        yield f.name, hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _walk_schema(cls: type, prefix: str = "") -> Iterator[tuple[str, Choices]]:
    """(dotted key, declaration) of every choice field under schema `cls`, including each per-choice schema
    of the groups in GROUP_SCHEMAS."""
    for name, nested in _schema_fields(cls):
        key = f"{prefix}{name}"
        allowed = _choices_of(cls, name)
        if allowed is not None:
            yield key, allowed
        if nested is not None:
            for schema in (nested, *GROUP_SCHEMAS.get(key, {}).values()):
                yield from _walk_schema(schema, f"{key}.")


def choice_fields() -> dict[str, tuple[str, ...]]:
    """Every choice key of the config and its allowed values, in schema order."""
    return {key: _resolve(allowed) for key, allowed in dict(_walk_schema(GRPOConfig)).items()}


def allowed_values(key: str) -> tuple[str, ...]:
    """The allowed values of one choice key, e.g. allowed_values("rollout.engine") == ("hf", "vllm")."""
    declared = dict(_walk_schema(GRPOConfig))
    if key not in declared:
        raise KeyError(f"{key} is not a choice key: one of {', '.join(declared)}")
    return _resolve(declared[key])


def constraint_of(cls: type, name: str) -> Constraint | None:
    """The declared constraint of field `name` of schema `cls`, also when a subclass only changes its default."""
    for klass in cls.__mro__:
        declared = getattr(klass, "__dataclass_fields__", {}).get(name)
        if declared is not None and CONSTRAINT in declared.metadata:
            return declared.metadata[CONSTRAINT]
    return None


def _show(value: Any) -> str:
    return str(list(value)) if isinstance(value, list | tuple) else str(value)


def _check_fields(node: Any, prefix: str = "") -> None:
    """Every field holds a value its declared constraint allows (each item of a list field), and no key was
    added beside the schema's (`+task.foo=1`)."""
    extra = sorted(set(vars(node)) - _field_names(type(node)))
    if extra:
        hint = _keys_hint(prefix.rstrip("."), type(node), extra[0])
        raise UserFacingError(f"{prefix}{extra[0]} is not a key: {hint}")
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        constraint = constraint_of(type(node), f.name)
        if constraint is not None and value is not None:
            items = value if isinstance(value, list | tuple) else [value]
            for item in items:
                problem = constraint.problem(item)
                if problem is not None:
                    # "k=0 must be >= 1", "k=[0] holds 0, which must be >= 1", "k=/a: no such file ..."
                    where = f" holds {item}" if items is value else ""
                    sep = ": " if constraint.kind == "path" else (", which " if where else " ")
                    hint = f" ({constraint.hint})" if constraint.hint else ""
                    raise UserFacingError(f"{prefix}{f.name}={_show(value)}{where}{sep}{problem}{hint}")
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _check_fields(value, f"{prefix}{f.name}.")


# ----------------------------------------------------------------------------------------------------------
# Registration, help text, saved configs.


def _help_allowed_values() -> str:
    """`grpo-run --help`'s list of every choice key and its values (${grpo_allowed_values:} in conf/config.yaml)."""
    return "\n".join(f"{key}: {', '.join(values)}" for key, values in choice_fields().items())


def _help_config_groups() -> str:
    """Hydra's group list for --help (${grpo_config_groups:}), less the per-choice `*_schema` entries."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    loader = GlobalHydra.instance().config_loader()

    def groups(parent: str) -> Iterator[str]:
        for name in loader.list_groups(parent):
            group = f"{parent}/{name}" if parent else name
            if group != "hydra":
                yield group
                yield from groups(group)

    lines = []
    for group in sorted(groups("")):
        options = [o for o in loader.get_group_options(group, ObjectType.CONFIG) if not o.endswith("_schema")]
        if options:
            lines.append(f"{group}: {', '.join(sorted(options))}")
    return "\n".join(lines)


def register_configs() -> None:
    """Register the schemas (conf/config.yaml extends `grpo_config_schema`, conf/task/<name>.yaml extends
    `<name>_schema`, conf/rollout/<engine>.yaml `<engine>_schema`) and the resolvers of the help text."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="grpo_config_schema", node=GRPOConfig)
    for group, schemas in GROUP_SCHEMAS.items():
        for choice_name, schema in schemas.items():
            cs.store(group=group, name=f"{choice_name}_schema", node=schema)
    OmegaConf.register_new_resolver("grpo_allowed_values", _help_allowed_values, replace=True)
    OmegaConf.register_new_resolver("grpo_config_groups", _help_config_groups, replace=True)
    register_sweep_plugins()


def register_sweep_plugins() -> None:
    """hydra/launcher=processes (conf/config.yaml's launcher for -m) and an Optuna sweeper that maximizes.

    Hydra's plugin scan misses plugins of an editable install (pkgutil cannot list the editable finder's paths),
    so the launcher is registered by hand. The scan re-executes every plugin module (the Optuna sweeper's config
    would store its own `direction: minimize` again), so it runs first; it runs once per process.
    """
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    plugins = Plugins.instance()
    from hydra_plugins.grpo_cli_launcher.process_launcher import ProcessLauncher

    plugins.register(ProcessLauncher)
    try:
        from hydra_plugins.hydra_optuna_sweeper.config import Direction, OptunaSweeperConf
    except ImportError:  # no [optuna] extra: hydra/sweeper=optuna stops with one line (cli.py)
        return
    # job.objective is a reward: higher is better (the plugin's default direction is minimize).
    node = OptunaSweeperConf(direction=Direction.maximize)
    ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=node, provider="optuna_sweeper")


def _keys_hint(parent: str, object_type: type, key: str) -> str:
    """ "task=keyword has the keys name, ..., keywords_per_prompt (min_words is a key of task=lipogram)" """
    schemas = GROUP_SCHEMAS.get(parent, {})
    label = next((f"{parent}={name}" for name, schema in schemas.items() if schema is object_type), None)
    keys = ", ".join(f.name for f in dataclasses.fields(object_type))
    others = [f"{parent}={name}" for name, schema in schemas.items() if key in _field_names(schema)]
    elsewhere = f" ({key} is a key of {' and '.join(others)})" if others else ""
    return f"{label or parent or 'the config'} has the keys {keys}{elsewhere}"


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def unknown_key_hint(error: BaseException) -> str | None:
    """For an OmegaConf "Key 'x' not in 'SomeConfig'" error (itself or its cause): which keys that node has,
    and which other choice of its group has the key (see _keys_hint). None for other errors."""
    for e in (error, error.__cause__):
        object_type = getattr(e, "object_type", None)
        full_key = getattr(e, "full_key", None)
        if isinstance(object_type, type) and dataclasses.is_dataclass(object_type) and full_key:
            parent, _, key = str(full_key).rpartition(".")
            if key not in _field_names(object_type):  # else a known key with a bad value
                return _keys_hint(parent, object_type, key)
    return None


def _schema_for(group: str, saved: Any, selector: str) -> type | None:
    """The per-choice schema a saved group node was made with: the one its `selector` key (task.name,
    rollout.engine) names, else (a test task's name) the one whose keys are exactly the saved keys."""
    if not isinstance(saved, DictConfig):
        return None
    schemas = GROUP_SCHEMAS[group]
    keys = set(saved.keys())
    exact = (schema for schema in schemas.values() if _field_names(schema) == keys)
    return schemas.get(str(saved.get(selector))) or next(exact, None)


class SavedConfigError(UserFacingError):
    """A run directory's config.yaml that cannot be read as a config at all (not YAML, binary, empty, not a
    mapping): `reason` says how; the message names the file and what to do."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(
            f"{path} is damaged ({reason}): restore it (Hydra keeps the run's original config in "
            f"{path.parent / '.hydra' / 'config.yaml'}), or start a new run without resume=..."
        )
        self.reason = reason


def _load_yaml_mapping(path: Path) -> DictConfig:
    """OmegaConf.load of a config file that must hold a mapping; SavedConfigError when it cannot."""
    import yaml

    try:
        loaded = OmegaConf.load(path)
    except UnicodeDecodeError:
        raise SavedConfigError(path, "not UTF-8 text") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise SavedConfigError(path, f"not valid YAML{where}") from None
    except OSError as e:
        raise SavedConfigError(path, f"unreadable: {e.strerror}") from None
    if not isinstance(loaded, DictConfig) or not loaded:
        raise SavedConfigError(path, "empty" if not loaded else "not a mapping of keys")
    return loaded


def load_saved_config(path: Path) -> DictConfig:
    """A run directory's config.yaml under the schemas (GRPOConfig, with the task and rollout schemas of that
    run), so that resuming checks it as a fresh run would. A file that is no config at all is a SavedConfigError
    (which resuming recovers from, cli.resumed_config); a bad key or value a UserFacingError (one line).

    Keys of another choice's schema are dropped from `task` and `rollout`: a config.yaml written before the
    per-task schemas holds every task's keys, which that run's task never read.
    """
    from omegaconf.errors import OmegaConfBaseException

    saved = _load_yaml_mapping(path)
    try:
        base = OmegaConf.structured(GRPOConfig)
        for group, selector in (("task", "name"), ("rollout", "engine")):
            node = saved.get(group)
            schema = _schema_for(group, node, selector)
            if schema is None:
                continue
            base[group] = OmegaConf.structured(schema)
            others = set().union(*map(_field_names, GROUP_SCHEMAS[group].values())) - _field_names(schema)
            for key in [k for k in node.keys() if k in others]:
                del node[key]
        return OmegaConf.merge(base, saved)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        hint = unknown_key_hint(e)
        raise UserFacingError(f"{path}: {text}{': ' + hint if hint else ''}") from None


# ----------------------------------------------------------------------------------------------------------
# Cross-field validation: every rule names the fields involved and what to write instead.


def validate_sync(cfg: Any) -> None:
    """The sync strategy's rules: how many optimizer steps per batch, which losses stay correct off-policy,
    and the replay buffer's bounds."""
    t, sync = cfg.train, cfg.sync
    shape = BatchShape.from_config(cfg)
    steps = shape.optimizer_steps_per_rollout_batch
    if sync.strategy == "on_policy" and steps != 1:
        raise UserFacingError(
            f"sync=on_policy takes one optimizer step per rollout batch, but sync.epochs_per_rollout_batch="
            f"{shape.epochs_per_rollout_batch} and train.rollout_batch_size/train.train_batch_size="
            f"{t.rollout_batch_size // t.train_batch_size} give more: use sync=multi_epoch, or set "
            "train.train_batch_size=train.rollout_batch_size and one epoch"
        )
    if steps > 1 and cfg.loss.type != "grpo_clip":
        raise UserFacingError(
            f"{steps} optimizer steps per rollout batch make later steps off-policy, which "
            f"loss={cfg.loss.type} ignores: use loss=grpo_clip (importance ratios with clipping)"
        )
    if sync.strategy == "replay_buffer" and cfg.loss.type != "grpo_clip":
        raise UserFacingError(
            f"sync=replay_buffer trains on trajectories up to sync.max_staleness={sync.max_staleness} policy "
            f"versions old, which loss={cfg.loss.type} ignores: use loss=grpo_clip (importance ratios with clipping)"
        )
    if cfg.loss.type == "grpo_clip" and shape.off_policy and sync.old_log_probs is False:
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


def validate_distributed(cfg: Any) -> None:
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
    if cfg.rollout.engine == "vllm" and cfg.rollout.tensor_parallel_size != 1:
        raise UserFacingError(
            f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size} with distributed={d.strategy}: each "
            "rank runs its own vLLM engine on its own device and samples its own prompts, so tensor parallelism "
            "across ranks does not apply: use rollout.tensor_parallel_size=1"
        )
    if shape.prompts_per_rollout_batch % shape.ranks:
        raise UserFacingError(
            f"train.rollout_batch_size={cfg.train.rollout_batch_size} holds {shape.prompts_per_rollout_batch} "
            f"groups of train.group_size={shape.group_size}, which do not split equally among {shape.ranks} ranks: "
            f"use a multiple of {shape.ranks * shape.group_size}"
        )
    if shape.gradient_accumulation_steps % shape.ranks:
        raise UserFacingError(
            f"train.gradient_accumulation_steps={shape.gradient_accumulation_steps} microbatches per optimizer step "
            f"do not split equally among {shape.ranks} ranks: use a multiple of {shape.ranks}"
        )


def validate_config(cfg: Any) -> None:
    """Check every field against its declared constraint, then the rules between fields. Raises
    UserFacingError with a one-line message naming the key."""
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_object(cfg)
    _check_fields(cfg)
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
    bad_k = [k for k in cfg.eval.pass_k or [] if k > n_samples]
    if bad_k:
        raise UserFacingError(f"eval.pass_k={list(cfg.eval.pass_k)}: each k must be in 1..eval.n_samples={n_samples}")
    buffer = cfg.task.overlong_buffer
    if buffer is not None and buffer > cfg.rollout.max_tokens:
        raise UserFacingError(
            f"task.overlong_buffer={buffer} must be between 1 and rollout.max_tokens={cfg.rollout.max_tokens} "
            "(the overlong penalty ramps over that many tokens before the limit)"
        )
    from grpo_cli.tasks import validate_task_config  # the task registry knows each task's reward components

    validate_task_config(cfg.task)
