"""task=custom: the user's data, template and reward functions, with no change to the package.

The adapters, sources and checks are tested directly (milliseconds each); the end-to-end tests run the real
`grpo-run` on user files in a temporary folder, with several cases combined in each invocation.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from grpo_cli.errors import RewardFunctionError, UserFacingError
from grpo_cli.rollout.rewards import reward_metrics, score_responses
from grpo_cli.tasks import load_examples, make_reward_fn, validate_task_config
from grpo_cli.tasks.base import TaskDataError
from grpo_cli.tasks.custom import CustomTaskConfig, absolutize_paths
from grpo_cli.usercode.user_code import UserCodeError
from tests.conftest import REPO_ROOT, compose_config

SEED_003_REWARDS = REPO_ROOT / "examples" / "medcalc_trl" / "rewards.py"

REWARDS_PY = """
import math

def format_reward(completions, **kwargs):
    return [1.0 if c.startswith("<") else 0.0 for c in completions]

def has_word(prompts, completions, word, **kwargs):
    # TRL convention with an extra column; None: no reward for rows marked "skip"
    return [None if w == "skip" else float(w in c) for c, w in zip(completions, word)]

def length_over(response, row):
    return float(len(response) > row["min_len"])

def raises(completions, **kwargs):
    return [1 / 0 if "boom" in c else 1.0 for c in completions]

def nan(completions, **kwargs):
    return [math.nan for _ in completions]

def text(completions, **kwargs):
    return ["high" for _ in completions]

def short(completions, **kwargs):
    return [1.0]

def hangs(completions, **kwargs):
    while True:  # a Python loop: the time limit interrupts it (one long C call, like time.sleep, it cannot)
        pass

def two_args(x, y):
    return 1.0
