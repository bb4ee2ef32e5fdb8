"""Shared fixtures: compose the real config tree, run the real entrypoint, never touch the network."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from grpo_cli import tasks
from grpo_cli.config import GRPOConfig, register_configs
from grpo_cli.config.task_registry import TASK_SCHEMAS
from grpo_cli.episodes import config as _episode_check  # noqa: F401 - registers the multi-turn check, as the cli
from grpo_cli.tasks import Example, TaskConfig, TaskSpec
from grpo_cli.tracking import read_metrics
from tests.ray_processes import RUN_TAG, assert_no_ray_left, kill_run_processes

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


@pytest.fixture(scope="session")
def one_process_rows(tmp_path_factory) -> list[dict]:
    """The training steps' metrics of `grpo-run <SETTING>` (tests/unit/distributed/test_distributed.py) in one
    process, which DDP and FSDP ranks and two nodes must each reproduce: trained once for all the tests that compare
    with it (all hold the "ports" resource, so they run on one worker)."""
    from tests.e2e.test_distributed_e2e import run_setting

    return run_setting(tmp_path_factory.mktemp("one_process"), "single", [])


# The FSDP run of the same setting, checkpointing at step 2 and 3: trained once for the comparison with one
# process and for the resume from its step-2 checkpoint.
FSDP_CHECKPOINTS = ["distributed=fsdp", "train.checkpoint_every=2", "train.keep_checkpoints=2"]


@pytest.fixture(scope="session")
def fsdp_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """`grpo-run <SETTING> <FSDP_CHECKPOINTS>` on two ranks: its run directory (a test copies it before changing
    it) and its training steps' metrics (its tests hold the "ports" resource, so they run on one worker)."""
    from tests.e2e.test_distributed_e2e import run_setting
    from tests.unit.distributed.test_distributed import free_port

    folder = tmp_path_factory.mktemp("fsdp_run")
    rows = run_setting(folder, "fsdp", [*FSDP_CHECKPOINTS, f"distributed.master_port={free_port()}"])
    return folder / "fsdp", rows


