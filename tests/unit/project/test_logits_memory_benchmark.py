"""benchmarks/logits_memory.py runs end to end at a tiny size on the CPU and reports what docs/memory.md reads."""

from __future__ import annotations

import importlib.util
import json

from tests.conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "logits_memory.py"
TINY = "--vocab 512 --hidden 32 --intermediate 64 --layers 1 --heads 2 --kv-heads 1 --completions 2".split()


def test_the_benchmark_measures_each_variant_in_its_own_process(tmp_path):
    spec = importlib.util.spec_from_file_location("logits_memory", SCRIPT)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    out = tmp_path / "logits.json"
    argv = [*TINY, "--response-tokens", "12", "--prompt-tokens", "3", "--steps", "2", "--chunks", "0", "5"]
    report = benchmark.main([*argv, "--out", str(out)])
    assert json.loads(out.read_text())["summary"] == report["summary"]
    assert set(report["summary"]) == {"0", "5"}
    for variant, runs in report["runs"].items():
        (run,) = runs
        assert run["variant"] == variant and len(run["step_s"]) == 2 and all(s > 0 for s in run["step_s"])
        assert run["peak_rss_gib"] > 0.1 and run["rss_between_steps_gib"] > 0.1  # a real process's memory
    assert report["summary"]["0"]["peak_vs_unchunked"] == 1.0


def test_the_head_only_timing_alternates_the_variants_in_one_process(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("logits_memory", SCRIPT)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    out = tmp_path / "head.json"
    argv = ["--vocab", "64", "--hidden", "8", "--head-only", "--head-tokens", "7", "--chunks", "0", "3"]
    report = benchmark.main([*argv, "--rounds", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert [json.loads(line)["chunk"] for line in capsys.readouterr().out.splitlines()[:4]] == [0, 3, 0, 3]
    assert set(report["median_cpu_s"]) == {"0", "3"} and all(len(v) == 2 for v in report["cpu_s"].values())
