"""The grpo-run end-to-end half of tests/unit/tasks/test_custom_task.py: grpo-run as a subprocess."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from tests.conftest import run_grpo
from tests.unit.tasks.test_custom_task import REWARDS_PY, rows_jsonl, save_tiny_classifier, write


def experiment_folder(tmp_path: Path) -> Path:
    """A user's own folder: rewards as a file and as a package, a generator, held-out JSONL, a tiny classifier,
    cases, and conf/task/reviews.yaml extending task=custom."""
    rows = [{"review": f"review {i}", "word": ["a", "skip"][i % 2]} for i in range(8)]
    write(
        tmp_path,
        {
            "rewards.py": REWARDS_PY,
            "mypkg_custom_e2e/__init__.py": "",
            "mypkg_custom_e2e/scores.py": (
                "def long(completions, **kwargs):\n    return [len(c) / 100 for c in completions]\n"
            ),
            "reviews.py": (
                "def make(n, seed):\n    return [{'review': f'r{seed}-{i}', 'word': 'a'} for i in range(n)]\n"
            ),
            "eval.jsonl": rows_jsonl(rows),
            "cases.jsonl": rows_jsonl(
                [
                    {"review": "x", "word": "a", "response": "<a", "expected": 2.0},
                    {"review": "x", "word": "skip", "response": "b", "expected": 0.0},
                ]
            ),
            "conf/task/reviews.yaml": """
            defaults:
              - custom
              - _self_
            generator: reviews.py:make
            eval_path: eval.jsonl
            template: "Rewrite: {review}"
            prompt: question_only
            rewards:
              fmt: rewards.py:format_reward
              word: rewards.py:has_word
              long: mypkg_custom_e2e.scores:long
            reward_weights:
              long: 0.0
            cases_path: cases.jsonl
        """,
            "conf/experiment/reviews_smoke.yaml": """
            # @package _global_
            defaults:
              - override /task: reviews
              - override /model: tiny_random
            train:
              steps: 2
              rollout_batch_size: 4
              group_size: 2
              train_batch_size: 4
              gradient_accumulation_steps: 2
              eval_every: 1
            task:
              n_train: 8
              n_eval: 4
            rollout:
              max_tokens: 6
        """,
        },
    )
    save_tiny_classifier(tmp_path / "clf")
    return tmp_path


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_grpo_run_trains_a_users_task_from_their_config_dir_and_checks_their_cases(tmp_path):
    folder = experiment_folder(tmp_path)
    started = time.perf_counter()
    run = run_grpo(
        [
            "--config-dir",
            "conf",
            "experiment=reviews_smoke",
            "task.reward_model.path=clf",
            "task.reward_model.label=NEGATIVE",
            "output_dir=run",
        ],
        cwd=folder,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = read_metrics(folder / "run")
    train = next(r for r in rows if "train/reward" in r)
    for name in ("fmt", "long", "reward_model"):
        assert f"train/reward/{name}" in train and f"eval/reward/{name}" in rows[0]
    saved = (folder / "run" / "config.yaml").read_text()
    assert f"generator: {folder / 'reviews.py'}:make" in saved and f"path: {folder / 'clf'}" in saved
    info = json.loads((folder / "run" / "run_info.json").read_text())
    assert info["user_code"]["task.rewards.long"]["file"] == str(folder / "mypkg_custom_e2e" / "scores.py")
    assert len(info["user_code"]["task.rewards.fmt"]["sha256"]) == 64

    check = run_grpo(["--config-dir", "conf", "task=reviews", "job=check_reward", "output_dir=check"], cwd=folder)
    assert check.returncode == 0, check.stderr[-2000:]
    assert "all 2 cases agree" in check.stdout and "fmt=1" in check.stdout  # each reward beside the total
    baseline = run_grpo(
        ["--config-dir", "conf", "experiment=reviews_smoke", "job=baseline_eval", "output_dir=b"], cwd=folder
    )
    assert baseline.returncode == 0, baseline.stderr[-2000:]
    print(f"3 grpo-run invocations in {time.perf_counter() - started:.0f}s")


@pytest.mark.slow
def test_grpo_run_stops_on_a_failing_reward_with_the_last_update_kept_and_skips_when_asked(tmp_path):
    folder = experiment_folder(tmp_path)
    # Raises on its third call: eval at step 0, step 1, then step 2's batch (whose rows then score alone).
    write(
        folder,
        {
            "flaky.py": """
        calls = []

        def reward(completions, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise ValueError("the third batch")
            return [1.0 for _ in completions]
    """
        },
    )
    base = [
        "--config-dir",
        "conf",
        "experiment=reviews_smoke",
        "train.eval_every=0",
        "+task.rewards.flaky=flaky.py:reward",
    ]
    stopped = run_grpo([*base, "output_dir=stop"], cwd=folder)
    assert stopped.returncode == 2, stopped.stderr[-2000:]
    line = stopped.stderr.strip().splitlines()[-1]
    assert line.startswith("grpo-run: error: reward task.rewards.flaky=")  # as docs/custom-tasks.md shows it
    assert "reward task.rewards.flaky=" in line and "raised ValueError: the third batch on a batch of 4 rows" in line
    assert "step 1's update is saved in" in line and "grpo-run resume=" in line
    assert (folder / "stop" / "checkpoints" / "step_000001" / "COMPLETE").is_file()

    skipped = run_grpo(
        [*base, "task.on_reward_error=skip", "+task.rewards.nan=rewards.py:nan", "output_dir=skip"], cwd=folder
    )
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    train = [r for r in read_metrics(folder / "skip") if "train/reward" in r]
    # nan: an error on each of the 4 samples per step; flaky's failing third batch is retried one row at a time,
    # and each row alone scores, so it costs nothing
    assert [r["train/reward_errors"] for r in train] == [4, 4]
    assert all(r["train/reward/flaky"] == 1.0 for r in train)
    assert all("train/reward/nan" not in r for r in train)


@pytest.mark.slow
def test_bad_user_code_stops_grpo_run_in_one_line_before_the_model_loads(tmp_path):
    folder = experiment_folder(tmp_path)
    base = ["--config-dir", "conf", "experiment=reviews_smoke"]
    for extra, said in (
        (["task.rewards.fmt=rewards.py:nothing"], "has no function nothing"),
        (["task.rewards.fmt=gone.py:f"], "no such file"),
        (["task.rewards.fmt=rewards.py:two_args"], "takes no completions= argument"),
        (['task.template="{title}"'], "task.template reads column 'title'"),
        (["task.reward_model.path=clf"], "has 2 labels (NEGATIVE, POSITIVE)"),
        (["task.reward_model.path=clf", "task.reward_model.label=NEG"], "task.reward_model.label=NEG"),
    ):
        result = run_grpo([*base, *extra, "output_dir=bad"], cwd=folder, timeout=300)
        assert result.returncode == 2 and said in result.stderr, (extra, result.stderr[-1500:])
        assert result.stderr.count("\n") == 1 and "policy" not in result.stdout, result.stdout[-500:]


@pytest.mark.slow
@pytest.mark.parametrize(
    "setting",
    [
        # Ray, and the default rendezvous port: each a resource of the machine (tests/conftest.py, "Parallel workers")
        pytest.param(["sync=one_behind", "loss=grpo_clip"], id="ray_one_behind", marks=pytest.mark.machine_wide("ray")),
        pytest.param(
            ["distributed=ddp", "distributed.nproc_per_node=2"], id="ddp_2_ranks", marks=pytest.mark.machine_wide
        ),
        pytest.param(["-m", "seed=0,1"], id="sweep"),
    ],
)
def test_the_users_code_is_found_in_ray_actors_every_rank_and_each_sweep_job(tmp_path, setting):
    folder = experiment_folder(tmp_path)
    out = ["hydra.sweep.dir=sweep"] if "-m" in setting else ["output_dir=run"]
    flags = [arg for arg in setting if arg.startswith("-")]  # Hydra's flags come before the overrides
    overrides = [arg for arg in setting if not arg.startswith("-")]
    result = run_grpo(
        [*flags, "--config-dir", "conf", "experiment=reviews_smoke", "train.eval_every=0", *overrides, *out],
        cwd=folder,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted((folder / "sweep").glob("*/metrics.jsonl")) if "-m" in setting else [folder / "run" / "metrics.jsonl"]
    assert len(runs) == (2 if "-m" in setting else 1)
    for metrics in runs:
        train = [r for r in read_metrics(metrics.parent) if "train/reward" in r]
        assert len(train) == 2 and all("train/reward/long" in r and r["train/reward_errors"] == 0 for r in train)
        assert not math.isnan(train[-1]["train/reward"])
