"""Config said once (issue #13): choices declared next to their field, one schema per task and per rollout
engine, the batch shape and the off-policy decision in one place, resume under the saved run's schemas."""

from __future__ import annotations

import dataclasses
import inspect
import sys

import pytest
import yaml
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from grpo_cli import config
from grpo_cli.cli import precheck_overrides
from grpo_cli.config import (
    DISAGGREGATED,
    ROLLOUT_SCHEMAS,
    TASK_SCHEMAS,
    BatchShape,
    GRPOConfig,
    HFRolloutConfig,
    VLLMRolloutConfig,
    allowed_values,
    choice_fields,
    load_saved_config,
    needs_old_log_probs,
    register_configs,
    rollout_config_for,
    unknown_key_hint,
    validate_config,
)
from grpo_cli.config.resume import resumed_config
from grpo_cli.core import KL_ESTIMATORS, LENGTH_NORMALIZATIONS, POLICY_GRADIENT_LOSS_TYPES
from grpo_cli.errors import UserFacingError
from grpo_cli.tasks import TASKS
from grpo_cli.tasks import schema as tasks_schema
from tests.conftest import REPO_ROOT, compose_config

CONF = REPO_ROOT / "grpo_cli" / "conf"


def compose_raw(overrides: list[str], output_dir: str = "/tmp/grpo-cli-test"):
    """The composed DictConfig (what config.yaml saves), not the dataclass."""
    register_configs()
    with initialize_config_module(config_module="grpo_cli.conf", version_base="1.3"):
        return compose(config_name="config", overrides=[*overrides, f"output_dir={output_dir}"])


# ---------------------------------------------------------------------------------------------------------
# Choices


def test_choice_walk_covers_every_choice_field():
    # Every schema module: the group schemas and every task's own module (its schema sits beside the task).
    modules = [
        config.schemas,
        config.rollout_schemas,
        tasks_schema,
        *(sys.modules[schema.__module__] for schema in TASK_SCHEMAS.values()),
    ]
    declared = {
        (cls.__name__, f.name)
        for module in modules
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if dataclasses.is_dataclass(cls) and cls.__module__ == module.__name__
        for f in dataclasses.fields(cls)
        if "choices" in f.metadata
    }
    assert ("LossConfig", "type") in declared and ("TaskConfig", "prompt") in declared
    fields = choice_fields()
    walked = {name.rpartition(".")[2] for name in fields}
    assert {name for _, name in declared} <= walked
    # the user contract: these keys stay choice keys
    assert {
        "model.dtype",
        "model.device",
        "model.mixed_precision",
        "model.quantization",
        "task.prompt",
        "loss.type",
        "normalization.advantage",
        "normalization.length",
        "kl.estimator",
        "sync.strategy",
        "rollout.engine",
        "logger.backend",
        "logger.mode",
        "job.name",
    } <= set(fields)
    # one list each: the core's tuples, the engine registry, the sync strategies
    assert fields["loss.type"] == POLICY_GRADIENT_LOSS_TYPES
    assert fields["normalization.length"] == LENGTH_NORMALIZATIONS
    assert fields["kl.estimator"] == KL_ESTIMATORS
    assert allowed_values("rollout.engine") == tuple(ROLLOUT_SCHEMAS) == ("hf", "vllm")
    assert allowed_values("sync.strategy") == ("on_policy", "multi_epoch", *DISAGGREGATED)
    assert DISAGGREGATED == ("one_behind", "replay_buffer", "async")
    with pytest.raises(KeyError):
        allowed_values("optim.lr")


def task_choice_for(key: str) -> list[str]:
    """A key only one task's schema has (task.on_reward_error: task=custom) is composed with that task; a key only
    one engine's schema has (rollout.openai_server: rollout=vllm) with that engine."""
    if key.startswith("rollout."):
        first = key.split(".")[1]
        owners = [
            name for name, schema in ROLLOUT_SCHEMAS.items() if first in {f.name for f in dataclasses.fields(schema)}
        ]
        return [] if "hf" in owners else [f"rollout={owners[0]}"]
    if not key.startswith("task."):
        return []
    first = key.split(".")[1]
    owners = [name for name, schema in TASK_SCHEMAS.items() if first in {f.name for f in dataclasses.fields(schema)}]
    return [] if "keyword" in owners else [f"task={owners[0]}"]


