"""Shared fixtures: compose the real config tree, run the real entrypoint, never touch the network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from grpo_cli import tasks
from grpo_cli.config import GRPOConfig, register_configs
from grpo_cli.config.task_registry import TASK_SCHEMAS
from grpo_cli.tasks import Example, TaskConfig, TaskSpec
from grpo_cli.tracking import read_metrics

# The repository and the data files tests read, wherever a test module sits below tests/.
REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = REPO_ROOT / "tests" / "fixtures"

# A user's tool file (add, and tools that fail, exit, sleep, meet; broken ones for the load errors).
MY_TOOLS = FIXTURES / "my_tools.py"

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    for key, value in OFFLINE_ENV.items():
        monkeypatch.setenv(key, value)


def compose_config(overrides: list[str], output_dir: str = "/tmp/grpo-cli-test") -> GRPOConfig:
    """The config `grpo-run <overrides>` would run with, as the schema dataclass."""
    register_configs()
    with initialize_config_module(config_module="grpo_cli.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*overrides, f"output_dir={output_dir}"])
    return OmegaConf.to_object(cfg)


def run_grpo(args: list[str], cwd, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run the installed `grpo-run` entrypoint as a user would (same interpreter, offline)."""
    env = {**os.environ, **OFFLINE_ENV}
    exe = os.path.join(os.path.dirname(sys.executable), "grpo-run")
    command = [exe] if os.path.exists(exe) else [sys.executable, "-m", "grpo_cli.cli"]
    return subprocess.run([*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def train_to_the_end(args: list[str], cwd: Path, run_dir: Path, timeout: int = 600) -> list[dict]:
    """Run `grpo-run <args>` into `run_dir` as a user would; it must succeed. Returns its training steps' metrics
    (the metrics.jsonl lines with a train/loss)."""
    result = run_grpo([*args, f"hydra.run.dir={run_dir}"], cwd=cwd, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return [row for row in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in row]


def episodes_of(run_dir: Path, step: int) -> list[dict]:
    """The run's training episodes of `step` (episodes/step_NNNNN.jsonl), one dict each."""
    lines = (run_dir / "episodes" / f"step_{step:05d}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def starts_with_e(response: str, _truth) -> dict[str, float]:
    """A reward a random model can climb: does the response open with an 'e' (in its first 3 characters)?"""
    hit = float("e" in response[:3].lower())
    return {"reward": hit, "format_reward": 1.0, "answer_reward": hit}


def build_prompts(split, n, seed, prompt_style="chat"):
    return [
        Example(prompt=tasks.format_prompt(f"Say something #{i}", prompt_style), ground_truth=None)
        for i in range(n or 8)
    ]


def write_my_tools(folder: Path) -> Path:
    """MY_TOOLS written into `folder` as `my_tools.py`, where a user's task folder holds its tools; its path."""
    path = folder / "my_tools.py"
    path.write_text(MY_TOOLS.read_text(encoding="utf-8"), encoding="utf-8")
    return path


@pytest.fixture
def letter_e_task(monkeypatch):
    monkeypatch.setitem(tasks.TASKS, "letter_e", TaskSpec("letter_e", starts_with_e, build_prompts))
    # The config's task registry (config/task_registry.py) knows the tasks by name: task.name=letter_e validates.
    monkeypatch.setitem(TASK_SCHEMAS, "letter_e", TaskConfig)


class FakeDatasets:
    """Stands in for the `datasets` module (put in sys.modules): records each call, returns the rows like the hub's."""

    def __init__(self, rows):
        self.rows, self.calls = rows, []

    def load_dataset(self, path, name=None, split=None):
        self.calls.append((path, name, split))
        return iter(self.rows)


# A 2-layer causal LM small enough for exact comparisons; every architecture below shares it.
TINY_LM_CONFIG = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=64,
)


def random_weights(model, std: float = 0.5, seed: int | None = 0, only: str = ""):
    """`model` with each parameter (each whose name contains `only`, e.g. LoRA's "lora_B", which starts at zero)
    drawn from N(0, std) after seeding torch with `seed` (None: from torch's generator as it stands): large enough
    that the softmax is far from uniform and adapters matter. The model, for chaining."""
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if only in name:
                parameter.normal_(0, std)
    return model


def build_tiny_lm(model_class: str, config_class: str, std: float = 0.5, seed: int | None = 0, **config):
    """The tests' one tiny-model builder: transformers' `model_class` on `config_class(**config)` (TINY_LM_CONFIG,
    or keys built on it), its weights drawn by random_weights(std, seed), in fp32 and train mode."""
    import transformers

    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
    return random_weights(model, std, seed).float().train()


# The LM-head kinds the scorer supports: (transformers model class, config class, keys beyond TINY_LM_CONFIG).
HEAD_ARCHITECTURES = {
    "llama_tied": ("LlamaForCausalLM", "LlamaConfig", dict(tie_word_embeddings=True)),
    "llama_untied": ("LlamaForCausalLM", "LlamaConfig", dict(tie_word_embeddings=False)),
    "gemma2_softcap": (
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(final_logit_softcapping=0.5, query_pre_attn_scalar=16),
    ),
    "cohere_scale": ("CohereForCausalLM", "CohereConfig", dict(logit_scale=3.0)),
    "granite_scale": ("GraniteForCausalLM", "GraniteConfig", dict(logits_scaling=0.25)),
}


def tiny_head_lm(architecture: str):
    """A tiny random causal LM of each LM-head kind the scorer supports (tied or untied Llama, Gemma-2's
    soft-capping, Cohere's logit_scale, Granite's logits_scaling), in train mode, its weights drawn large enough
    that the softmax is far from uniform."""
    model_class, config_class, keys = HEAD_ARCHITECTURES[architecture]
    return build_tiny_lm(model_class, config_class, **TINY_LM_CONFIG, **keys)


# Ray processes: the tests of the Ray strategies check that a run leaves none behind, however it ends.
RAY_PROCESS_MARKERS = ("raylet", "gcs_server", "ray::", "default_worker.py", "ray/_private", "dashboard", "ray_reaper")


def ray_processes() -> set[int]:
    """Live (not zombie) processes of any Ray installation on this machine."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(marker in cmdline for marker in RAY_PROCESS_MARKERS):
            found.add(int(entry.name))
    return found


def assert_no_ray_left(before: set[int]) -> None:
    deadline = time.monotonic() + 20
    while (left := ray_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"Ray processes outlived the run: {sorted(left)}"


@pytest.fixture
def ray_installed():
    pytest.importorskip("ray")
    before = ray_processes()
    yield
    assert_no_ray_left(before)
