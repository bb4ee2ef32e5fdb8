"""Tracking without a training run: the sink fan-out, W&B mode choice, run_info, sweep presets and names."""

import itertools
import json
import re
from importlib.util import find_spec

import pytest
from hydra import compose, initialize_config_module
from rich.console import Console

from grpo_cli.cli import sweep_group_name, sweep_subdir
from grpo_cli.config import register_configs, validate_config
from grpo_cli.tasks import Example
from grpo_cli.tracking import FanOutSink, JsonlMetricsSink, build_metrics_sink, read_metrics
from grpo_cli.tracking.run_info import examples_sha256, git_state, rerun_command, write_run_info
from grpo_cli.tracking.wandb_sink import choose_mode, has_wandb_credentials, sample_table_rows
from tests.conftest import REPO_ROOT, compose_config

SWEEP_DIR = REPO_ROOT / "grpo_cli" / "conf" / "sweep"
# The page of the sweeps' commands (the README, a front page, shows one and links it).
SWEEPS_PAGE = REPO_ROOT / "docs" / "sweeps.md"


class RecordingSink:
    def __init__(self, calls: list, fail_on_close: bool = False) -> None:
        self.calls, self.fail_on_close = calls, fail_on_close

    def log(self, metrics, step):
        self.calls.append(("log", step))

    def log_samples(self, rows, step):
        self.calls.append(("samples", step))

    def close(self):
        self.calls.append(("close", self))
        if self.fail_on_close:
            raise OSError("disk full")


def test_fan_out_feeds_every_sink_and_closes_all_even_when_one_fails():
    calls: list = []
    first, second = RecordingSink(calls, fail_on_close=True), RecordingSink(calls)
    sink = FanOutSink([first, second])
    sink.log({"train/reward": 1.0}, step=3)
    sink.log_samples([{"prompt": "p"}], step=3)
    with pytest.raises(OSError, match="disk full"):
        sink.close()
    assert calls == [("log", 3), ("log", 3), ("samples", 3), ("samples", 3), ("close", first), ("close", second)]


def test_jsonl_sink_writes_metrics_lines_and_eval_samples_per_step(tmp_path):
    sink = JsonlMetricsSink(tmp_path / "metrics.jsonl")
    sink.log({"eval/reward": 0.25}, step=10)
    sink.log_samples([{"prompt": "p", "response": "r", "reward": 1.0}], step=10)
    sink.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 10, "eval/reward": 0.25}]
    assert read_metrics(tmp_path / "eval" / "step_00010.jsonl") == [{"prompt": "p", "response": "r", "reward": 1.0}]


def test_logger_wandb_disabled_still_writes_metrics_jsonl_and_saves_no_run_id(tmp_path):
    cfg = compose_config(["debug=smoke", "logger=wandb", "logger.mode=disabled"], output_dir=str(tmp_path))
    validate_config(cfg)
    sink = build_metrics_sink(cfg, tmp_path, Console(quiet=True))
    try:
        sink.log({"train/reward": 0.5}, step=1)
        sink.log_samples([{"prompt": "p", "response": "r", "ground_truth": ["a", "b"], "reward": 0.0}], step=1)
    finally:
        sink.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "train/reward": 0.5}]
    assert not (tmp_path / "wandb_run_id.txt").exists()


@pytest.mark.parametrize(
    ("requested", "has_key", "expected"),
    [
        ("online", False, "offline"),
        ("online", True, "online"),
        ("offline", False, "offline"),
        ("disabled", True, "disabled"),
    ],
)
def test_online_without_an_api_key_becomes_offline_with_a_notice(requested, has_key, expected):
    mode, notice = choose_mode(requested, has_key)
    assert mode == expected
    assert (notice is not None) == (requested != expected)


def test_credentials_come_from_the_environment_or_the_netrc_entry_of_the_server(tmp_path):
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.example.org\n  login user\n  password secret\n")
    assert has_wandb_credentials("https://api.example.org", {"NETRC": str(netrc)})
    assert not has_wandb_credentials("https://api.wandb.ai", {"NETRC": str(netrc)})
    assert not has_wandb_credentials("https://api.wandb.ai", {"NETRC": str(tmp_path / "missing")})
    assert has_wandb_credentials("https://api.wandb.ai", {"WANDB_API_KEY": "k", "NETRC": str(tmp_path / "missing")})


def test_samples_table_keeps_at_most_max_rows_and_turns_structured_truths_into_text():
    rows = [{"prompt": f"p{i}", "response": "r", "ground_truth": ["red", "apple"], "reward": 1.0} for i in range(5)]
    table = sample_table_rows(rows, step=4, max_rows=2)
    assert table == [
        [4, "p0", "r", "['red', 'apple']", 1.0, None, None],
        [4, "p1", "r", "['red', 'apple']", 1.0, None, None],
    ]