def is_list_of_choices(key: str) -> bool:
    """Whether `key` holds a list of choices (job.engines, job.precisions): its overrides are lists, and an
    error names the item."""
    value = compose_config(task_choice_for(key))
    for part in key.split("."):
        value = getattr(value, part)
    return isinstance(value, list)


@pytest.mark.parametrize("key", sorted(choice_fields()))
def test_an_unknown_choice_value_fails_in_one_line(key):
    listed = is_list_of_choices(key)  # a list of choices: the item is named
    cfg = compose_config([*task_choice_for(key), f"{key}=[bogus]" if listed else f"{key}=bogus"])
    with pytest.raises(UserFacingError) as info:
        validate_config(cfg)
    value = "['bogus'] holds bogus, which" if listed else "bogus"
    assert str(info.value) == f"{key}={value} is not one of {', '.join(allowed_values(key))}"


@pytest.mark.parametrize(("key", "value"), [(k, v) for k, values in choice_fields().items() for v in values])
def test_every_allowed_value_passes_the_choice_check(key, value):
    group_choice = {"rollout.engine": f"rollout={value}"}.get(key)  # an engine comes with its schema
    override = group_choice or (f"{key}=[{value}]" if is_list_of_choices(key) else f"{key}={value}")
    cfg = compose_config([*task_choice_for(key), override])
    try:
        validate_config(cfg)
    except UserFacingError as e:  # other rules may object (4bit without LoRA); the choice check may not
        assert "is not one of" not in str(e)


# ---------------------------------------------------------------------------------------------------------
# Per-task and per-engine schemas


def test_every_task_has_a_schema_holding_the_keys_it_reads_and_a_yaml_extending_it():
    for name, spec in TASKS.items():
        schema = TASK_SCHEMAS[name]
        keys = {f.name for f in dataclasses.fields(schema)}
        assert {*spec.options, *spec.reward_options} <= keys, name
        yaml_text = (CONF / "task" / f"{name}.yaml").read_text()
        assert f"- {name}_schema" in yaml_text, name
        cfg = compose_config([f"task={name}"])
        assert type(cfg.task) is schema and cfg.task.name == name


@pytest.mark.parametrize("task", sorted(TASK_SCHEMAS))
def test_a_key_of_another_task_fails_naming_this_tasks_keys(task):
    with pytest.raises(Exception) as info:  # noqa: PT011 - Hydra wraps OmegaConf's error
        compose_raw([f"task={task}", "task.no_such_key=3"])
    hint = unknown_key_hint(info.value)
    keys = [f.name for f in dataclasses.fields(TASK_SCHEMAS[task])]
    assert hint == f"task={task} has the keys {', '.join(keys)}"


def test_rollout_hf_with_a_vllm_key_fails_in_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        precheck_overrides(["rollout=hf", "rollout.gpu_memory_utilization=0.5"])
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "gpu_memory_utilization is a key of rollout=vllm" in line and "rollout=hf has the keys engine" in line
    cfg = compose_config(["rollout=vllm", "rollout.gpu_memory_utilization=0.5"])
    assert type(cfg.rollout) is VLLMRolloutConfig and cfg.rollout.gpu_memory_utilization == 0.5


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+task.min_words=3"], "task.min_words is not a key: task=keyword has the keys"),
        (["task.name=no_such_task"], "task.name=no_such_task is not one of keyword"),
        (["task=keyword", "task.name=math"], "task.name=math reads task.hub_dataset"),
        (["rollout.engine=vllm"], "rollout.engine=vllm with rollout=hf"),
    ],
)
def test_a_task_or_engine_that_does_not_match_its_schema_fails(overrides, message):
    with pytest.raises(UserFacingError, match=message) as info:
        validate_config(compose_config(overrides))
    assert "\n" not in str(info.value)


