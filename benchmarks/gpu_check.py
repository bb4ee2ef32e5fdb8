"""Check, in a few minutes, the GPU paths no CPU run can show; run it by hand the moment a CUDA machine is at hand.

    python benchmarks/gpu_check.py [--out gpu_check.md]

Each row is one check; it prints a table (check, result, seconds, peak GPU memory, detail) and writes it to --out
for docs/results. On a machine without CUDA it still runs: the rows that need CUDA say "skipped" with the reason,
the others run on the CPU (CI runs it so, tests/unit/project/test_gpu_check.py, so the script cannot rot).

Rows:
- fp32 master weights + bf16 autocast: the policy's weights stay float32 (model.dtype=auto) while the forward runs
  in bf16 (model.mixed_precision=auto on a bf16 GPU); one update, peak memory per phase (load, forward+backward).
- decode loop eager and compiled vs generate: greedy tokens of the HF engine's decode loop equal model.generate's,
  eager and torch.compile'd (CUDA graphs), with the seconds of each.
- LoRA step and 4-bit QLoRA step: `grpo-run debug=smoke` with LoRA, and with model.quantization=4bit on the
  embedded SmolLM2-135M (needs bitsandbytes).
- QLoRA export: the model/ the QLoRA run ends with (adapters merged into the dequantized NF4 base) loads in
  transformers with no quantization left and scores a fixed text as the 4-bit trainer does, within 0.1 (bf16).
- rollout=vllm: a 2-step run with the sync probe after every push (needs the vllm extra).
- DDP and FSDP over NCCL: `grpo-run debug=smoke distributed=ddp|fsdp` on every GPU present.
- packed rows on flash-attention (train.pack_sequences): the microbatch is one row, the packing probe passes on
  flash-attention's variable-length path (packed against separate log-probs, bf16), and the training forward +
  backward of a long-tailed batch packed against padded, in seconds (needs the flash_attn package).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Row:
    check: str
    result: str  # ok | FAILED | skipped
    seconds: float | None = None
    peak_mb: str = "n/a"
    detail: str = ""


def cuda() -> bool:
    return torch.cuda.is_available()


def _peak_mb() -> str:
    return f"{torch.cuda.max_memory_allocated() / 2**20:.0f}" if cuda() else "n/a"


def _reset_peak() -> None:
    if cuda():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _device() -> torch.device:
    return torch.device("cuda" if cuda() else "cpu")


def check_master_weights_and_autocast() -> Row:
    from grpo_cli.models import TINY_RANDOM, load_policy
    from grpo_cli.models.runtime import autocast_factory, compute_dtype, resolve_dtype

    if not cuda():
        reason = "checks the GPU; tests/unit/models/test_mixed_precision.py covers bf16 autocast on the CPU"
        return Row("fp32 master weights + bf16 autocast", "skipped", detail=reason)
    device = _device()
    phases = []
    _reset_peak()
    model, tokenizer = load_policy(TINY_RANDOM, device, resolve_dtype("auto", device))
    phases.append(f"load {_peak_mb()} MB")
    weights = {p.dtype for p in model.parameters()}
    autocast_dtype = compute_dtype(device, "auto")
    _reset_peak()
    model.train()
    ids = torch.randint(0, len(tokenizer), (4, 64), device=device)
    with autocast_factory(device, "auto")():
        logits = model(ids).logits
    loss = logits.float().logsumexp(-1).mean()
    loss.backward()
    torch.optim.AdamW(model.parameters(), lr=1e-5).step()
    phases.append(f"forward+backward+step {_peak_mb()} MB")
    ok = weights == {torch.float32} and autocast_dtype == torch.bfloat16 and logits.dtype == torch.bfloat16
    detail = f"weights {sorted(map(str, weights))}, autocast {autocast_dtype}, logits {logits.dtype}; " + ", ".join(
        phases
    )
    return Row("fp32 master weights + bf16 autocast", "ok" if ok else "FAILED", peak_mb=_peak_mb(), detail=detail)


def check_decode_against_generate() -> list[Row]:
    from transformers import GenerationConfig

    from grpo_cli.engines.decode import Decoder, left_pad
    from grpo_cli.engines.hf import cut_completion
    from grpo_cli.models import TINY_RANDOM, load_policy
    from grpo_cli.rollout import HFRolloutEngine, SamplingSettings

    device = _device()
    model, tokenizer = load_policy(TINY_RANDOM, device, torch.float32)
    prompts = [tokenizer(text)["input_ids"] for text in ("Hello there", "The capital of France is", "1 + 1 =")]
    settings = SamplingSettings(n=1, temperature=0.0, max_tokens=24)
    input_ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    eos = {tokenizer.eos_token_id}
    with torch.no_grad():
        reference = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=mask.to(device),
            generation_config=GenerationConfig(
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            ),
        )
    expected = [cut_completion(ids, eos, (), tokenizer)[0] for ids in reference[:, input_ids.shape[1] :].tolist()]
    rows = []
    for label, setting in (("eager", "never"), ("compiled", "always")):
        check = f"decode loop ({label}) vs generate"
        if label == "compiled" and not cuda():
            rows.append(Row(check, "skipped", detail="needs CUDA (compiling on a CPU takes minutes and is not used)"))
            continue
        engine = HFRolloutEngine(model, tokenizer, compile=setting)
        if not isinstance(engine.decoder, Decoder):
            rows.append(Row(check, "skipped", detail="the decode loop does not run here (generate() fallback)"))
            continue
        _reset_peak()
        started = time.perf_counter()
        got = engine.generate(prompts, settings).completion_ids
        got = engine.generate(prompts, settings).completion_ids  # the second call: compiled, warm
        seconds = time.perf_counter() - started
        if engine.loop_problem is not None:  # the engine's own check against generate() failed: it fell back
            rows.append(Row(check, "FAILED", seconds, _peak_mb(), f"{engine.loop_problem}; generate() fallback"))
            continue
        fell_back = label == "compiled" and not engine.decoder.compile
        result = "ok" if got == expected and not fell_back else "FAILED"
        detail = "greedy tokens equal generate()'s" if got == expected else f"differs: {got} vs {expected}"
        if fell_back:
            detail += "; torch.compile failed, decoded eagerly"
        rows.append(Row(check, result, seconds, _peak_mb(), detail))
    return rows


def _long_tailed_batch(device: torch.device) -> dict[str, torch.Tensor]:
    """2 prompts of 60 tokens x 4 completions of 16 to 512 tokens, random ids: a long-tailed microbatch."""
    from grpo_cli.core import tokenize_prompt_and_output_ids

    generator = torch.Generator().manual_seed(0)
    lengths = [36, 19, 52, 22, 16, 27, 512, 94]
    prompts = [torch.randint(100, 20000, (60,), generator=generator).tolist() for _ in range(2)]
    completions = [torch.randint(100, 20000, (n,), generator=generator).tolist() for n in lengths]
    batch = tokenize_prompt_and_output_ids([prompts[i // 4] for i in range(8)], completions, pad_token_id=0)
    return {k: v.to(device) for k, v in batch.items()}


def check_packed_rows_on_flash_attention() -> Row:
    check = "packed rows on flash-attention (varlen)"
    if not cuda() or importlib.util.find_spec("flash_attn") is None:
        reason = "needs CUDA and flash_attn; tests/unit/core/test_packing.py checks the one-row decision on the CPU"
        return Row(check, "skipped", detail=reason)
    from grpo_cli.core import response_log_probs
    from grpo_cli.core.packing import packed_row_tokens, packing_problem, sequence_lengths
    from grpo_cli.models import load_policy

    device = _device()
    model, _ = load_policy(
        "embedded:smollm2-135m-instruct", device, torch.bfloat16, attn_implementation="flash_attention_2"
    )

    def score(input_ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, packed: bool) -> torch.Tensor:
        return response_log_probs(model, input_ids, labels, mask, pack_sequences=packed)["log_probs"][mask]

    problem = packing_problem(model, score)
    batch = _long_tailed_batch(device)
    mask = batch["response_mask"].bool()
    one_row = packed_row_tokens(model, sequence_lengths(mask)) is None
    seconds = {}
    model.train()
    _reset_peak()
    for _ in range(2):  # the second round is timed
        for packed in (False, True):
            torch.cuda.synchronize()
            started = time.perf_counter()
            out = response_log_probs(model, batch["input_ids"], batch["labels"], mask, pack_sequences=packed)
            out["log_probs"][mask].sum().backward()
            torch.cuda.synchronize()
            seconds["packed" if packed else "padded"] = time.perf_counter() - started
            model.zero_grad(set_to_none=True)
    ok = problem is None and one_row
    detail = (
        f"probe: {problem or 'passed'}; one row: {one_row}; forward+backward padded {seconds['padded']:.3f} s, "
        f"packed {seconds['packed']:.3f} s"
    )
    return Row(check, "ok" if ok else "FAILED", peak_mb=_peak_mb(), detail=detail)


def check_prompt_tree_on_cuda() -> Row:
    check = "prompt tree on CUDA sdpa (4D mask)"
    if not cuda():
        reason = "needs CUDA; tests/unit/core/test_prompt_tree.py checks the tree on the CPU"
        return Row(check, "skipped", detail=reason)
    from grpo_cli.core import response_log_probs
    from grpo_cli.core.prompt_tree import prompt_tree_problem
    from grpo_cli.models import load_policy

    device = _device()
    model, _ = load_policy("embedded:smollm2-135m-instruct", device, torch.float32, attn_implementation="sdpa")

    def score(input_ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, layout: str) -> torch.Tensor:
        shared, tree = layout != "plain", layout == "tree"
        return response_log_probs(model, input_ids, labels, mask, share_prompts=shared, prompt_tree=tree)["log_probs"][
            mask
        ]

    problem = prompt_tree_problem(model, score)
    batch = _long_tailed_batch(device)  # under bf16 autocast below, as a run trains
    mask = batch["response_mask"].bool()
    seconds, values = {}, {}
    model.train()
    _reset_peak()
    for _ in range(2):  # the second round is timed
        for tree in (False, True):
            torch.cuda.synchronize()
            started = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = response_log_probs(
                    model, batch["input_ids"], batch["labels"], mask, share_prompts=True, prompt_tree=tree
                )
            out["log_probs"][mask].sum().backward()
            torch.cuda.synchronize()
            seconds[tree], values[tree] = time.perf_counter() - started, out["log_probs"][mask].detach().float()
            model.zero_grad(set_to_none=True)
    difference = float((values[True] - values[False]).abs().max())
    detail = (
        f"probe (fp32): {problem or 'passed'}; bf16 tree vs two-pass log-probs {difference:.2g}; forward+backward "
        f"two-pass {seconds[False]:.3f} s, tree {seconds[True]:.3f} s"
    )
    return Row(check, "ok" if problem is None else "FAILED", peak_mb=_peak_mb(), detail=detail)


def _grpo_run(check: str, args: list[str], needs: Callable[[], str | None], workdir: Path) -> Row:
    """One `grpo-run` end to end in its own process; its last line is the detail."""
    reason = needs()
    if reason is not None:
        return Row(check, "skipped", detail=reason)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}
    run_dir = workdir / check.replace(" ", "_").replace("/", "_")
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "grpo_cli.cli", *args, f"hydra.run.dir={run_dir}"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    seconds = time.perf_counter() - started
    last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or [""]
    if done.returncode != 0:
        return Row(check, "FAILED", seconds, detail=last[0][:200])
    tail = done.stdout.strip().splitlines()[-1:] or [""]
    return Row(check, "ok", seconds, "see run dir", f"{tail[0][:160]} ({run_dir})")


# The merged export of a QLoRA run against the run's own 4-bit model: the largest log-prob difference on a fixed
# text. Both compute in bf16; merging adds the adapters' delta to the dequantized NF4 weight once, where the
# trainer adds B @ A's output to the 4-bit layer's at every forward: a reordering of bf16 sums (the vLLM sync
# probe's bf16 bound is 0.5).
QLORA_EXPORT_TOLERANCE = 0.1


def check_qlora_export(run_dir: Path, qlora: Row) -> Row:
    """The model/ a QLoRA run ends with (the adapters merged into the dequantized NF4 base: the embedded base has
    no hub id for an adapter to name) loads with transformers, with no quantization left, and scores a fixed text as
    the trainer's 4-bit model with its adapters does, within QLORA_EXPORT_TOLERANCE."""
    check = "QLoRA export: merged model/ vs the 4-bit trainer"
    if qlora.result != "ok":
        return Row(check, "skipped", detail=f"needs the 4-bit QLoRA step row ({qlora.result}: {qlora.detail[:80]})")
    from transformers import AutoModelForCausalLM

    from grpo_cli.core import response_log_probs, tokenize_prompt_and_output_ids
    from grpo_cli.export import find_checkpoint, trained_policy

    started = time.perf_counter()
    _reset_peak()
    trainer, tokenizer = trained_policy(find_checkpoint(run_dir))
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "model", dtype=torch.bfloat16).to("cuda")
    if getattr(exported.config, "quantization_config", None) is not None:
        return Row(check, "FAILED", detail="model/config.json still names a quantization_config")
    prompt = tokenizer("Name three colours of the rainbow.")["input_ids"]
    response = tokenizer(" Red, orange and yellow.")["input_ids"]
    batch = tokenize_prompt_and_output_ids([prompt], [response], tokenizer.pad_token_id)
    mask = batch["response_mask"].bool()
    scores = []
    for model in (trainer, exported):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            out = response_log_probs(
                model, batch["input_ids"].cuda(), batch["labels"].cuda(), batch["response_mask"].cuda()
            )
        scores.append(out["log_probs"][mask.cuda()].float().cpu())
    diff = (scores[0] - scores[1]).abs().max().item()
    result = "ok" if diff < QLORA_EXPORT_TOLERANCE else "FAILED"
    detail = f"max |log-prob diff| {diff:.4f} (bound {QLORA_EXPORT_TOLERANCE}); {run_dir / 'model'}"
    return Row(check, result, time.perf_counter() - started, _peak_mb(), detail)


