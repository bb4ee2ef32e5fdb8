"""The card (parsed by huggingface_hub's own loader, its fields there, nothing of the machine), the push up to the
network boundary (offline and tokenless for real, the Hub's API mocked at HfApi for the rest), the one-line errors
of a bad run directory, and <run>/model/ at the end of a run: which endings write it."""

from __future__ import annotations

import json
import shutil
import socket

import pytest
from huggingface_hub import HfApi, ModelCard

from grpo_cli.config.schemas import ExportConfig
from grpo_cli.errors import EXIT_INTERNAL_ERROR, EXIT_SIGINT, RunStopped, UserFacingError
from grpo_cli.export import export_checkpoint, find_checkpoint
from grpo_cli.export.hub import push_folder
from grpo_cli.export.run_end import with_model_at_end
from tests.conftest import compose_config
from tests.unit.export.test_export_round_trip import make_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory with a checkpoint, its metrics.jsonl (evaluations at steps 0, 1, 2) and a run_info.json
    holding what a card must not show: the host, the pid, absolute paths in the command."""
    run = tmp_path_factory.mktemp("export") / "run"
    make_run(run, ["task.prompt=question_only", "rollout.stop=[END]"])
    rows = [
        {"step": 0, "eval/reward": 0.125, "eval/format_reward": 0.5},
        {"step": 1, "train/reward": 0.25},
        {"step": 1, "eval/reward": 0.375, "eval/format_reward": 0.75},
        {"step": 2, "train/reward": 0.5},
        {"step": 2, "eval/reward": 0.625, "eval/format_reward": 1.0},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    info = {
        "command": f"grpo-run debug=smoke hydra.run.dir={run} task.train_path=/home/someone/data/train.jsonl",
        "git": {"commit": "0123abcd" * 5, "dirty": False},
        "pid": 424242,
        "host": socket.gethostname(),
    }
    (run / "run_info.json").write_text(json.dumps(info))
    return run


@pytest.fixture(scope="module")
def exported(run_dir):
    return export_checkpoint(find_checkpoint(run_dir), ExportConfig())


def test_the_card_parses_and_says_what_the_model_is(exported, run_dir):
    card = ModelCard.load(exported.folder / "README.md")
    assert card.data.library_name == "transformers"
    assert "grpo-cli" in card.data.tags and "task:keyword" in card.data.tags
    assert card.data.base_model is None  # tiny_random has no hub id: named in the text instead
    text = card.text
    assert "randomly initialised 2-layer" in text and "not a language model" in text
    assert "0123abcd" * 5 in text  # the commit; the version too
    assert "task.prompt=question_only" in text and "['END']" in text  # the prompt format and the stop strings
    assert "render_prompts" in text and 'make_prompt("<your question>", "question_only")' in text
    assert "| eval/reward | 0.125 | 0.625 |" in text  # the first and the last evaluation
    assert "| train/reward | 0.25 | 0.5 |" in text  # the reward curve
    assert "1 iff all keywords present" in text  # what the reward rewards
    assert "reward hacking" in text
    assert "task.train_path=.../train.jsonl" in text  # the command, its paths cut
    # nothing of the machine: no absolute path, host name or pid
    everything = (exported.folder / "README.md").read_text()
    assert str(run_dir) not in everything and "/home/someone" not in everything and "/tmp" not in everything
    assert socket.gethostname() not in everything and "424242" not in everything


def test_generation_config_holds_the_trained_sampling(exported):
    generation = json.loads((exported.folder / "generation_config.json").read_text())
    cfg = compose_config(["debug=smoke"])
    assert generation["temperature"] == cfg.rollout.temperature and generation["top_p"] == cfg.rollout.top_p
    assert generation["max_new_tokens"] == cfg.rollout.max_tokens and generation["do_sample"] is True
    assert generation["stop_strings"] == ["END"]
    assert generation["eos_token_id"] is not None


def test_the_exported_files_hold_no_absolute_path(exported, run_dir):
    for file in exported.folder.iterdir():
        if file.suffix in (".json", ".md", ".jinja"):
            assert str(run_dir) not in file.read_text(), file.name


class Calls:
    """Records the Hub API's calls at the HfApi boundary; whoami answers as user "me"."""

    def __init__(self, monkeypatch, exists: bool = False, upload_fails: bool = False):
        self.calls: list[tuple[str, tuple, dict]] = []
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
        monkeypatch.setattr("huggingface_hub.get_token", lambda: "hf_fake")

        def record(name, result=None, error=None):
            def call(_self, *args, **kwargs):
                self.calls.append((name, args, kwargs))
                if error is not None:
                    raise error
                return result

            monkeypatch.setattr(HfApi, name, call)

        record("whoami", {"name": "me", "orgs": [{"name": "my-org"}]})
        record("repo_exists", exists)
        record("create_repo", "https://huggingface.co/me/x")
        record("upload_folder", None, OSError("connection reset") if upload_fails else None)
        record("delete_repo")

    def names(self) -> list[str]:
        return [name for name, _, _ in self.calls]