def test_multirun_with_cfg_fails_in_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        precheck_overrides(["-m", "optim.lr=1e-5,2e-5", "--cfg", "job"])
    assert info.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_existing_command_lines_keep_working():
    cfg = compose_config(["task=math", "task.eval_path=x.jsonl"])
    assert (cfg.task.eval_path, cfg.task.prompt, cfg.task.hub_dataset) == ("x.jsonl", "r1_zero", "hiyouga/math12k")
    cfg = compose_config(["task.keywords_per_prompt=3", "task.reward_weights.format=0.1", "rollout.stop=[x]"])
    assert (cfg.task.keywords_per_prompt, cfg.task.reward_weights.format, cfg.rollout.stop) == (3, 0.1, ["x"])
    cfg = compose_config(["task=gsm8k", "task.numeric_tolerance=0.05", "debug=smoke", "job=benchmark"])
    assert (cfg.task.numeric_tolerance, cfg.task.hub_config, cfg.task.n_train) == (0.05, "main", 16)
    validate_config(cfg)


def test_group_choices_keep_their_values():
    vllm = compose_config(["rollout=vllm"]).rollout
    sampling_keys = {
        key: value for key, value in dataclasses.asdict(HFRolloutConfig()).items() if key not in ("compile", "decoder")
    }
    assert dataclasses.asdict(vllm) == {
        **sampling_keys,
        "engine": "vllm",
        "sync_probe_every": 10,
        "gpu_memory_utilization": 0.4,
        "kv_cache_memory_gb": None,
        "max_model_len": None,
        "tensor_parallel_size": 1,
        "enable_sleep_mode": False,
        "enforce_eager": True,
        "sync_tolerance": None,
        "sync_probe": True,
        "sync_timeout_s": 300.0,
        "vllm_kwargs": {},
        "openai_server": "grpo_cli",
        "openai_server_args": [],
    }
    math = compose_config(["task=math"]).task
    assert (math.prompt, math.n_train, math.n_eval, math.hub_config, math.hub_eval_split) == (
        "r1_zero",
        None,
        None,
        None,
        "test",
    )
    assert compose_config(["sync=replay_buffer"]).sync.buffer_size == 64
    assert compose_config(["sync=multi_epoch"]).sync.epochs_per_rollout_batch == 2
    assert compose_config(["normalization=dr_grpo"]).normalization.advantage_eps == 1e-6
    assert compose_config(["logger=wandb"]).logger.project == "grpo-cli"


def test_rollout_config_for_keeps_the_sampling_keys():
    hf = compose_config(["rollout.max_tokens=12", "rollout.temperature=0.7"]).rollout
    vllm = rollout_config_for(hf, "vllm")
    assert type(vllm) is VLLMRolloutConfig and (vllm.engine, vllm.max_tokens, vllm.temperature) == ("vllm", 12, 0.7)
    assert vllm.gpu_memory_utilization == 0.4
    back = rollout_config_for(vllm, "hf")
    assert type(back) is HFRolloutConfig and back == hf


# ---------------------------------------------------------------------------------------------------------
# BatchShape and the old log-probs


@pytest.mark.parametrize(
    ("sync", "off_policy"),
    [("on_policy", False), ("multi_epoch", True), ("one_behind", True), ("replay_buffer", True)],
)
def test_batch_shape_knows_when_updates_are_off_policy(sync, off_policy):
    cfg = compose_config([f"sync={sync}", "loss=grpo_clip"])
    validate_config(cfg)
    shape = BatchShape.from_config(cfg)
    assert shape.sync_strategy == sync and shape.off_policy is off_policy
    assert shape.optimizer_steps_per_rollout_batch == (2 if sync == "multi_epoch" else 1)


def test_on_policy_with_several_steps_per_batch_is_off_policy():
    cfg = compose_config(["train.train_batch_size=8", "train.gradient_accumulation_steps=1"])
    assert BatchShape.from_config(cfg).off_policy


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["loss=grpo_clip"], False),  # one on-policy step: the ratio is 1
        (["loss=grpo_clip", "sync=multi_epoch"], True),
        (["loss=grpo_clip", "sync=one_behind"], True),
        (["loss=grpo_clip", "sync=replay_buffer"], True),
        (["sync=one_behind"], False),  # reinforce_with_baseline does not use them
        (["sync.old_log_probs=true"], True),
        (["loss=grpo_clip", "sync=multi_epoch", "sync.old_log_probs=false"], False),
    ],
)
def test_needs_old_log_probs(overrides, expected):
    assert needs_old_log_probs(compose_config(overrides)) is expected


