"""Sweeps beyond one process: hydra/launcher=processes (a new process per job), submitit, Optuna, and what every
launcher's job process needs (resolvers and config registered when grpo_cli.cli is imported).

The launcher is first tested on a toy Hydra app (no torch: each job process starts in about a second), then
through the real `grpo-run` on the tiny model (marked slow)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from grpo_cli import cli
from grpo_cli.tracking.report import run_objective

needs_optuna = pytest.mark.skipif(
    cli.find_spec("hydra_plugins.hydra_optuna_sweeper") is None, reason="needs the [optuna] extra"
)

TOY_CONFIG = """\
defaults:
  - override hydra/launcher: processes
  - _self_
x: 0.0
sleep: 0.0
"""

# A Hydra app of its own: jobs record their pid and times, x=13 raises, x=14 kills its own process, and the
# return value (a sweeper's objective) peaks at x=3.
TOY_APP = """\
import os
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from grpo_cli.config import register_sweep_plugins

register_sweep_plugins()


@hydra.main(version_base="1.3", config_path="conf", config_name="toy")
def toy(cfg):
    out = Path(HydraConfig.get().runtime.output_dir)
    start = time.time()
    print(f"job x={cfg.x} running", flush=True)
    if cfg.x == 13:
        raise ValueError("thirteen is unlucky")
    if cfg.x == 14:
        os._exit(9)
    time.sleep(cfg.sleep)
    (out / "job.json").write_text(f'{{"pid": {os.getpid()}, "start": {start}, "end": {time.time()}}}')
    return -((cfg.x - 3.0) ** 2)


