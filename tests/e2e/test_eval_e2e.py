"""job=eval evaluates the TRAINED weights: a run's checkpoint, altered here, gives the outputs a one-row greedy decode
of those weights gives (transformers' generate, not the project's decode loop), not the untrained model's; the
run's own task and sampling by default; a LoRA run's checkpoint refuses other LoRA settings; job=baseline_eval
refuses init_from; job=report puts the run and the evaluation side by side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file, save_file

from grpo_cli.config import register_configs
from grpo_cli.errors import UserFacingError
from grpo_cli.jobs.eval import eval_config
from tests.conftest import read_metrics, run_grpo


def composed(overrides: list[str], output_dir: Path) -> DictConfig:
    """The DictConfig Hydra hands cli.task for `grpo-run <overrides>` (before eval_config)."""
    register_configs()
    with initialize_config_module(config_module="grpo_cli.conf", version_base="1.3"):
        return compose(config_name="config", overrides=[*overrides, f"output_dir={output_dir}"])


def fake_run(tmp_path: Path, overrides: list[str]) -> Path:
    """A run directory as training leaves it, without training: config.yaml and one complete checkpoint whose
    files are placeholders of the sizes its COMPLETE marker records (eval_config reads no weights)."""
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step_000003"
    checkpoint.mkdir(parents=True)
    (run / "config.yaml").write_text(OmegaConf.to_yaml(composed(overrides, run), resolve=False))
    sizes = {}
    for name in ("model.safetensors", "optimizer.pt", "rng.pt", "state.json"):
        (checkpoint / name).write_text('{"step": 3}' if name == "state.json" else "x")
        sizes[name] = (checkpoint / name).stat().st_size
    (checkpoint / "COMPLETE").write_text(json.dumps(sizes))
    return run


def test_eval_takes_the_runs_own_config_with_the_command_line_on_top(tmp_path: Path) -> None:
    run = fake_run(tmp_path, ["debug=smoke", "task=gsm8k", "task.prompt=question_only", "rollout.max_tokens=24"])
    overrides = ["job=eval", f"eval.model={run}", "eval.n_samples=4", "rollout.eval_temperature=1.0"]
    cfg = eval_config(composed(overrides, tmp_path / "out"), overrides, tmp_path / "out")
    assert (cfg.task.name, cfg.task.prompt, cfg.rollout.max_tokens) == ("gsm8k", "question_only", 24)
    assert (cfg.eval.n_samples, cfg.rollout.eval_temperature) == (4, 1.0)
    assert cfg.model.name == "tiny_random" and cfg.job.name == "eval"
    assert (cfg.eval.model, cfg.eval.step) == (str(run / "checkpoints" / "step_000003"), 3)
    assert cfg.output_dir == str(tmp_path / "out") and cfg.init_from is None
    # task=... on the command line: another held-out set, the same trained model.
    overrides = ["job=eval", f"eval.model={run}", "task=keyword"]
    assert eval_config(composed(overrides, tmp_path), overrides, tmp_path).task.name == "keyword"


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("model.lora.r=8", "model.lora.r=8: "),
        ("model.lora.enabled=false", "a LoRA run's checkpoint holds only its adapters"),
        ("model=smollm2_135m", "holds weights trained with model="),
    ],
)
def test_a_lora_runs_checkpoint_refuses_other_model_settings(tmp_path: Path, override: str, named: str) -> None:
    run = fake_run(tmp_path, ["debug=smoke", "model.lora.enabled=true", "model.lora.r=4"])
    overrides = ["job=eval", f"eval.model={run}", override]
    with pytest.raises(UserFacingError, match="drop the override") as error:
        eval_config(composed(overrides, tmp_path / "out"), overrides, tmp_path / "out")
    assert named in str(error.value) and "\n" not in str(error.value)
    # Where the same weights run may change.
    overrides = ["job=eval", f"eval.model={run}", "model.device=cpu"]
    assert eval_config(composed(overrides, tmp_path / "o2"), overrides, tmp_path / "o2").model.lora.r == 4


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (None, "job=eval needs eval.model="),
        ("missing", "no such directory"),
        ("empty", "is neither a run directory"),
        ("lone/checkpoints/step_000001", "has no config.yaml, which names the model"),
    ],
)
def test_eval_model_must_name_a_model(tmp_path: Path, given: str | None, message: str) -> None:
    (tmp_path / "empty").mkdir()
    lone = fake_run(tmp_path / "lone_src", ["debug=smoke"]) / "checkpoints" / "step_000003"
    (tmp_path / "lone" / "checkpoints").mkdir(parents=True)
    lone.rename(tmp_path / "lone" / "checkpoints" / "step_000001")  # a checkpoint without its run's config.yaml
    overrides = ["job=eval", *([f"eval.model={tmp_path / given}"] if given else [])]
    with pytest.raises(UserFacingError, match=message):
        eval_config(composed(overrides, tmp_path / "out"), overrides, tmp_path / "out")


def test_eval_step_picks_a_checkpoint_and_a_model_folder_loads_as_model_hf(tmp_path: Path) -> None:
    run = fake_run(tmp_path, ["debug=smoke", "task=gsm8k"])
    overrides = ["job=eval", f"eval.model={run}", "eval.step=3"]
    assert eval_config(composed(overrides, tmp_path / "a"), overrides, tmp_path / "a").eval.step == 3
    overrides = ["job=eval", f"eval.model={run}", "eval.step=5"]
    with pytest.raises(UserFacingError, match=r"eval.step=5: .* has no checkpoint of step 5: its steps are 3"):
        eval_config(composed(overrides, tmp_path / "b"), overrides, tmp_path / "b")
    # A checkpoint a kill cut short (its COMPLETE marker's sizes disagree): one line, not a traceback at loading.
    with (run / "checkpoints" / "step_000003" / "model.safetensors").open("a") as f:
        f.write("x")
    overrides = ["job=eval", f"eval.model={run}", "eval.step=3"]
    with pytest.raises(UserFacingError, match=r"eval.step=3: checkpoint .*step_000003 is damaged \(model.safetensors"):
        eval_config(composed(overrides, tmp_path / "b2"), overrides, tmp_path / "b2")
    (run / "checkpoints" / "step_000003" / "model.safetensors").write_text("x")
    # The run's exported model/: loaded as model=hf would load it, with the run's task.
    (run / "model").mkdir()
    (run / "model" / "config.json").write_text("{}")
    overrides = ["job=eval", f"eval.model={run / 'model'}"]
    cfg = eval_config(composed(overrides, tmp_path / "c"), overrides, tmp_path / "c")
    assert (cfg.model.name, cfg.model.name_or_path, cfg.task.name) == ("hf", str(run / "model"), "gsm8k")
    assert cfg.eval.model == str(run / "model") and cfg.eval.step is None
    # A folder of its own: the command line's task.
    folder = tmp_path / "exported"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    overrides = ["job=eval", f"eval.model={folder}", "task=regex_sum"]
    cfg = eval_config(composed(overrides, tmp_path / "d"), overrides, tmp_path / "d")
    assert (cfg.model.name_or_path, cfg.task.name) == (str(folder), "regex_sum")


def greedy(model: torch.nn.Module, tokenizer, prompt: str, max_tokens: int) -> str:
    """One row, transformers' own generate: the independent decode the job's outputs are checked against."""
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
        )
    return str(tokenizer.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True))


@pytest.mark.slow
def test_eval_of_a_trained_run_gives_the_trained_weights_outputs(tmp_path: Path) -> None:
    from grpo_cli.config.saved import load_saved_config
    from grpo_cli.config.schemas import ModelConfig
    from grpo_cli.models import build_policy

    run = tmp_path / "run"
    args = ["debug=smoke", "train.steps=1", "train.checkpoint_every=1", f"hydra.run.dir={run}"]
    result = run_grpo(args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = run / "checkpoints" / "step_000001"
    # Alter the trained weights (same names, shapes and sizes: the checkpoint stays complete), so that the trained
    # model's greedy outputs are predictably not the untrained model's.
    tensors = load_file(str(checkpoint / "model.safetensors"))
    generator = torch.Generator().manual_seed(7)
    altered = {name: t + 0.5 * torch.randn(t.shape, generator=generator) for name, t in tensors.items()}
    size = (checkpoint / "model.safetensors").stat().st_size
    save_file(altered, str(checkpoint / "model.safetensors"))
    assert (checkpoint / "model.safetensors").stat().st_size == size

    out = tmp_path / "eval"
    # fp32 like the independent decode below: model.mixed_precision=auto is bf16 on a CPU with AVX-512 BF16, where
    # near-tied logits of the random model round to another greedy token (seen on an AMD EPYC with it).
    eval_args = ["job=eval", f"eval.model={run}", "model.mixed_precision=no", f"hydra.run.dir={out}"]
    result = run_grpo(eval_args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "eval of run at step 1 on keyword: 4 examples" in result.stdout
    records = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert len(records) == 4  # the run's task.n_eval (debug=smoke)

    model_cfg = OmegaConf.to_object(load_saved_config(run / "config.yaml").model)
    assert isinstance(model_cfg, ModelConfig)
    untrained, tokenizer = build_policy(model_cfg, torch.device("cpu"))
    trained, _ = build_policy(model_cfg, torch.device("cpu"))
    missing, unexpected = trained.load_state_dict(altered, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # a tied head: the embedding's
    expected = [greedy(trained, tokenizer, r["prompt"], 8) for r in records]
    before = [greedy(untrained, tokenizer, r["prompt"], 8) for r in records]
    assert [r["response"] for r in records] == expected
    assert expected != before

    metrics = read_metrics(out / "metrics.jsonl")
    assert [row["step"] for row in metrics] == [1] and "eval/reward" in metrics[0]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == str(checkpoint) and summary["step"] == 1 and summary["n_prompts"] == 4

    # The silent trap closed: baseline_eval does not read init_from, and says what to use.
    result = run_grpo(["job=baseline_eval", f"init_from={run}", f"hydra.run.dir={tmp_path / 'b'}"], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"grpo-run: error: job=baseline_eval evaluates the untrained model and does not read init_from "
        f"(init_from={run}): use grpo-run job=eval eval.model=<run dir> to evaluate a trained run"
    )

    # job=report: the run and its evaluation side by side, each with its final held-out eval.
    report = tmp_path / "report"
    result = run_grpo(
        ["job=report", f"report.runs=[{run},{out}]", f"report.out={report}", f"hydra.run.dir={tmp_path / 'r'}"],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    text = (report / "report.md").read_text()
    assert "final eval reward" in text and "| run " in text and "| eval " in text

    # Resuming the finished run: no size line of steps it will not take, its final evaluation read back, `done`.
    result = run_grpo(["resume=" + str(run), f"hydra.run.dir={tmp_path / 'again'}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "size:" not in result.stdout and "resumed at step 1, the run's last (train.steps=1): nothing left" in (
        result.stdout
    )
    final = [row for row in read_metrics(run / "metrics.jsonl") if row["step"] == 1 and "eval/reward" in row]
    assert f"done: eval reward {final[0]['eval/reward']:.3f} (step 0) -> " in result.stdout
    # A final evaluation that never got logged (a stop between the last checkpoint and it) is run on resume.
    rows = [row for row in read_metrics(run / "metrics.jsonl") if not (row["step"] == 1 and "eval/reward" in row)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = run_grpo(["resume=" + str(run), f"hydra.run.dir={tmp_path / 'again2'}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "running its final evaluation" in result.stdout and "done: eval reward" in result.stdout
    assert any(row["step"] == 1 and "eval/reward" in row for row in read_metrics(run / "metrics.jsonl"))


@pytest.mark.slow
def test_a_sweep_ends_naming_its_directory_and_the_report_command(tmp_path: Path) -> None:
    # job=check_reward: a multirun of seconds (no model). Every job completed: Hydra's end-of-multirun hook.
    sweep = tmp_path / "multirun"
    result = run_grpo(["-m", "job=check_reward", "task=keyword,regex_sum", f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == (
        f"grpo-run: sweep directory {sweep}: compare its runs with grpo-run job=report report.runs={sweep}"
    )
    # A failed job: the launcher names the directory of the completed runs before its failure line.
    sweep = tmp_path / "failed"
    result = run_grpo(["-m", "job=check_reward", "rollout.max_tokens=8,0", f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout.strip().splitlines()[-1] == (
        f"grpo-run: sweep directory {sweep}: compare the completed runs with grpo-run job=report report.runs={sweep}"
    )
