"""The grpo-run end-to-end half of tests/unit/hydra_plugins/test_sweeps.py: grpo-run as a subprocess."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from grpo_cli import cli
from grpo_cli.tracking.report import run_objective
from tests.conftest import run_grpo
from tests.unit.hydra_plugins.test_sweeps import needs_optuna

needs_submitit = pytest.mark.skipif(
    cli.find_spec("hydra_plugins.hydra_submitit_launcher") is None, reason="needs the [slurm] extra"
)


SMOKE = ["debug=smoke", "train.steps=1"]


def run_infos(sweep: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sweep.glob("*/run_info.json")}


def groups(sweep: Path) -> set[str]:
    return {yaml.safe_load(p.read_text())["logger"]["group"] for p in sweep.glob("*/config.yaml")}


@pytest.mark.slow
def test_grpo_run_multirun_goes_on_after_a_failed_job_and_ends_with_one_line(tmp_path):
    # train.gradient_accumulation_steps=3 does not divide debug=smoke's batch of 4: job #0 stops with exit code 2,
    # job #1 still runs. (2 jobs in 2 processes: tests/e2e/test_tracking_e2e.py's sweep.)
    sweep = tmp_path / "multirun"
    args = ["-m", *SMOKE, "train.gradient_accumulation_steps=3,2", f"hydra.sweep.dir={sweep}"]
    result = run_grpo(args, cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    assert [name.split("_")[0] for name in run_infos(sweep)] == ["1"]
    assert (next(sweep.glob("1_*")) / "metrics.jsonl").exists()
    failed = next(sweep.glob("0_*"))
    error = "train.train_batch_size=4 is not divisible by train.gradient_accumulation_steps=3: pick a divisor of 4"
    assert f"grpo-run: error: {error}" in (failed / "job.log").read_text()
    assert result.stderr.strip().splitlines()[-1] == (
        "grpo-run: 1 of 2 sweep jobs failed, the others completed: "
        f"#0 (exit 2) {error} [multirun/{failed.name}/job.log]"
    )
    assert groups(sweep) == {f"sweep-{sweep.name}"}  # one W&B group, written into each job's config


@pytest.mark.slow
@needs_submitit
def test_grpo_run_sweep_through_submitit_local(tmp_path):
    sweep = tmp_path / "multirun"
    args = ["-m", "hydra/launcher=submitit_local", *SMOKE, "optim.lr=1e-5,3e-5", f"hydra.sweep.dir={sweep}"]
    result = run_grpo(args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    infos = run_infos(sweep)
    assert sorted(infos) == ["0_debug@smoke+optim.lr@1e-05+train.steps@1", "1_debug@smoke+optim.lr@3e-05+train.steps@1"]
    assert len({info["pid"] for info in infos.values()}) == 2
    assert all((sweep / name / "metrics.jsonl").exists() for name in infos)
    assert groups(sweep) == {f"sweep-{sweep.name}"}


@pytest.fixture(scope="module")
def optuna_sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("optuna")
    sweep = tmp / "multirun"
    args = ["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "optim.lr=tag(log,interval(1e-5,1e-3))"]
    result = run_grpo([*args, *SMOKE, f"hydra.sweep.dir={sweep}"], cwd=tmp)
    return sweep, result


@pytest.mark.slow
@needs_optuna
def test_grpo_run_optuna_search_maximizes_the_returned_objective(optuna_sweep):
    sweep, result = optuna_sweep
    assert result.returncode == 0, result.stderr[-3000:]
    trials = sorted(p for p in sweep.iterdir() if (p / "metrics.jsonl").exists())
    assert len(trials) == 2 and len({info["pid"] for info in run_infos(sweep).values()}) == 2
    objectives = [run_objective("final_eval_reward", trial) for trial in trials]
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert results["best_value"] == max(objectives)
    assert 1e-5 <= results["best_params"]["optim.lr"] <= 1e-3
    hydra_cfg = yaml.safe_load((trials[0] / ".hydra" / "hydra.yaml").read_text())["hydra"]
    assert hydra_cfg["sweeper"]["direction"] == "maximize"
    assert groups(sweep) == {f"sweep-{sweep.name}"}


@pytest.mark.slow
@needs_optuna
def test_report_over_an_optuna_sweep_lists_its_trials(optuna_sweep, tmp_path):
    sweep, _ = optuna_sweep
    out = tmp_path / "report"
    args = ["job=report", f"report.runs={sweep}", f"report.out={out}", f"hydra.run.dir={tmp_path / 'run'}"]
    result = run_grpo(args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (search,) = json.loads((out / "report.json").read_text())["searches"]
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert search["best_value"] == best["best_value"] and search["best_params"] == best["best_params"]
    assert sorted(t["trial"] for t in search["trials"]) == [0, 1]
    objectives = [t["objective"] for t in search["trials"]]
    assert objectives == sorted(objectives, reverse=True)  # highest first
    assert "## Search (Optuna trials)" in (out / "report.md").read_text()
    assert "| trial | optim.lr | objective (final_eval_reward) |" in result.stdout and "(best)" in result.stdout