"""


def write(folder: Path, files: dict[str, str]) -> Path:
    for name, body in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(body).lstrip())
    return folder


def rows_jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def custom_cfg(folder: Path, **keys) -> CustomTaskConfig:
    cfg = CustomTaskConfig(
        name="custom", train_path="train.jsonl", eval_path="train.jsonl", template="{q}", prompt="question_only"
    )
    for key, value in keys.items():
        setattr(cfg, key, value)
    absolutize_paths(cfg, folder)
    return cfg


@pytest.fixture
def user_folder(tmp_path):
    rows = [{"q": f"question {i}", "word": ["a", "b", "skip"][i % 3], "min_len": 3} for i in range(6)]
    return write(tmp_path, {"rewards.py": REWARDS_PY, "train.jsonl": rows_jsonl(rows)})


# ---------------------------------------------------------------------------------------------- adapters


def test_a_trl_reward_gets_prompts_completions_and_the_columns_and_none_means_no_reward(user_folder):
    cfg = custom_cfg(
        user_folder,
        rewards={"fmt": "rewards.py:format_reward", "word": "rewards.py:has_word"},
        reward_weights={"fmt": 0.5},
        prompt="question_only",
    )
    validate_task_config(cfg)
    truths = [e.ground_truth for e in load_examples(cfg, "train")[:3]]  # words a, b, skip
    assert truths[0] == {"q": "question 0", "word": "a", "min_len": 3, "prompt": "question 0"}
    scores = score_responses(make_reward_fn(cfg), ["<a", "a", "<b"], truths, [2, 1, 2])
    # fmt (weight 0.5): 1, 0, 1; word (weight 1, none given): 1, 0, None
    assert [r["reward"] for r in scores.rewards] == [1.5, 0.0, 0.5]
    assert "reward/word" not in scores.rewards[2]
    metrics = reward_metrics(scores, "train")
    assert metrics["train/reward/fmt"] == pytest.approx(2 / 3)
    assert metrics["train/reward/word"] == 0.5  # the mean over the two samples it rewarded (TRL's nanmean)
    assert metrics["train/reward_errors"] == 0


def test_seed_003s_reward_functions_run_as_written(tmp_path):
    rows = [{"note": "BMI?", "Ground Truth Answer": "26.122"}]
    write(tmp_path, {"train.jsonl": rows_jsonl(rows)})
    cfg = custom_cfg(
        tmp_path,
        prompt="question_only",
        template="{note}",
        rename_columns={"Ground Truth Answer": "references"},
        rewards={"fmt": f"{SEED_003_REWARDS}:format_reward", "num": f"{SEED_003_REWARDS}:numeric_tolerance_reward"},
        answer_from="num",
        format_from="fmt",
    )
    validate_task_config(cfg)
    truth = load_examples(cfg, "train")[0].ground_truth
    reward = make_reward_fn(cfg)
    both = reward("<think>80/1.75^2</think> <answer>26.12</answer>", truth)
    assert (both["reward"], both["format_reward"], both["answer_reward"]) == (2.0, 1.0, 1.0)
    far = reward("<think>x</think><answer>30</answer>", truth)
    assert (far["reward"], far["answer_reward"], far["correctness"]) == (1.0, 0.0, 0.0)


def test_text_data_under_chat_reaches_a_trl_function_as_text_as_trl_passes_a_standard_dataset(user_folder):
    # TRL's rule: completions are messages exactly when the data is conversational, whatever the prompt style
    # (tests/unit/tasks/test_trl_compat.py has the conversational side).
    cfg = custom_cfg(user_folder, rewards={"fmt": "rewards.py:format_reward"}, system_prompt="Be brief.", prompt="chat")
    example = load_examples(cfg, "train")[0]
    assert example.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "question 0"}]
    assert example.ground_truth["prompt"] == "Be brief.\n\nquestion 0"  # prompts=: the prompt as text
    assert make_reward_fn(cfg)("<x", example.ground_truth)["reward"] == 1.0  # c.startswith on a string


def test_a_per_sample_reward_gets_the_response_and_the_row(user_folder):
    cfg = custom_cfg(user_folder, rewards={"len": "rewards.py:length_over"}, reward_convention="per_sample")
    truth = load_examples(cfg, "train")[0].ground_truth
    scores = score_responses(make_reward_fn(cfg), ["ab", "abcd"], [truth, truth])
    assert [r["reward"] for r in scores.rewards] == [0.0, 1.0]


@pytest.mark.parametrize(
    ("function", "said"),
    [
        ("raises", "raised ZeroDivisionError: division by zero on row"),
        ("nan", "returned nan on row"),
        ("text", "returned 'high' (str), not a number on row"),
        ("short", "returned 1 values for 2 completions"),
        ("hangs", "ran past task.reward_timeout_s=0.2s"),
    ],
)
def test_bad_reward_code_stops_with_one_line_naming_the_function_and_row_or_is_skipped(user_folder, function, said):
    stop = custom_cfg(user_folder, rewards={"bad": f"rewards.py:{function}"}, reward_timeout_s=0.2)
    truths = [e.ground_truth for e in load_examples(stop, "train")[:2]]
    with pytest.raises(RewardFunctionError) as info:
        score_responses(make_reward_fn(stop), ["boom", "fine"], truths)
    message = str(info.value)
    assert "\n" not in message and f"task.rewards.bad={user_folder / 'rewards.py'}:{function}" in message
    assert said in message and '"q": "question 0"' in message and "task.on_reward_error=skip" in message

    skip = custom_cfg(
        user_folder,
        rewards={"bad": f"rewards.py:{function}", "fmt": "rewards.py:format_reward"},
        reward_timeout_s=0.2,
        on_reward_error="skip",
    )
    scores = score_responses(make_reward_fn(skip), ["boom", "<fine"], truths)
    failed = scores.n_timeouts if function == "hangs" else scores.n_errors
    # raises: only "boom" fails (the batch is retried one sample at a time); the others fail on both
    assert failed == (1 if function == "raises" else 2)
    assert [r["reward"] for r in scores.rewards] == [0.0, 2.0] if function == "raises" else [0.0, 1.0]


# ----------------------------------------------------------------------------------- checks before loading


@pytest.mark.parametrize(
    ("keys", "said"),
    [
        ({"rewards": {"r": "nope.py:f"}}, "no such file"),
        ({"rewards": {"r": "rewards.py:missing"}}, "has no function missing (it defines format_reward"),
        ({"rewards": {"r": "no_such_pkg.mod:f"}}, "no module named no_such_pkg"),
        ({"rewards": {"r": "rewards.py"}}, "give a function as path/to/file.py:function"),
        ({"rewards": {"r": "rewards.py:two_args"}}, "takes no completions= argument"),
        ({"rewards": {"r": "rewards.py:format_reward"}, "reward_convention": "per_sample"}, "cannot be called"),
        ({"rewards": {"r": "broken.py:f"}}, "SyntaxError at broken.py:1"),
        ({"rewards": {"r": "rewards.py:format_reward"}, "reward_weights": {"typo": 1.0}}, "no reward named typo"),
        ({"rewards": {}}, "task=custom has no reward"),
        ({"rewards": {"r": "rewards.py:format_reward"}, "answer_from": "x"}, "task.answer_from=x"),
    ],
)
def test_bad_user_code_is_one_line_before_anything_loads(user_folder, keys, said):
    (user_folder / "broken.py").write_text("def f(:\n")
    cfg = custom_cfg(user_folder, **keys)
    with pytest.raises(UserFacingError) as info:
        validate_task_config(cfg)
    assert said in str(info.value) and "\n" not in str(info.value)


def test_a_template_column_the_data_lacks_and_a_trl_argument_no_column_fills_fail_when_data_is_read(user_folder):
    cfg = custom_cfg(user_folder, rewards={"fmt": "rewards.py:format_reward"}, template="{question}")
    with pytest.raises(TaskDataError, match=r"task.template reads column 'question', which task.train_path=.* row 0"):
        load_examples(cfg, "train")
    write(user_folder, {"needs.py": "def f(completions, answer):\n    return [1.0]\n"})
    cfg = custom_cfg(user_folder, rewards={"needs": "needs.py:f"})
    with pytest.raises(UserCodeError, match=r"cannot take TRL's arguments .* missing a required argument: 'answer'"):
        load_examples(cfg, "train")


def test_module_rewards_import_from_the_directory_grpo_run_started_in(tmp_path, monkeypatch):
    write(
        tmp_path,
        {
            "mypkg_custom_t/__init__.py": "",
            "mypkg_custom_t/scoring.py": "def f(completions, **k):\n    return [2.0 for _ in completions]\n",
            "train.jsonl": rows_jsonl([{"q": "x"}]),
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # removed again after the test (the loader adds base_dir itself)
    cfg = custom_cfg(tmp_path, rewards={"m": "mypkg_custom_t.scoring:f"})
    assert cfg.rewards["m"] == "mypkg_custom_t.scoring:f" and cfg.base_dir == str(tmp_path)
    assert make_reward_fn(cfg)("y", load_examples(cfg, "train")[0].ground_truth)["reward"] == 2.0


def test_check_reward_runs_the_users_cases_and_a_disagreeing_one_fails_the_job(user_folder, tmp_path):
    import io

    from rich.console import Console

    from grpo_cli.jobs.check_reward import run as check_reward

    cases = [
        {"q": "x", "word": "a", "min_len": 3, "response": "<a", "expected": 2.0},
        {"q": "x", "word": "a", "min_len": 3, "response": "b", "expected": 1.0, "why": "deliberately wrong"},
    ]
    (user_folder / "cases.jsonl").write_text(rows_jsonl(cases))
    rewards = {"fmt": "rewards.py:format_reward", "word": "rewards.py:has_word"}
    cfg = compose_config(["job=check_reward", "task=custom", f"task.base_dir={user_folder}"])
    cfg.task = custom_cfg(user_folder, rewards=rewards, cases_path="cases.jsonl")
    out = Console(file=io.StringIO(), width=200, highlight=False)
    with pytest.raises(UserFacingError, match=r"1 of 2 reward sanity cases of task=custom disagree \(rows 2\)"):
        check_reward(cfg, tmp_path, out)
    table = out.file.getvalue()
    assert "fmt=1 word=1" in table and "DIFFERS" in table and "deliberately wrong" in table


# ------------------------------------------------------------------------------------------------ sources


def test_every_data_source_gives_the_same_rows(tmp_path):
    import datasets

    rows = [{"q": "one", "a": "1"}, {"q": "two", "a": "2"}]
    write(
        tmp_path,
        {
            "d.jsonl": rows_jsonl(rows),
            "d.csv": "q,a\none,1\ntwo,2\n",
            "gen.py": (
                "def make(n, seed):\n    return [{'q': w, 'a': str(i + 1)} for i, w in enumerate(['one', 'two'][:n])]\n"
            ),
            "rewards.py": REWARDS_PY,
        },
    )
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "ds"))
    sources = [
        {"train_path": "d.jsonl"},
        {"train_path": "d.csv"},
        {"train_path": "d.parquet"},
        {"train_path": None, "dataset": "ds", "split": "train"},
        {"train_path": None, "generator": "gen.py:make"},
    ]
    for source in sources:
        cfg = custom_cfg(
            tmp_path, rewards={"f": "rewards.py:format_reward"}, template="Q: {q}", prompt="chat", **source
        )
        examples = load_examples(cfg, "train")
        assert [e.ground_truth["a"] for e in examples] == ["1", "2"], source
        assert examples[0].prompt == [{"role": "user", "content": "Q: one"}], source


def test_the_generator_is_called_with_n_and_a_seed_per_split(tmp_path):
    write(
        tmp_path,
        {
            "gen.py": "def make(n, seed):\n    return [{'q': f'{seed}-{i}'} for i in range(n)]\n",
            "rewards.py": REWARDS_PY,
        },
    )
    cfg = custom_cfg(
        tmp_path,
        rewards={"f": "rewards.py:format_reward"},
        train_path=None,
        eval_path=None,
        generator="gen.py:make",
        n_train=3,
        n_eval=2,
        data_seed=7,
    )
    assert [e.ground_truth["q"] for e in load_examples(cfg, "train")] == ["7-0", "7-1", "7-2"]
    assert [e.ground_truth["q"] for e in load_examples(cfg, "eval")] == ["8-0", "8-1"]


# ---------------------------------------------------------------------------------------------- reward model


def save_tiny_classifier(folder: Path, labels: tuple[str, ...] = ("NEGATIVE", "POSITIVE")) -> Path:
    """A randomly initialised 2-label Llama classifier with the project's tiny tokenizer, saved like a hub model."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from grpo_cli.models import TINY_RANDOM, load_tokenizer

    tokenizer = load_tokenizer(TINY_RANDOM)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={label: i for i, label in enumerate(labels)},
    )
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_reward_model_scores_the_probability_of_its_label_batched_and_truncated(user_folder):
    model_dir = save_tiny_classifier(user_folder / "clf")
    cfg = custom_cfg(user_folder, reward_model=CustomTaskConfig().reward_model)
    cfg.reward_model.path, cfg.reward_model.label, cfg.reward_model.batch_size = "clf", "NEGATIVE", 2
    validate_task_config(cfg)
    truths = [e.ground_truth for e in load_examples(cfg, "train")[:3]]
    long = "very long " * 200  # past the classifier's 64 positions: truncated, not an error
    scores = score_responses(make_reward_fn(cfg), ["good", "bad", long], truths)
    values = [r["reward/reward_model"] for r in scores.rewards]
    assert all(0 < v < 1 for v in values) and len(set(values)) == 3

    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model, tokenizer = (
        AutoModelForSequenceClassification.from_pretrained(model_dir),
        AutoTokenizer.from_pretrained(model_dir),
    )
    with torch.no_grad():
        logits = model(**tokenizer(["bad"], return_tensors="pt")).logits
    assert values[1] == pytest.approx(torch.softmax(logits, -1)[0, 0].item(), abs=1e-5)


def test_a_reward_model_that_is_no_classifier_or_lacks_the_label_is_one_line(user_folder):
    from transformers import LlamaConfig

    save_tiny_classifier(user_folder / "clf")
    LlamaConfig(architectures=["LlamaForCausalLM"]).save_pretrained(user_folder / "lm")
    for path, label, said in (
        ("lm", "NEGATIVE", "is a LlamaForCausalLM, not a sequence-classification model"),
        ("clf", "NEG", "task.reward_model.label=NEG: "),
        ("clf", None, "has 2 labels (NEGATIVE, POSITIVE): name the one"),
        ("missing_dir", "NEGATIVE", "cannot read a model config there"),
    ):
        cfg = custom_cfg(user_folder)
        cfg.reward_model.path, cfg.reward_model.label = str(user_folder / path), label
        with pytest.raises(UserFacingError, match=re.escape(said)):
            validate_task_config(cfg)


# ------------------------------------------------------------------------------------------- end to end