def _needs_cuda(*modules: str, gpus: int = 1, on_cpu: str = "needs CUDA") -> Callable[[], str | None]:
    def reason() -> str | None:
        if not cuda():
            return on_cpu
        if torch.cuda.device_count() < gpus:
            return f"needs {gpus} GPUs, {torch.cuda.device_count()} present"
        for module in modules:
            if importlib.util.find_spec(module) is None:
                return f"needs the {module} package"
        return None

    return reason


def run_checks(workdir: Path) -> list[Row]:
    rows: list[Row] = []
    for check in (
        check_master_weights_and_autocast,
        check_decode_against_generate,
        check_packed_rows_on_flash_attention,
        check_prompt_tree_on_cuda,
    ):
        started = time.perf_counter()
        try:
            out = check()
        except Exception as error:  # noqa: BLE001 - a failing check is a row of the table, not the end of it
            out = Row(check.__name__, "FAILED", detail=f"{type(error).__name__}: {str(error)[:200]}")
        for row in out if isinstance(out, list) else [out]:
            if row.seconds is None and row.result != "skipped":
                row.seconds = time.perf_counter() - started
            rows.append(row)
    gpus = torch.cuda.device_count() if cuda() else 0
    smoke = ["debug=smoke"]
    lora_on_cpu = "checks the GPU; on the CPU tests/unit/learner/test_lora.py runs LoRA steps"
    rows.append(_grpo_run("LoRA step", [*smoke, "model.lora.enabled=true"], _needs_cuda(on_cpu=lora_on_cpu), workdir))
    qlora = _grpo_run(
        "4-bit QLoRA step",
        [
            *smoke,
            "model.name_or_path=embedded:smollm2-135m-instruct",
            "model.quantization=4bit",
            "model.lora.enabled=true",
        ],
        _needs_cuda("bitsandbytes"),
        workdir,
    )
    rows.append(qlora)
    rows.append(check_qlora_export(workdir / "4-bit_QLoRA_step", qlora))
    rows.append(
        _grpo_run(
            "rollout=vllm, 2 steps, probe every push",
            [*smoke, "rollout=vllm", "rollout.sync_probe_every=1"],
            _needs_cuda("vllm"),
            workdir,
        )
    )
    for strategy in ("ddp", "fsdp"):
        rows.append(
            _grpo_run(
                f"{strategy.upper()} over NCCL ({max(gpus, 1)} GPUs)",
                [*smoke, f"distributed={strategy}", f"distributed.nproc_per_node={max(gpus, 1)}"],
                _needs_cuda(),
                workdir,
            )
        )
    return rows


def table(rows: list[Row], device: str) -> str:
    lines = [
        f"device: {device}; torch {torch.__version__}",
        "",
        "| check | result | seconds | peak GPU MB | detail |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        seconds = f"{row.seconds:.1f}" if row.seconds is not None else ""
        lines.append(f"| {row.check} | {row.result} | {seconds} | {row.peak_mb} | {row.detail.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.md"), help="where the table is written")
    parser.add_argument("--workdir", type=Path, default=None, help="run directories of the grpo-run rows")
    args = parser.parse_args()
    workdir = args.workdir or Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu_check_{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0) if cuda() else "CPU (no CUDA: the CUDA-only rows are skipped)"
    text = table(run_checks(workdir), device)
    print(text)
    args.out.write_text(text)
    return 1 if "| FAILED |" in text else 0


if __name__ == "__main__":
    sys.exit(main())