def test_validate_sync_uses_the_batch_shape():
    with pytest.raises(UserFacingError, match="needs the old policy's log-probs"):
        validate_config(compose_config(["loss=grpo_clip", "sync=one_behind", "sync.old_log_probs=false"]))


# ---------------------------------------------------------------------------------------------------------
# Resume: a saved config.yaml merges under that run's schemas


def saved_run(tmp_path, overrides: list[str], edit=None):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_000001").mkdir(parents=True)
    saved = OmegaConf.to_container(compose_raw(overrides, output_dir=str(run_dir)), resolve=True)
    if edit:
        edit(saved)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    return run_dir


@pytest.mark.parametrize(
    ("overrides", "task_schema", "rollout_schema"),
    [
        (["task=keyword", "task.keywords_per_prompt=3"], "KeywordTaskConfig", HFRolloutConfig),
        (["task=math", "rollout=vllm"], "MathTaskConfig", VLLMRolloutConfig),
    ],
)
def test_a_saved_config_resumes_under_its_task_and_rollout_schema(tmp_path, overrides, task_schema, rollout_schema):
    run_dir = saved_run(tmp_path, overrides)
    merged = resumed_config(str(run_dir), tmp_path / "new", ["train.steps=50"])
    cfg: GRPOConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    assert type(cfg.task).__name__ == task_schema and type(cfg.rollout) is rollout_schema
    assert (cfg.resume, cfg.output_dir, cfg.train.steps) == (True, str(run_dir), 50)
    validate_config(cfg)
    if task_schema == "KeywordTaskConfig":
        assert cfg.task.keywords_per_prompt == 3


def test_a_bad_key_in_a_saved_config_fails_in_one_line(tmp_path):
    run_dir = saved_run(tmp_path, ["task=keyword"], edit=lambda c: c["task"].update(bogus=1))
    with pytest.raises(UserFacingError) as info:
        resumed_config(str(run_dir), tmp_path / "new", [])
    message = str(info.value)
    assert "\n" not in message and "bogus" in message and "task=keyword has the keys" in message


def test_a_config_saved_before_the_task_schemas_still_resumes(tmp_path):
    def flat_schema(saved):  # every task's keys, and the vLLM keys under rollout=hf, as config.yaml had them
        saved["task"].update(hub_dataset=None, min_words=10, fields_per_prompt=3, numeric_tolerance=0.01)
        saved["rollout"].update(gpu_memory_utilization=0.4, vllm_kwargs={})

    run_dir = saved_run(tmp_path, ["task=keyword"], edit=flat_schema)
    cfg = OmegaConf.to_object(load_saved_config(run_dir / "config.yaml"))
    assert type(cfg.task).__name__ == "KeywordTaskConfig" and type(cfg.rollout) is HFRolloutConfig
    assert cfg.task.keywords_per_prompt == 2


def test_registering_again_keeps_each_stored_schema_and_a_replaced_schema_is_stored_anew(monkeypatch):
    from hydra.core.config_store import ConfigStore

    from grpo_cli.config.registry import register_configs
    from grpo_cli.config.task_registry import TASK_SCHEMAS

    register_configs()
    repo = ConfigStore.instance().repo
    held = repo["task"]["gsm8k_schema.yaml"]
    register_configs()  # the same schemas: nothing is built again
    assert repo["task"]["gsm8k_schema.yaml"] is held

    @dataclasses.dataclass
    class Wider(TASK_SCHEMAS["gsm8k"]):
        extra_key: int = 7

    monkeypatch.setitem(TASK_SCHEMAS, "gsm8k", Wider)  # a schema replaced under its name is stored again...
    assert compose_config(["task=gsm8k"]).task.extra_key == 7  # ...and composed from
    assert repo["task"]["gsm8k_schema.yaml"] is not held
    monkeypatch.undo()
    assert not hasattr(compose_config(["task=gsm8k"]).task, "extra_key")  # and the original back again