def test_logger_wandb_mode_follows_wandb_mode_env_unless_set(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert compose_config(["logger=wandb"]).logger.mode == "offline"
    monkeypatch.delenv("WANDB_MODE")
    assert compose_config(["logger=wandb"]).logger.mode == "online"
    assert compose_config(["logger=wandb", "logger.mode=disabled"]).logger.mode == "disabled"


def test_data_hash_is_stable_and_changes_with_any_ground_truth():
    examples = [Example(prompt=[{"role": "user", "content": "q"}], ground_truth=["red", "apple"])]
    same = [Example(prompt=[{"role": "user", "content": "q"}], ground_truth=["red", "apple"])]
    other = [Example(prompt=[{"role": "user", "content": "q"}], ground_truth=["red", "pear"])]
    assert examples_sha256(examples) == examples_sha256(same) != examples_sha256(other)
    assert re.fullmatch(r"[0-9a-f]{64}", examples_sha256(examples))


def test_code_outside_a_git_repository_has_no_commit(tmp_path):
    assert git_state(tmp_path) == {"commit": None, "dirty": None, "changed_files": []}


def test_a_resumed_run_keeps_its_original_run_info_and_appends_the_resume(tmp_path):
    first = {"command": "grpo-run optim.lr=1e-05", "created_utc": "t0", "git": {}, "packages": {}, "seeds": {}}
    write_run_info(tmp_path, first)
    write_run_info(tmp_path, {**first, "command": "grpo-run resume=x", "created_utc": "t1"}, resumed=True)
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["command"] == "grpo-run optim.lr=1e-05"
    assert [r["command"] for r in info["resumes"]] == ["grpo-run resume=x"]


def test_multirun_job_directories_are_named_after_their_overrides_and_stay_valid_override_values(tmp_path):
    assert sweep_subdir(3, "optim.lr@1e-05+seed@1") == "3_optim.lr@1e-05+seed@1"
    assert sweep_subdir(0, "") == "0"
    # a hub id would nest directories, a list's brackets and commas would not parse as an override value
    hub = sweep_subdir(1, "model.name_or_path@HuggingFaceTB/SmolLM2+optim.betas@[0.9,0.99]")
    assert hub == "1_model.name_or_path@HuggingFaceTB_SmolLM2+optim.betas@_0.9_0.99_"
    assert len(sweep_subdir(7, "x" * 400)) == 200
    run_dir = tmp_path / "multirun" / "2026-11-22_07-00-00" / hub
    assert compose_config([f"report.runs={run_dir}"], output_dir=str(run_dir)).report.runs == str(run_dir)
    assert sweep_group_name("outputs/multirun/2026-11-22_07-00-00", "lr") == "lr-2026-11-22_07-00-00"
    assert sweep_group_name("outputs/multirun/2026-11-22_07-00-00", None) == "sweep-2026-11-22_07-00-00"


def sweep_params(preset: str) -> dict[str, list[str]]:
    register_configs()
    with initialize_config_module(config_module="grpo_cli.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"sweep={preset}"], return_hydra_config=True)
    return {key: str(value).split(",") for key, value in cfg.hydra.sweeper.params.items()}


PRESETS = sorted(p.stem for p in SWEEP_DIR.glob("*.yaml"))
# Presets that pick a search sweeper (Optuna) instead of Hydra's grid: their params are distributions.
SEARCH_PRESETS = [p for p in PRESETS if "override /hydra/sweeper:" in (SWEEP_DIR / f"{p}.yaml").read_text()]
GRID_PRESETS = [p for p in PRESETS if p not in SEARCH_PRESETS]


def test_the_documented_presets_exist():
    assert {"lr", "baselines", "length_norm", "std_norm", "sync", "group_size"} <= set(PRESETS)


@pytest.mark.parametrize("preset", GRID_PRESETS)
def test_every_run_of_every_preset_is_a_valid_config_with_several_seeds(preset):
    params = sweep_params(preset)
    assert len(params["seed"]) >= 2  # error bands need seeds
    combos = list(itertools.product(*[[f"{key}={value}" for value in values] for key, values in params.items()]))
    assert len(combos) >= 4
    for combo in combos:
        validate_config(compose_config([f"sweep={preset}", *combo]))
    assert f"grpo-run -m sweep={preset} " in SWEEPS_PAGE.read_text()  # each preset has its one-line command


@pytest.mark.skipif(find_spec("hydra_plugins.hydra_optuna_sweeper") is None, reason="needs the [optuna] extra")
@pytest.mark.parametrize("preset", SEARCH_PRESETS)
def test_every_search_preset_maximizes_over_valid_configs(preset):
    register_configs()
    with initialize_config_module(config_module="grpo_cli.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"sweep={preset}"], return_hydra_config=True)
    assert cfg.hydra.runtime.choices["hydra/sweeper"] == "optuna"
    assert str(cfg.hydra.sweeper.direction) in ("maximize", "Direction.maximize")
    assert cfg.hydra.sweeper.n_trials >= 3
    assert dict(cfg.hydra.sweeper.params) == {"optim.lr": "tag(log, interval(1e-6, 1e-4))"}
    for lr in ("1e-6", "1e-4"):  # the ends of the search space are valid runs
        validate_config(compose_config([f"sweep={preset}", f"optim.lr={lr}"]))
    assert f"grpo-run -m sweep={preset} " in SWEEPS_PAGE.read_text()


def test_job_report_composes_with_a_single_path_or_a_list(tmp_path):
    assert compose_config(["job=report", "report.runs=outputs/multirun/2026-11-22_07-00-00"]).report.runs == (
        "outputs/multirun/2026-11-22_07-00-00"
    )
    a, b = tmp_path / "a", tmp_path / "b"  # report.runs must exist (its declared constraint)
    a.mkdir(), b.mkdir()
    cfg = compose_config(["job=report", f"report.runs=[{a},{b}]", "report.out=/tmp/r"])
    validate_config(cfg)
    assert (cfg.job.name, list(cfg.report.runs), cfg.report.out) == ("report", [str(a), str(b)], "/tmp/r")


def test_rerun_command_quotes_what_the_shell_would_split():
    overrides = ["optim.lr=1e-05", "task.train_path=/data/my file.jsonl", "logger.tags=[a,b]"]
    assert (
        rerun_command(overrides) == "grpo-run optim.lr=1e-05 'task.train_path=/data/my file.jsonl' 'logger.tags=[a,b]'"
    )
    assert rerun_command([]) == "grpo-run"