def test_push_offline_is_one_line_and_nothing_uploaded(exported, monkeypatch):
    calls = []
    monkeypatch.setattr(HfApi, "upload_folder", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(HfApi, "create_repo", lambda *a, **k: calls.append(a))
    with pytest.raises(UserFacingError, match="HF_HUB_OFFLINE=1 is set: nothing was uploaded") as error:
        push_folder(exported.folder, "me/x", private=True)  # the conftest's real HF_HUB_OFFLINE=1
    assert "\n" not in str(error.value) and not calls


def test_push_without_a_token_is_one_line_and_nothing_uploaded(exported, monkeypatch, tmp_path):
    calls = []
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr("huggingface_hub.constants.HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))
    monkeypatch.setattr(HfApi, "upload_folder", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(HfApi, "whoami", lambda *a, **k: calls.append(a))
    with pytest.raises(UserFacingError, match="no Hugging Face token") as error:
        push_folder(exported.folder, "me/x", private=True)
    assert "\n" not in str(error.value) and not calls


def test_push_to_a_namespace_not_ours_uploads_nothing(exported, monkeypatch):
    calls = Calls(monkeypatch)
    with pytest.raises(UserFacingError, match="cannot write to someone-else's repos"):
        push_folder(exported.folder, "someone-else/x", private=True)
    assert calls.names() == ["whoami"]


def test_push_creates_a_private_repo_and_uploads_in_one_commit(exported, monkeypatch):
    calls = Calls(monkeypatch)
    assert push_folder(exported.folder, "my-org/x", private=True) == "https://huggingface.co/my-org/x"
    assert calls.names() == ["whoami", "repo_exists", "create_repo", "upload_folder"]
    _, args, kwargs = calls.calls[2]
    assert args == ("my-org/x",) and kwargs["private"] is True
    assert calls.calls[3][2]["folder_path"] == exported.folder


def test_a_failed_upload_removes_the_repo_it_created(exported, monkeypatch):
    calls = Calls(monkeypatch, upload_fails=True)
    with pytest.raises(UserFacingError, match="the upload failed .*nothing was uploaded"):
        push_folder(exported.folder, "me/x", private=False)
    assert calls.names()[-1] == "delete_repo"
    existing = Calls(monkeypatch, exists=True, upload_fails=True)
    with pytest.raises(UserFacingError):
        push_folder(exported.folder, "me/x", private=False)
    assert "delete_repo" not in existing.names()  # a repo that was there before is left as it was


def test_bad_run_directories_are_one_line(tmp_path, run_dir):
    with pytest.raises(UserFacingError, match="no such directory"):
        find_checkpoint(tmp_path / "nowhere")
    with pytest.raises(UserFacingError, match="has no config.yaml"):
        find_checkpoint(tmp_path)
    with pytest.raises(UserFacingError, match="has no checkpoint of step 7: its steps are 2"):
        find_checkpoint(run_dir, step=7)
    with pytest.raises(UserFacingError, match="export.max_shard_size=abc: .*give a size such as 5GB"):
        export_checkpoint(find_checkpoint(run_dir), ExportConfig(max_shard_size="abc"), out=tmp_path / "never")
    assert not (tmp_path / "never").exists()
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    (damaged / "checkpoints" / "step_000001").mkdir(parents=True)
    with pytest.raises(UserFacingError, match=r"no complete checkpoint \(1 incomplete, the newest step_000001\)"):
        find_checkpoint(damaged)
    shutil.copytree(run_dir / "checkpoints" / "step_000002", damaged / "checkpoints" / "step_000002")
    with (damaged / "checkpoints" / "step_000002" / "model.safetensors").open("ab") as f:
        f.write(b"x")
    with pytest.raises(UserFacingError, match=r"step_000002 is damaged \(model.safetensors has"):
        find_checkpoint(damaged, step=2)


@pytest.mark.parametrize(
    ("ending", "written"),
    [
        ("normal", True),
        ("sigint", True),
        ("at_end_false", False),
        ("crash", False),
        ("second_ctrl_c", False),
        ("user_error", False),
    ],
)
def test_which_endings_write_model(run_dir, tmp_path, ending, written, capsys):
    """Every stop that saved a checkpoint writes <run>/model/ (here the run's own checkpoint stands for it); a bug,
    a second Ctrl-C, a user error and export.at_end=false do not."""
    from rich.console import Console

    run = tmp_path / "run"
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns("model"))
    cfg = compose_config(["debug=smoke"] + (["export.at_end=false"] if ending == "at_end_false" else []), str(run))

    def launch():
        if ending == "sigint":
            raise RunStopped("stopped by SIGINT after step 2", exit_code=EXIT_SIGINT)
        if ending == "crash":
            raise RunStopped("rank 1 failed", exit_code=EXIT_INTERNAL_ERROR)
        if ending == "second_ctrl_c":
            raise KeyboardInterrupt
        if ending == "user_error":
            raise UserFacingError("bad")
        return {"eval/reward": 0.5}

    console = Console(width=200)
    if ending in ("normal", "at_end_false"):
        assert with_model_at_end(launch, cfg, run, console) == {"eval/reward": 0.5}
    else:
        with pytest.raises((RunStopped, KeyboardInterrupt, UserFacingError)):
            with_model_at_end(launch, cfg, run, console)
    assert (run / "model" / "config.json").exists() == written
    out = capsys.readouterr().out
    if written:
        assert f"model: {run / 'model'} (the full model, float32, checkpoint step 2;" in out
        assert f"evaluate: grpo-run job=eval eval.model={run}" in out
        assert f"export:   grpo-run job=export export.run={run} export.push_to_hub=<you>/<name>" in out
        assert f"serve:    vllm serve {run / 'model'}" in out
    else:
        assert "model:" not in out


def test_a_tool_task_card_holds_its_tools_as_the_model_saw_them(tmp_path):
    from grpo_cli.episodes.tools import load_tools, prompt_for_schemas
    from grpo_cli.models import TINY_RANDOM, load_tokenizer

    make_run(tmp_path / "run", ["task=gsm8k_tools"])
    card = ModelCard.load(export_checkpoint(find_checkpoint(tmp_path / "run"), ExportConfig()).folder / "README.md")
    assert "A multi-turn task: tools ['calculator']" in card.text
    tools = load_tools({"calculator": "grpo_cli.episodes.builtin_tools:calculator"}, tmp_path)
    schema = tools["calculator"].schema
    assert repr(schema["function"]["name"]) in card.text and schema["function"]["description"] in card.text
    # the card's snippet, run: the same text as the episodes' tools prompt renders
    snippet = card.text.split("from grpo_cli.episodes.tools import prompt_for_schemas", 1)[1].split("```", 1)[0]
    tokenizer = load_tokenizer(TINY_RANDOM)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    scope = {"tokenizer": tokenizer, "messages": messages, "prompt_for_schemas": prompt_for_schemas}
    exec(snippet, scope)  # noqa: S102 - the card's own code
    expected = prompt_for_schemas(tokenizer, [schema], None).render(
        tokenizer, messages, tokenize=False, add_generation_prompt=True
    )
    assert scope["text"] == expected and "calculator" in expected


def test_the_cards_prompt_snippet_renders_from_the_folder_as_training_did(tmp_path):
    """The card's snippet, run against the exported folder (its saved tokenizer and chat template), gives the ids
    the run's rollouts rendered from the run's own tokenizer."""
    from grpo_cli.engines.base import render_prompts
    from grpo_cli.models import TINY_RANDOM, load_tokenizer
    from grpo_cli.tasks import get_task

    make_run(tmp_path / "run", ["task.prompt=chat"])
    folder = export_checkpoint(find_checkpoint(tmp_path / "run"), ExportConfig()).folder
    text = ModelCard.load(folder / "README.md").text
    snippet = "from transformers import AutoTokenizer" + text.split("from transformers import AutoTokenizer", 1)[1]
    snippet = snippet.split("```", 1)[0].replace("<this folder>", str(folder)).replace("<your question>", "Use river.")
    scope: dict = {}
    exec(snippet, scope)  # noqa: S102 - the card's own code
    trained = render_prompts([get_task("keyword").make_prompt("Use river.", "chat")], load_tokenizer(TINY_RANDOM))[0]
    assert list(scope["input_ids"]) == list(trained) and len(trained) > 5
