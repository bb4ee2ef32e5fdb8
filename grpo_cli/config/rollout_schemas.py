"""The rollout group's schemas: SamplingConfig holds the keys every engine has (all at rollout.<key> on the command
line); each engine's schema adds its own, registered as `<engine>_schema` in group `rollout` (rollout=hf|vllm picks
one, and validate_config checks that rollout.engine names the same engine)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from grpo_cli.config.fields import any_value, choice, flag, from_core, non_negative, positive, unit_interval


@dataclass
class SamplingConfig:
    """rollout.*: the engine and the sampling keys every engine has."""

    engine: str = choice(
        "hf",
        lambda: tuple(ROLLOUT_SCHEMAS),
        help="hf: the policy itself samples (the decode loop of engines/decode.py, or transformers' generate() "
        "where the loop does not support the model or the installed transformers) | vllm: vLLM's offline engine "
        "(rollout=vllm adds its own keys).",
    )
    temperature: float = positive(
        1.0,
        hint="use a temperature > 0 for training rollouts; eval_temperature=0 is greedy",
        help="Training rollouts' temperature: at 0 every completion of a group would be the same (zero advantage).",
    )
    top_p: float = unit_interval(
        1.0, help="Nucleus sampling: sample from the smallest set of tokens whose probability reaches top_p (1: all)."
    )
    min_tokens: int = non_negative(
        4, help="EOS and stop strings do not end a completion before this many tokens (<= max_tokens)."
    )
    max_tokens: int = positive(
        48, help="Longest completion, in tokens; one cut here counts as truncated (train.mask_truncated)."
    )
    stop: list[str] = any_value(
        factory=list, help="Stop strings; the stop string is kept in the output. EOS always stops."
    )
    eval_temperature: float = non_negative(
        0.0,
        hint="0 is greedy",
        help="The evaluation's sampling temperature: 0 is greedy; > 0 when eval.n_samples > 1 (n greedy answers "
        "would be one answer n times).",
    )
    max_batch_prompts: int | None = positive(
        None, help="Prompts per generate() call (null: the whole batch at once). Caps generation memory."
    )
    importance_correction: str = choice(
        "none",
        from_core("importance", "IMPORTANCE_CORRECTIONS"),
        help="Correct the loss for the sampler/learner mismatch with the engine's own log-probs of the sampled "
        "tokens (grpo_cli/core/importance.py): none | truncated: weight each token by min(pi_learner / pi_sampler, "
        "C) (TIS) | masked: weight by the ratio inside [C_low, C], reject tokens (or sequences) outside it (MIS / "
        "IcePop). The mismatch is measured either way (train/sampler_kl, train/importance_weight_*).",
    )
    importance_level: str = choice(
        "token",
        from_core("importance", "IMPORTANCE_LEVELS"),
        help="token: one ratio per token | sequence: one per response, the product of its token ratios.",
    )
    importance_threshold: float = positive(2.0, help="C: the cap of truncated, the upper bound of masked.")
    importance_threshold_low: float | None = positive(
        None,
        hint="null: 1 / rollout.importance_threshold",
        help="The lower bound of masked; null: 1 / importance_threshold.",
    )


@dataclass
class HFRolloutConfig(SamplingConfig):
    """rollout=hf: the policy itself samples (static KV cache, grpo_cli/engines/decode.py)."""

    compile: str = choice(
        "auto",
        ("auto", "always", "never"),
        help="torch.compile the decode step: auto = on CUDA only (on the measured 2-core CPU it was no faster and "
        "took minutes to compile; docs/performance.md).",
    )
    decoder: str = choice(
        "auto",
        ("auto", "generate"),
        help="auto: the decode loop where it supports the model and its first greedy tokens on it equal "
        "generate()'s (checked at the first rollout; otherwise generate(), said in one line) | generate: always "
        "transformers' generate() with the same sampling (slower; to compare the two paths).",
    )


# rollout.openai_server: what serves task.agent's OpenAI calls under rollout=vllm.
OPENAI_SERVERS = ("grpo_cli", "vllm")


@dataclass
class VLLMRolloutConfig(SamplingConfig):
    """rollout=vllm: the vLLM-only keys (see grpo_cli/engines/vllm_engine.py)."""

    gpu_memory_utilization: float = unit_interval(
        0.4,
        help="Fraction of GPU memory vLLM may take. It shares the GPU with the trainer (colocated), hence well "
        "below 0.9.",
    )
    kv_cache_memory_gb: float | None = positive(
        None,
        help="KV cache size in GiB; null: from gpu_memory_utilization on GPU, 1 GiB on CPU (RAM is shared with "
        "training).",
    )
    max_model_len: int | None = positive(
        None, help="Longest prompt + completion vLLM must hold; null: the model's own limit."
    )
    tensor_parallel_size: int = positive(1, help="GPUs vLLM splits the model over (1 with distributed=ddp / fsdp).")
    enable_sleep_mode: bool = flag(
        False,
        help="Free vLLM's KV cache while the trainer runs (sleep level 1: the weights stay; GPU only, vLLM ignores "
        "it on CPU).",
    )
    enforce_eager: bool = flag(
        True, help="Eager mode starts in seconds; CUDA graphs (false) start slower and decode faster on a GPU."
    )
    sync_tolerance: float | None = non_negative(
        None,
        help="Post-sync probe: largest allowed |log p_vLLM - log p_trainer|; null: 1e-3 in fp32, 0.5 in bf16, 0.25 in "
        "fp16.",
    )
    sync_probe: bool = flag(
        True,
        help="After a weight sync, check that vLLM's log-probs match the trainer's (within rollout.sync_tolerance).",
    )
    sync_probe_every: int = positive(
        10,
        help="Probe every this many steps (a multiple of it), and always at the first push of a process (a fresh or "
        "a resumed run) and after the last step. 1: after every push (~1 s each on a 2-core CPU at 135M "
        "parameters).",
    )
    sync_timeout_s: float = positive(
        300.0, help="A weight sync taking longer than this stops the run instead of hanging it."
    )
    vllm_kwargs: dict[str, Any] = any_value(
        factory=dict, help="Anything else for vllm.LLM(...), e.g. {enable_prefix_caching: false}."
    )
    openai_server: str = choice(
        "grpo_cli",
        OPENAI_SERVERS,
        help="What answers task.agent's OpenAI calls: grpo_cli (grpo-cli's endpoint, calls batched on the offline "
        "engine, chat turns continued without re-rendering) | vllm (vLLM's own OpenAI server on its AsyncLLM engine: "
        "continuous batching, vLLM's tool and reasoning parsers; each call's prompt is vLLM's rendering; "
        "docs/multi-turn.md).",
    )
    openai_server_args: list[str] = any_value(
        factory=list,
        help="More `vllm serve` flags for rollout.openai_server=vllm, e.g. [--enable-auto-tool-choice, "
        "--tool-call-parser, hermes].",
    )


# rollout.engine -> its schema (the allowed values of rollout.engine), stored as `<engine>_schema`.
ROLLOUT_SCHEMAS: dict[str, type[SamplingConfig]] = {"hf": HFRolloutConfig, "vllm": VLLMRolloutConfig}


def rollout_config_for(rollout: SamplingConfig, engine: str) -> SamplingConfig:
    """`rollout` moved to another engine: the same sampling keys, that engine's schema and defaults for the rest
    (the benchmark runs one composed config on every engine)."""
    schema = ROLLOUT_SCHEMAS[engine]
    keep = {f.name: getattr(rollout, f.name) for f in dataclasses.fields(schema) if hasattr(rollout, f.name)}
    return schema(**{**keep, "engine": engine})