# Ray processes: the tests of the Ray strategies check that a run leaves none behind, however it ends, looking only
# at the processes of the test's own run (tests/ray_processes.py), so that other Ray work on the machine cannot fail
# them.
@pytest.fixture
def ray_installed(monkeypatch) -> Iterator[str]:
    """Ray for one test: a Ray temp dir of its own (RAY_TMPDIR) and the tag every process it starts inherits; after
    the test, no process of its run may be left (and any that is, is killed, so a failure leaks nothing)."""
    pytest.importorskip("ray")
    # Short, under /tmp: Ray's sockets live below it and a Unix socket's path is limited to 107 bytes.
    tag = tempfile.mkdtemp(prefix="grpo-ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
    monkeypatch.setenv("RAY_TMPDIR", tag)
    monkeypatch.setenv(RUN_TAG, tag)
    try:
        yield tag
        assert_no_ray_left(tag)
    finally:
        kill_run_processes(tag)
        shutil.rmtree(tag, ignore_errors=True)


# --- Parallel workers -------------------------------------------------------------------------------------------
# The README's test command runs the suite on pytest-xdist workers (`-n 2 --dist loadgroup`); plain `pytest` (the
# other CI venvs, a developer's single file) runs it in one process, where none of this changes anything.
#
# `--dist loadgroup` sends each test to whichever worker is free, except the tests of one xdist group, which one
# worker runs one after another. Two kinds of group:
# - a resource of the whole machine, which two tests must not hold at once: "ray" (a Ray run sizes its actors to
#   the machine's cores; each test's no-Ray-left check sees only its own run), "vllm" (an engine's CPU threads and
#   memory) and "ports" (torch.distributed ranks: the default rendezvous port, or a free_port() checked, then
#   used). A test joins one through the `ray_installed` fixture, the `vllm` marker or `machine_wide(resource)`
#   (default "ports").
# - the test module's own node id, for the tests that use a module-scoped fixture (a trained run, a started
#   engine): one worker builds it once, as a plain run does, instead of each worker building its own.
# A test marked `alone` asserts a wall-clock bound: no other test runs while it does (OneAtATime below), so the
# bound holds whatever the other worker is doing.
# The tests of the three machine-wide groups are the integration tests (Ray, vLLM, several ranks): each is also
# marked `integration`, which the README's test command leaves out (`-m "not integration"`) and `.ci/run` then
# runs on its own (`-m integration`); a developer runs them with the same `-m integration`.
MACHINE_WIDE = ("ray", "vllm", "ports")
# vLLM's tests and the ranks' share one xdist group: under `-m integration` that leaves two groups, Ray's and this
# one, one per worker. As three, xdist (which gives a worker its next group when its current one is nearly done,
# largest groups first) would hand the third to whichever worker finished first: one would run two groups while
# the other idled.
XDIST_GROUP = {"vllm": "vllm_and_ports", "ports": "vllm_and_ports"}
# Tests marked here by node id, not at the test: the files other work was changing at the time (issue #49).
ALONE = (
    "tests/unit/endpoint/test_agent_endpoint.py::"
    "test_the_endpoint_refuses_in_openais_shape_and_a_crashing_agent_is_the_episodes_error",  # took < 30 s
    "tests/unit/sandbox/test_sandbox_escape.py::test_a_fork_bomb_is_bounded_and_ends_with_the_call",  # < limit + 10 s
)


def xdist_group_of(item: pytest.Item) -> str | None:
    """The xdist group `item` joins (see above), or None: it runs wherever a worker is free."""
    fixtures = getattr(item, "fixturenames", ())
    if "ray_installed" in fixtures:
        return "ray"
    if any(item.iter_markers("vllm")):
        return "vllm"
    if marker := item.get_closest_marker("machine_wide"):
        return marker.args[0] if marker.args else "ports"
    info = getattr(item, "_fixtureinfo", None)  # pytest's own record of the fixtures each test uses
    for name in fixtures:
        for definition in info.name2fixturedefs.get(name, ()) if info else ():
            if definition.scope in ("module", "class", "package"):
                return item.nodeid.split("::")[0]
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups to schedule them
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.split("[")[0] in ALONE:
            item.add_marker(pytest.mark.alone)
        if not any(item.iter_markers("xdist_group")) and (group := xdist_group_of(item)):
            item.add_marker(pytest.mark.xdist_group(XDIST_GROUP.get(group, group)))
            if group in MACHINE_WIDE:  # read by `-m`, whose deselection runs after this hook
                item.add_marker(pytest.mark.integration)
        if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
            keep_group_in_node_id(item)


def keep_group_in_node_id(item: pytest.Item) -> None:
    """What --dist loadgroup guarantees: the tests whose node ids end in the same `@<group>` run on one worker,
    one after another (its scheduler reads the group from that suffix, and nothing else). pytest-xdist 3.8 adds
    the suffix by setting `item._nodeid`, which pytest 9.2 (what `pytest>=8` installs on a clean machine; 9.0.3
    still read it) no longer reads: its node id is `str(item._id)`, a NodeId. There every group was lost without a
    word, and each test went to whichever worker was free. Where pytest keeps the id in `_id`, the suffix is added
    here, as xdist would (its group names, sorted, joined by "_"); where it keeps `_nodeid`, xdist's own hook adds
    it after this one."""
    names = sorted(
        {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
    )
    node_id = getattr(item, "_id", None)
    if not names or node_id is None or hasattr(item, "_nodeid"):
        return
    item._id = type(node_id).parse(f"{item.nodeid}@{'_'.join(names)}")


def pytest_configure(config: pytest.Config) -> None:
    workerinput = getattr(config, "workerinput", None)  # set on an xdist worker only
    if workerinput is None:
        return
    # Each worker takes its share of the cores, and so do the processes it starts (grpo-run, ranks, reward
    # workers): two workers each running torch on every core would spend the cores' time switching between them.
    threads = max(1, (os.cpu_count() or 1) // workerinput["workercount"])
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    config.pluginmanager.register(OneAtATime(workerinput["testrunuid"]), "grpo-cli-one-at-a-time")


class OneAtATime:
    """A readers-writer lock over this run's workers (two flock(2) files named by the run's id), held from a test's
    setup to its teardown (a module fixture built or torn down there runs then): every test holds it shared, a test
    marked `alone` alone. The gate gives the `alone` side priority: once one waits, no other test starts."""

    def __init__(self, run_id: str) -> None:
        prefix = Path(tempfile.gettempdir()) / f"grpo-cli-tests-{run_id}"
        self.paths = (Path(f"{prefix}.gate"), Path(f"{prefix}.running"))
        self.gate, self.running = (open(path, "a") for path in self.paths)  # noqa: SIM115 - held for the session

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
        alone = any(item.iter_markers("alone"))
        fcntl.flock(self.gate, fcntl.LOCK_EX)
        fcntl.flock(self.running, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(self.gate, fcntl.LOCK_UN)
        try:
            return (yield)
        finally:
            fcntl.flock(self.running, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(self.gate, fcntl.LOCK_UN)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        for handle, path in zip((self.gate, self.running), self.paths, strict=True):
            handle.close()
            path.unlink(missing_ok=True)  # a worker still running keeps its open handle: flock needs no name