toy()
"""


@pytest.fixture
def toy_app(tmp_path) -> Path:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "toy.yaml").write_text(TOY_CONFIG)
    (tmp_path / "toy.py").write_text(TOY_APP)
    return tmp_path


def run_toy(app: Path, args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    command = [sys.executable, str(app / "toy.py"), "-m", f"hydra.sweep.dir={app / 'sweep'}", *args]
    return subprocess.run(command, cwd=app, capture_output=True, text=True, timeout=timeout)


def job_dirs(sweep: Path) -> list[Path]:
    return sorted((p for p in sweep.iterdir() if p.is_dir() and p.name[0].isdigit()), key=lambda p: int(p.name[0]))


def test_each_job_runs_in_a_new_process_and_a_failed_job_does_not_stop_the_others(toy_app):
    result = run_toy(toy_app, ["x=1,13,2,14"])
    assert result.returncode == 1, result.stderr
    sweep = toy_app / "sweep"
    dirs = job_dirs(sweep)
    assert [d.name for d in dirs] == ["0", "1", "2", "3"]  # the toy app keeps Hydra's default subdir
    pids = [json.loads((dirs[i] / "job.json").read_text())["pid"] for i in (0, 2)]
    assert len(set(pids)) == 2  # jobs after the failures ran, each in a process of its own
    # one summary line at the end, naming both failed jobs, their errors and logs (a plain Hydra app like this one
    # gets Hydra's HYDRA_FULL_ERROR hint after it; grpo-run's main() prints the line alone)
    (summary,) = [line for line in result.stderr.splitlines() if line.startswith("toy: ")]
    assert summary.startswith("toy: 2 of 4 sweep jobs failed, the others completed: ")
    # (the job logs' paths are relative to the working directory, as the sweep directory is below it)
    assert "#1 (exit 1) ValueError: thirteen is unlucky [sweep/1/job.log]" in summary
    assert "#3 (exit 9) its process exited with code 9 [sweep/3/job.log]" in summary
    assert "Error executing job" not in result.stderr
    # each job's output, and a failed job's traceback, in its own directory (and on the console)
    assert "job x=1 running" in (dirs[0] / "job.log").read_text() and "job x=1 running" in result.stdout
    failed_log = (dirs[1] / "job.log").read_text()
    assert "Traceback" in failed_log and "ValueError: thirteen is unlucky" in failed_log
    assert "job #1 failed (exit code 1)" in failed_log


def test_n_jobs_runs_jobs_side_by_side_with_prefixed_output(toy_app):
    result = run_toy(toy_app, ["hydra.launcher.n_jobs=2", "x=1,2", "sleep=2"])
    assert result.returncode == 0, result.stderr
    first, second = (json.loads((d / "job.json").read_text()) for d in job_dirs(toy_app / "sweep"))
    assert first["pid"] != second["pid"]
    assert max(first["start"], second["start"]) < min(first["end"], second["end"])  # they overlapped
    assert "[#0] job x=1 running" in result.stdout and "[#1] job x=2 running" in result.stdout


def test_sigterm_reaches_the_running_job_and_stops_the_sweep(toy_app):
    command = [sys.executable, "toy.py", "-m", f"hydra.sweep.dir={toy_app / 'sweep'}", "x=1,2", "sleep=60"]
    process = subprocess.Popen(command, cwd=toy_app, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = toy_app / "sweep" / "0" / "job.log"
    deadline = time.time() + 60
    while not (log.exists() and "running" in log.read_text()) and time.time() < deadline:
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)  # not the 60 s of the job: it got the SIGTERM too
    assert process.returncode == 128 + signal.SIGTERM
    line = stderr.strip().splitlines()[-1]
    assert line.startswith("toy: sweep stopped by SIGTERM: #0 killed by SIGTERM") and line.endswith("not started: #1")


@needs_optuna
def test_the_optuna_sweeper_gets_each_job_return_value_and_maximizes(toy_app):
    args = ["hydra/sweeper=optuna", "hydra/sweeper/sampler=grid", "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=1"]
    args.append("x=choice(1,3,5)")
    result = run_toy(toy_app, args)
    assert result.returncode == 0, result.stderr
    results = yaml.safe_load((toy_app / "sweep" / "optimization_results.yaml").read_text())
    assert results["best_params"] == {"x": 3} and results["best_value"] == 0.0  # minimize would pick x=1 or 5


def test_check_plugin_extras_names_the_missing_extra(monkeypatch, capsys):
    monkeypatch.setattr(cli, "find_spec", lambda name: None)
    with pytest.raises(SystemExit) as exit_info:
        cli.check_plugin_extras(["-m", "sweep=lr_search"])
    assert exit_info.value.code == 2
    expected = 'grpo-run: error: sweep=lr_search needs the [optuna] extra: pip install -e ".[optuna]"\n'
    assert capsys.readouterr().err == expected
    with pytest.raises(SystemExit):
        cli.check_plugin_extras(["hydra/launcher=submitit_slurm"])
    assert "[slurm] extra" in capsys.readouterr().err


def test_importing_the_app_module_is_enough_to_compose_a_sweep_job_config(tmp_path):
    """What a job process started by any launcher has: nothing but `import grpo_cli.cli` (via the task function)."""
    code = textwrap.dedent(
        """
        import os
        import grpo_cli.cli
        from hydra import compose, initialize_config_module
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import open_dict
        from importlib.util import find_spec

        sweeper = ["hydra/sweeper=optuna"] if find_spec("hydra_plugins.hydra_optuna_sweeper") else []
        with initialize_config_module(config_module="grpo_cli.conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=["optim.lr=1e-5", *sweeper], return_hydra_config=True)
        with open_dict(cfg):
            cfg.hydra.job.num = 3
            cfg.hydra.job.override_dirname = "optim.lr@1e-05"
        HydraConfig.instance().set_config(cfg)
        print(cfg.hydra.sweep.subdir)
        print(cfg.hydra.launcher._target_)
        print(cfg.hydra.sweeper.get("direction"))
        print(os.environ["TOKENIZERS_PARALLELISM"])
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    subdir, launcher, direction, parallelism = out.stdout.split()
    assert subdir == "3_optim.lr@1e-05"
    assert launcher == "hydra_plugins.grpo_cli_launcher.process_launcher.ProcessLauncher"
    if cli.find_spec("hydra_plugins.hydra_optuna_sweeper"):
        assert direction in ("maximize", "Direction.maximize")
    assert parallelism == "false"


def test_the_objective_is_the_final_or_best_eval_reward(tmp_path):
    lines = [{"step": 0, "eval/reward": 0.25}, {"step": 1, "train/reward": 0.5}, {"step": 1, "eval/reward": 0.75}]
    lines += [{"step": 2, "eval/reward": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert run_objective("final_eval_reward", tmp_path) == 0.5
    assert run_objective("best_eval_reward", tmp_path) == 0.75
    baseline = tmp_path / "baseline"
    baseline.mkdir()
    assert run_objective("final_eval_reward", baseline, {"metrics": {"eval/reward": 0.125}}) == 0.125
    assert run_objective("best_eval_reward", baseline, {"checked": 9}) is None  # e.g. job=check_reward


# ---- the real grpo-run, tiny model ----


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-m", "sweep=nope"], "sweep=nope: no such sweep choice, use one of algorithms, baselines, group_size"),
        (["sweep=lr"], "run it with -m (grpo-run -m sweep=lr)"),
    ],
)
def test_an_unknown_sweep_preset_or_one_without_multirun_is_one_line(capsys, args, message):
    # Before the fix, Hydra skipped the unknown optional preset and trained one run with the defaults.
    with pytest.raises(SystemExit) as info:
        cli.check_group_choices(args)
        cli.check_sweep_preset(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    cli.check_sweep_preset(["-m", "sweep=lr"])
    cli.check_sweep_preset(["--multirun", "sweep=group_size", "seed=0"])
