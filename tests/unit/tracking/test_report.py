"""job=report on hand-written run directories: the numbers it prints are the ones in metrics.jsonl."""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from matplotlib.image import imread
from rich.console import Console

from grpo_cli.errors import UserFacingError
from grpo_cli.tracking.plots import seed_band
from grpo_cli.tracking.report import (
    RunData,
    differing_keys,
    flatten,
    read_metric_lines,
    resolve_run_dirs,
    run_names,
    write_report,
)


def make_run(path: Path, lr: float, seed: int, eval_rewards: list[float], kl: bool = False) -> Path:
    """A run directory as the trainer writes it: config.yaml, and train lines + eval lines sharing steps."""
    path.mkdir(parents=True)
    config = {
        "model": {"name": "tiny_random"},
        "optim": {"lr": lr, "betas": [0.9, 0.95]},
        "seed": seed,
        "output_dir": str(path),  # differs between runs but is not a hyperparameter
        "logger": {"group": f"g{seed}"},
    }
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    lines = [{"step": 0, "eval/reward": eval_rewards[0], "time/eval_s": 2.0}]
    for step, reward in enumerate(eval_rewards[1:], start=1):
        train = {
            "step": step,
            "train/reward": 0.1 * step + seed,
            "train/grad_norm": 1.0 + step,
            "time/step_s": 3.0,
            "time/generation_s": 2.0,
            "time/training_s": 1.0,
            "time/sync_s": 0.0,
        }
        if kl:
            train["train/kl"] = 0.01 * step
        lines += [train, {"step": step, "eval/reward": reward, "time/eval_s": 2.0}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def assert_real_image(path: Path) -> None:
    pixels = imread(path)  # (H, W, 4) floats in [0, 1]
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert pixels.var() > 0
    colors = np.unique((pixels[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colors) > 20  # axes, text, lines and a band, not one flat fill


@pytest.fixture
def sweep(tmp_path):
    """A multirun directory: two learning rates x two seeds, job directories named as Hydra names them."""
    root = tmp_path / "multirun" / "2026-11-22_07-00-00"
    runs = {
        "0_optim.lr@1e-05+seed@0": (1e-5, 0, [0.1, 0.3, 0.2]),
        "1_optim.lr@1e-05+seed@1": (1e-5, 1, [0.1, 0.4, 0.5]),
        "2_optim.lr@3e-05+seed@0": (3e-5, 0, [0.1, 0.6, 0.6]),
        "10_optim.lr@3e-05+seed@1": (3e-5, 1, [0.1, 0.2, 0.7]),
    }
    for name, (lr, seed, rewards) in runs.items():
        make_run(root / name, lr, seed, rewards, kl=name.startswith("0_"))
    (root / "multirun.yaml").write_text("hydra: {}\n")
    return root


def test_report_table_holds_final_and_best_eval_reward_and_only_the_differing_keys(sweep, tmp_path):
    out = tmp_path / "report"
    report = write_report(str(sweep), out, Console(quiet=True))
    # natural order of job numbers: 10_ comes last, not after 1_
    # runs are named by job number (their overrides are the columns), in natural order: 10 after 2
    assert [r["name"] for r in report["runs"]] == ["0", "1", "2", "10"]
    assert report["runs"][3]["path"] == str(sweep.resolve() / "10_optim.lr@3e-05+seed@1")
    assert report["differing_keys"] == ["optim.lr", "seed"]  # output_dir and logger.* differ but do not count
    first = report["runs"][0]
    # eval rewards 0.1, 0.3, 0.2 at steps 0, 1, 2: final 0.2, best 0.3 at step 1
    assert (first["final_eval_reward"], first["best_eval_reward"], first["best_eval_step"]) == (0.2, 0.3, 1)
    assert first["steps"] == 2
    assert first["wall_time_s"] == pytest.approx(2 * 3.0 + 3 * 2.0)  # two steps + three evaluations
    assert first["time_means_s"]["time/generation_s"] == 2.0 and first["time_means_s"]["time/eval_s"] == 2.0

    markdown = (out / "report.md").read_text()
    assert "| 0 | 1e-05 | 0 | 2 | 0.200 | 0.300 (1) | 12.0 |" in markdown
    assert "| 10 | 3e-05 | 1 | 2 | 0.700 | 0.700 (2) | 12.0 |" in markdown
    # seeds 0 and 1 of lr 1e-5 end at 0.2 and 0.5: mean 0.35, sample std 0.212, 0.25 above step 0's 0.1
    assert "| optim.lr=1e-05 | 2 | 0.350 ± 0.212 | 0.400 | +0.250 | yes |" in markdown
    assert "sync" not in markdown.split("## Time")[1].split("\n")[2]  # a phase that never took time is left out
    assert "`model.name=tiny_random`" in markdown


def test_a_gain_within_the_seed_spread_is_not_called_learning(tmp_path):
    root = tmp_path / "multirun"
    make_run(root / "0_optim.lr@3e-06+seed@0", 3e-6, 0, [0.5, 0.6, 0.6])  # +0.1
    make_run(root / "1_optim.lr@3e-06+seed@1", 3e-6, 1, [0.5, 0.4, 0.4])  # -0.1: mean 0.5, std 0.141
    make_run(root / "2_optim.lr@3e-05+seed@0", 3e-5, 0, [0.5, 0.6, 0.7])
    make_run(root / "3_optim.lr@3e-05+seed@1", 3e-5, 1, [0.5, 0.7, 0.8])  # mean 0.75, std 0.071: +0.25
    for seed in (0, 1):
        run = make_run(root / f"{4 + seed}_optim.lr@1e-04+seed@{seed}", 1e-4, seed, [0.5, 0.9])
        lines = (run / "metrics.jsonl").read_text().splitlines()
        (run / "metrics.jsonl").write_text("\n".join(lines[1:]) + "\n")  # no evaluation at step 0
    write_report(str(root), tmp_path / "out", Console(quiet=True))
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "| optim.lr=3e-06 | 2 | 0.500 ± 0.141 | 0.550 | +0.000 | no |" in markdown
    assert "| optim.lr=3e-05 | 2 | 0.750 ± 0.071 | 0.750 | +0.250 | yes |" in markdown
    assert "| optim.lr=0.0001 | 2 | 0.900 ± 0.000 | 0.900 | - | - |" in markdown


def test_report_draws_real_plots_and_skips_metrics_no_run_logged(sweep, tmp_path):
    out = tmp_path / "report"
    report = write_report([str(sweep)], out, Console(quiet=True))
    assert report["plots"] == [
        "eval_reward.png",
        "train_reward.png",
        "train_kl.png",
        "train_grad_norm.png",
        "eval_reward_by_time.png",
    ]
    for name in report["plots"]:
        assert_real_image(out / name)
        assert f"]({name})" in (out / "report.md").read_text()
    assert not (out / "train_entropy.png").exists()


def test_seed_band_is_mean_min_max_over_the_steps_every_run_has():
    steps, means, lows, highs = seed_band([([0, 1, 2], [0.0, 1.0, 2.0]), ([0, 1], [2.0, 3.0])])
    assert steps == [0, 1]  # step 2 is missing from the second (killed) run
    assert means == [1.0, 2.0] and lows == [0.0, 1.0] and highs == [2.0, 3.0]


def test_run_directories_can_be_listed_one_by_one(sweep, tmp_path):
    runs = [sweep / "2_optim.lr@3e-05+seed@0", sweep / "0_optim.lr@1e-05+seed@0"]
    assert resolve_run_dirs([str(r) for r in runs]) == [r.resolve() for r in runs]  # the order given
    assert run_names(runs) == ["2", "0"]
    # runs of two sweeps keep the sweep directory; plain run directories keep their names
    assert run_names([Path("/o/m/t1/0_a@1"), Path("/o/m/t2/0_a@1")]) == ["t1/0", "t2/0"]
    assert run_names([Path("/o/train/2026-11-22_06-25-01")]) == ["2026-11-22_06-25-01"]
    report = write_report([str(r) for r in runs], tmp_path / "out", Console(quiet=True))
    assert report["differing_keys"] == ["optim.lr"]  # both are seed 0


@pytest.mark.parametrize(
    ("runs", "message"),
    [
        ([], "report.runs is empty"),
        (["/no/such/run"], "/no/such/run does not exist"),
    ],
)
def test_bad_report_runs_fail_with_one_line(runs, message):
    with pytest.raises(UserFacingError) as info:
        resolve_run_dirs(runs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_directory_without_runs_is_rejected(tmp_path):
    with pytest.raises(UserFacingError, match="holds no metrics.jsonl"):
        resolve_run_dirs([str(tmp_path)])


def test_a_torn_last_line_is_dropped_but_a_damaged_middle_line_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "train/reward": 0.5}\n{"step": 2, "train/rew')
    assert read_metric_lines(path) == [{"step": 1, "train/reward": 0.5}]
    path.write_text('{"step": 1, "train/rew\n{"step": 2, "train/reward": 0.5}\n')
    with pytest.raises(UserFacingError, match="metrics.jsonl:1"):
        read_metric_lines(path)


def test_differing_keys_treat_a_missing_key_as_a_difference_and_put_seed_last():
    configs = [
        flatten({"seed": 0, "a": {"b": 1}, "c": [1, 2]}),
        flatten({"seed": 1, "a": {"b": 1, "x": 2}, "c": [1, 2]}),
    ]
    assert differing_keys(configs) == ["a.x", "seed"]


def test_time_table_shows_waiting_overlap_and_lag_of_disaggregated_runs(tmp_path):
    make_run(tmp_path / "runs" / "serial", lr=1e-5, seed=0, eval_rewards=[0.1, 0.2, 0.3])
    overlapped = make_run(tmp_path / "runs" / "overlapped", lr=1e-5, seed=1, eval_rewards=[0.1, 0.2, 0.3])
    lines = read_metric_lines(overlapped / "metrics.jsonl")
    for line, (waiting, overlap, lag) in zip(
        (line for line in lines if "train/reward" in line), [(2.0, 0.0, 0), (0.5, 0.75, 1)], strict=True
    ):
        line.update({"time/waiting_s": waiting, "time/overlap_frac": overlap, "sync/lag": lag})
    (overlapped / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    report = write_report(str(tmp_path / "runs"), tmp_path / "out", Console(quiet=True))
    means = {run["name"]: run["time_means_s"] for run in report["runs"]}
    assert means["overlapped"]["time/waiting_s"] == pytest.approx(1.25)
    assert means["overlapped"]["time/overlap_frac"] == pytest.approx(0.375)
    assert means["overlapped"]["sync/lag"] == pytest.approx(0.5)
    assert "time/waiting_s" not in means["serial"]  # a run that did not log it shows "-", not a made-up 0
    text = (tmp_path / "out" / "report.md").read_text()
    assert "| run | step | generation | training | waiting | eval | overlap | lag |" in text
    assert "| overlapped | 3.00 | 2.00 | 1.00 | 1.25 | 2.00 | 0.38 | 0.50 |" in text
    assert "| serial | 3.00 | 2.00 | 1.00 | - | 2.00 | - | - |" in text


def test_the_timed_series_puts_each_value_at_the_training_time_of_its_step():
    rows = [
        {"step": 0, "eval/reward": 0.1, "time/eval_s": 9.0},
        {"step": 1, "train/reward": 0.2, "time/step_s": 2.0},
        {"step": 2, "train/reward": 0.3, "time/step_s": 3.0},
        {"step": 2, "eval/reward": 0.4, "time/eval_s": 9.0},
    ]
    run = RunData(Path("run"), "run", {}, rows, rows[1:3], [rows[0], rows[3]])
    assert run.timed_series("eval/reward") == ([0.0, 5.0], [0.1, 0.4])  # evaluations take no training time
    assert run.timed_series("train/reward") == ([2.0, 5.0], [0.2, 0.3])
