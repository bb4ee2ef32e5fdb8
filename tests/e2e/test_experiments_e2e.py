"""The grpo-run end-to-end half of tests/unit/config/test_experiments.py: grpo-run as a subprocess."""

from __future__ import annotations

import os
import textwrap

import pytest
import yaml

from tests.conftest import run_grpo
from tests.unit.config.test_experiments import EXPERIMENTS


def rollout_block(stdout: str) -> str:
    """The `rollout:` block of `--cfg job` output, as printed."""
    lines = stdout.splitlines()
    start = lines.index("rollout:")
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith(" "))
    return "\n".join(lines[start:end])


@pytest.mark.parametrize(
    ("args", "max_tokens"),
    [
        (["task=math"], 1024),
        (["task=math", "rollout.max_tokens=64"], 64),
        (["task=math", "rollout=vllm", "rollout.max_tokens=64"], 64),
    ],
)
def test_cfg_job_prints_the_tasks_max_tokens_as_a_literal(tmp_path, args, max_tokens):
    result = run_grpo([*args, "--cfg", "job"], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    block = rollout_block(result.stdout)
    assert f"\n  max_tokens: {max_tokens}\n" in block and "${" not in block
    assert yaml.safe_load(result.stdout)["rollout"]["min_tokens"] == 4


def test_cfg_job_shows_the_cs336_handouts_values(tmp_path):
    result = run_grpo(["experiment=cs336_math", "--cfg", "job"], cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["model"]["name_or_path"] == "Qwen/Qwen2.5-Math-1.5B"
    assert (printed["task"]["name"], printed["task"]["prompt"]) == ("math", "r1_zero")
    assert {key: printed["rollout"][key] for key in ("engine", "temperature", "min_tokens", "max_tokens")} == {
        "engine": "vllm",
        "temperature": 1.0,
        "min_tokens": 4,
        "max_tokens": 1024,
    }
    train = {
        "steps": 200,
        "rollout_batch_size": 256,
        "group_size": 8,
        "train_batch_size": 256,
        "gradient_accumulation_steps": 128,
        "max_grad_norm": 1.0,
        "eval_every": 10,
        "eval_examples": None,
    }
    assert {key: printed["train"][key] for key in train} == train
    assert printed["optim"] == {"lr": 1e-5, "weight_decay": 0.0, "betas": [0.9, 0.95]}
    assert (printed["loss"]["type"], printed["normalization"]["advantage"]) == ("reinforce_with_baseline", "std")
    assert "${" not in rollout_block(result.stdout)


# Imported first by the subprocess (sitecustomize): vLLM, bitsandbytes and TensorBoard look absent (a None entry
# in sys.modules makes `import` fail and find_spec answer None) and CUDA is hidden, as on a plain CPU machine.
BLOCK_EXTRAS = textwrap.dedent(
    """
    import sys

    for name in ("vllm", "bitsandbytes", "tensorboard", "torch.utils.tensorboard"):
        sys.modules[name] = None
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_check_reward_runs_for_every_experiment_without_gpu_extras(tmp_path, monkeypatch, name):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK_EXTRAS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = run_grpo([f"experiment={name}", "job=check_reward", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "cases agree with task=" in result.stdout
