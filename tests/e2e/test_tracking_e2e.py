"""Sweeps, W&B and reports through the real `grpo-run`, offline: what a user's sweep-and-compare day touches."""

import json
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from matplotlib.image import imread
from wandb.proto import wandb_internal_pb2

from grpo_cli.tasks import load_examples
from grpo_cli.tracking import read_metrics
from grpo_cli.tracking.run_info import examples_sha256
from tests.conftest import compose_config, run_grpo

pytestmark = pytest.mark.slow

# Two values: a sweep of several jobs, each in a process of its own (a third proved nothing more, 15 s).
LEARNING_RATES = ("1e-06", "1e-05")


def read_wandb_records(path: Path) -> list:
    """The protobuf records of an offline .wandb file (a LevelDB-style log: 32 KiB blocks of chunks with a
    7-byte header each, after a 7-byte file header ":W&B" + magic + version); wandb ships no reader."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, position, chunks, records = 32 * 1024, 7, [], []
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunks.append(data[position + 7 : position + 7 + length])
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: a record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            records.append(record)
            chunks = []
    return records


def wandb_history(records: list) -> list[dict]:
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def assert_real_image(path: Path) -> None:
    pixels = imread(path)
    assert pixels.ndim == 3 and min(pixels.shape[:2]) > 100
    assert pixels.var() > 0
    assert len(np.unique((pixels[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)) > 20


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """`grpo-run -m debug=smoke optim.lr=1e-6,1e-5` with W&B offline: two tiny runs, a process each."""
    tmp = tmp_path_factory.mktemp("sweep")
    wandb_dir = tmp / "wandb_dir"
    wandb_dir.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_DIR", str(wandb_dir))
        result = run_grpo(
            [
                "-m",
                "debug=smoke",
                "logger=wandb",
                "logger.mode=offline",
                f"optim.lr={','.join(LEARNING_RATES)}",
                f"hydra.sweep.dir={tmp / 'multirun'}",
            ],
            cwd=tmp,
        )
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "multirun", wandb_dir, result


def test_a_multirun_writes_one_readable_run_directory_per_value(sweep):
    multirun, _, _ = sweep
    runs = sorted(p.name for p in multirun.iterdir() if p.is_dir())
    # logger keys stay out of the names: they do not change the experiment
    assert runs == [f"{i}_debug@smoke+optim.lr@{lr}" for i, lr in enumerate(LEARNING_RATES)]
    for i, lr in enumerate(LEARNING_RATES):
        run = multirun / runs[i]
        assert yaml.safe_load((run / "config.yaml").read_text())["optim"]["lr"] == float(lr)
        assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "eval/reward" in r] == [0, 1, 2]


def test_run_info_holds_what_reruns_the_run(sweep):
    multirun, _, _ = sweep
    # hydra/launcher=processes: every job of the sweep ran in a new process
    infos = [json.loads(p.read_text()) for p in multirun.glob("*/run_info.json")]
    assert len({info["pid"] for info in infos}) == len(LEARNING_RATES) and all(info["host"] for info in infos)
    run = multirun / f"1_debug@smoke+optim.lr@{LEARNING_RATES[1]}"
    info = json.loads((run / "run_info.json").read_text())
    assert info["command"] == f"grpo-run debug=smoke logger=wandb logger.mode=offline optim.lr={LEARNING_RATES[1]}"
    assert info["seeds"] == {"seed": 0, "model.init_seed": 0, "task.data_seed": 1234}
    assert info["packages"]["torch"] and info["packages"]["grpo-cli"]
    assert set(info["git"]) == {"commit", "dirty", "changed_files"}
    # the command composes the same config, and the hash is that of the examples this config loads
    cfg = compose_config(info["overrides"], output_dir=str(run))
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["optim"] == {"lr": cfg.optim.lr, "weight_decay": cfg.optim.weight_decay, "betas": cfg.optim.betas}
    assert saved["train"]["steps"] == cfg.train.steps
    for split in ("train", "eval"):
        assert info["data"][split]["sha256"] == examples_sha256(load_examples(cfg.task, split))


def test_offline_wandb_runs_hold_the_logged_metrics_in_one_group(sweep):
    multirun, wandb_dir, result = sweep
    groups = set()
    for i, lr in enumerate(LEARNING_RATES):
        run = multirun / f"{i}_debug@smoke+optim.lr@{lr}"
        run_id = (run / "wandb_run_id.txt").read_text().strip()
        (offline_dir,) = (wandb_dir / "wandb").glob(f"offline-run-*-{run_id}")
        records = read_wandb_records(offline_dir / f"run-{run_id}.wandb")
        (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        groups.add(run_record.run_group)
        assert run_record.display_name == run.name
        config = {item.key: json.loads(item.value_json) for item in run_record.config.update}
        assert config["optim"]["lr"] == float(lr)  # the resolved config is logged

        history = wandb_history(records)
        logged = [(row["step"], row["train/reward"], row["time/step_s"]) for row in history if "train/reward" in row]
        on_disk = [
            (row["step"], row["train/reward"], row["time/step_s"])
            for row in read_metrics(run / "metrics.jsonl")
            if "train/reward" in row
        ]
        assert logged == on_disk and len(logged) == 2
        assert [row["step"] for row in history if "eval/reward" in row] == [0, 1, 2]
        # one table of eval completions per evaluation (logger.samples_every=1), with every eval example
        tables = [row for row in history if "eval/samples/path" in row]
        assert [row["step"] for row in tables] == [0, 1, 2] and all(row["eval/samples/nrows"] == 4 for row in tables)
        assert (offline_dir / "files" / tables[0]["eval/samples/path"]).exists()
    assert groups == {f"sweep-{multirun.name}"}
    assert result.stdout.count("upload later with `wandb sync") == len(LEARNING_RATES)


def test_report_over_the_multirun_matches_metrics_jsonl_and_draws_real_plots(sweep, tmp_path):
    multirun, _, _ = sweep
    out = tmp_path / "report"
    result = run_grpo(
        ["job=report", f"report.runs={multirun}", f"report.out={out}", f"hydra.run.dir={tmp_path / 'report_run'}"],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    markdown = (out / "report.md").read_text()
    report = json.loads((out / "report.json").read_text())
    assert report["differing_keys"] == ["optim.lr"]
    for i, lr in enumerate(LEARNING_RATES):
        rows = read_metrics(multirun / f"{i}_debug@smoke+optim.lr@{lr}" / "metrics.jsonl")
        evals = [r["eval/reward"] for r in rows if "eval/reward" in r]
        steps = [r["step"] for r in rows if "eval/reward" in r]
        best = max(range(len(evals)), key=evals.__getitem__)
        wall = sum(r["time/step_s"] for r in rows if "time/step_s" in r) + sum(
            r["time/eval_s"] for r in rows if "time/eval_s" in r
        )
        summary = report["runs"][i]
        assert summary["name"] == str(i) and summary["path"].endswith(f"{i}_debug@smoke+optim.lr@{lr}")
        assert (summary["final_eval_reward"], summary["best_eval_reward"], summary["best_eval_step"]) == (
            evals[-1],
            evals[best],
            steps[best],
        )
        assert summary["wall_time_s"] == pytest.approx(wall)
        gen = [r["time/generation_s"] for r in rows if "time/generation_s" in r]
        assert summary["time_means_s"]["time/generation_s"] == pytest.approx(sum(gen) / len(gen))
        row = f"| {i} | {float(lr):g} | 2 | {evals[-1]:.3f} | {evals[best]:.3f} ({steps[best]}) | {wall:.1f} |"
        assert row in markdown
        assert f"{sum(gen) / len(gen):.2f}" in markdown.split("## Time")[1].splitlines()[4 + i]
    # A plot per metric the runs logged: train/entropy is over the rows an update computes, and the tiny model's
    # keyword steps are flat (every group one reward: no row computed, docs/algorithm.md), so it is drawn only if
    # some step logged it.
    logged = {
        key
        for i, lr in enumerate(LEARNING_RATES)
        for r in read_metrics(multirun / f"{i}_debug@smoke+optim.lr@{lr}" / "metrics.jsonl")
        for key in r
    }
    expected = {"eval_reward.png", "train_reward.png", "train_grad_norm.png"}
    assert expected | ({"train_entropy.png"} if "train/entropy" in logged else set()) == set(report["plots"]) & (
        expected | {"train_entropy.png"}
    )
    assert "train_clip_fraction.png" not in report["plots"]  # reinforce_with_baseline logs no clip fraction
    for name in report["plots"]:
        assert_real_image(out / name)


def test_a_report_over_a_missing_directory_fails_with_one_line(tmp_path):
    result = run_grpo(["job=report", "report.runs=[/no/such/run]", f"hydra.run.dir={tmp_path / 'r'}"], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "grpo-run: error: report.runs=['/no/such/run'] holds /no/such/run: no such file or directory: "
        "give an existing directory"
    )


@pytest.mark.alone  # a wall-clock bound
@pytest.mark.parametrize("has_key", [False, True])
def test_online_without_key_or_server_falls_back_to_offline_quickly(tmp_path, monkeypatch, has_key):
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    if has_key:
        # a key, but a server that refuses connections: the init times out after logger.init_timeout_s
        monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567")
        monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    else:
        monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run_dir = tmp_path / "run"
    start = time.perf_counter()
    result = run_grpo(
        [
            "debug=smoke",
            "train.steps=1",
            "logger=wandb",
            "logger.mode=online",
            "logger.init_timeout_s=3",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        timeout=180,
    )
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.stderr[-3000:]
    notice = "could not start online within 3s" if has_key else "no API key"
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("W&B:")]
    assert notice in line and "offline run" in line
    run_id = (run_dir / "wandb_run_id.txt").read_text().strip()
    assert list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert elapsed < 90  # seen here: ~15 s with the key, ~10 s without
