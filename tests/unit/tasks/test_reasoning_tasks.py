"""MATH and GSM8K tasks: data in both formats from local JSONL, the hub path (faked), errors, prompts, rewards."""

import json
import sys

import pytest

from grpo_cli.config import validate_config
from grpo_cli.errors import UserFacingError
from grpo_cli.tasks import (
    TaskDataError,
    get_task,
    load_examples,
    make_reward_fn,
    prompt_stop_strings,
    stop_strings,
)
from grpo_cli.tasks.base import R1_ZERO_TEMPLATE
from grpo_cli.tasks.reasoning import gsm8k_final_answer
from tests.conftest import FIXTURES, FakeDatasets, compose_config


def task_config(task: str, *overrides: str):
    return compose_config([f"task={task}", *overrides]).task


def test_gsm8k_jsonl_reads_the_number_after_the_four_hashes():
    examples = load_examples(task_config("gsm8k", f"task.eval_path={FIXTURES / 'gsm8k_sample.jsonl'}"), "eval")
    assert len(examples) == 20
    assert [e.ground_truth for e in examples[:3]] == ["72", "43", "260"]
    assert examples[-1].ground_truth == "13000"
    first = examples[0]
    assert first.prompt == R1_ZERO_TEMPLATE.format(question=first.meta["question"])
    assert first.prompt.endswith("Assistant: <think>")


def test_math_jsonl_reads_boxed_solutions_and_answer_fields():
    boxed = load_examples(task_config("math", f"task.eval_path={FIXTURES / 'math12k_sample.jsonl'}"), "eval")
    assert [e.ground_truth for e in boxed] == [
        "\\frac{5}{6}",
        "4",
        "6\\sqrt{2}",
        "720",
        "[3, \\infty)",
        "(4, 1)",
    ]
    assert boxed[0].meta == {
        "question": "What is the value of $\\frac{1}{2} + \\frac{1}{3}$?",
        "level": "Level 1",
        "type": "Prealgebra",
    }
    answers = load_examples(task_config("math", f"task.eval_path={FIXTURES / 'math500_sample.jsonl'}"), "eval")
    assert [e.ground_truth for e in answers] == ["15", "\\frac{1}{3}", "-7", "6", "6", "12"]
    assert answers[0].meta["unique_id"] == "fixture/0.json"


def test_n_eval_and_question_only_prompt():
    cfg = task_config(
        "math", f"task.eval_path={FIXTURES / 'math500_sample.jsonl'}", "task.n_eval=2", "task.prompt=question_only"
    )
    examples = load_examples(cfg, "eval")
    assert len(examples) == 2 and examples[0].prompt == "Compute $\\dbinom{6}{2}$."


@pytest.mark.parametrize(("task", "name"), [("math", "math500_sample.jsonl"), ("gsm8k", "gsm8k_sample.jsonl")])
def test_worked_solutions_earn_full_reward_under_question_only(task, name):
    # the worked solution of each fixture row ends in \boxed{} (MATH) or "#### n" (GSM8K): graded against
    # the ground truth the loader produced, every one must score 1
    reward = make_reward_fn(task_config(task, "task.prompt=question_only"))
    rows = [json.loads(line) for line in (FIXTURES / name).read_text().splitlines()]
    examples = load_examples(task_config(task, f"task.eval_path={FIXTURES / name}"), "eval")
    for row, example in zip(rows, examples, strict=True):
        solution = row["solution"] if task == "math" else row["answer"]
        assert reward(solution, example.ground_truth)["reward"] == 1.0, solution


@pytest.mark.parametrize(
    ("task", "line", "message"),
    [
        ("math", '{"problem": "1+1?"}', "missing field 'answer'"),
        ("math", '{"question": "1+1?"}', "missing field 'problem'"),
        ("math", '{"problem": "1+1?", "solution": "It is 2."}', "field 'solution' has no \\boxed{...}"),
        ("math", '{"problem": "", "answer": "2"}', "field 'problem' must be a non-empty string"),
        ("gsm8k", '{"question": "1+1?", "answer": "It is 2."}', "has no '#### <number>'"),
        ("gsm8k", '{"answer": "#### 2"}', "missing field 'question'"),
        ("gsm8k", '{"question": "1+1?"', "not valid JSON"),
        ("gsm8k", "[1, 2]", "expected a JSON object per line"),
    ],
)
def test_bad_lines_name_the_file_the_line_and_the_field(tmp_path, task, line, message):
    path = tmp_path / "data.jsonl"
    good = '{"problem": "2+2?", "answer": "4"}' if task == "math" else '{"question": "2+2?", "answer": "#### 4"}'
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(TaskDataError) as info:
        load_examples(task_config(task, f"task.eval_path={path}"), "eval")
    assert str(info.value).startswith(f"{path}:3: ")
    assert message in str(info.value)
    assert isinstance(info.value, UserFacingError) and "\n" not in str(info.value)


def test_gsm8k_final_answer_drops_thousands_separators():
    assert gsm8k_final_answer("... so 1,000 + 234 = 1,234.\n#### 1,234") == "1234"


def test_hub_path_loads_the_configured_dataset_and_split(monkeypatch):
    monkeypatch.setattr("grpo_cli.tasks.hub.hub_dataset_cached", lambda name: True)  # the fake: a cached copy
    fake = FakeDatasets([{"question": "2+2?", "answer": "#### 4"}, {"question": "3+3?", "answer": "#### 6"}])
    monkeypatch.setitem(sys.modules, "datasets", fake)
    examples = load_examples(task_config("gsm8k", "task.n_eval=1"), "eval")
    assert fake.calls == [("openai/gsm8k", "main", "test")]
    assert [e.ground_truth for e in examples] == ["4"]

    fake = FakeDatasets([{"problem": "1+1?", "answer": "2", "level": 1}, {"problem": "2+2?", "solution": "\\boxed{4}"}])
    monkeypatch.setitem(sys.modules, "datasets", fake)
    examples = load_examples(task_config("math", "task.hub_dataset=me/my-math", "task.hub_train_split=all"), "train")
    assert fake.calls == [("me/my-math", None, "all")]
    assert [(e.ground_truth, e.meta.get("level")) for e in examples] == [("2", 1), ("4", None)]


def test_hub_rows_with_a_missing_field_name_the_dataset_and_row(monkeypatch):
    monkeypatch.setattr("grpo_cli.tasks.hub.hub_dataset_cached", lambda name: True)  # the fake: a cached copy
    monkeypatch.setitem(sys.modules, "datasets", FakeDatasets([{"problem": "1+1?"}]))
    with pytest.raises(TaskDataError, match=r"hiyouga/math12k split 'test' row 0: missing field 'answer'"):
        load_examples(task_config("math"), "eval")


def test_offline_without_a_path_is_one_line_that_says_to_pass_eval_path():
    # the real `datasets`, offline (conftest sets HF_DATASETS_OFFLINE=1): nothing reaches the network
    with pytest.raises(TaskDataError) as info:
        load_examples(task_config("gsm8k"), "eval")
    message = str(info.value)
    assert "cannot load openai/gsm8k (main) split 'test' from the Hugging Face hub" in message
    assert message.endswith("pass a local JSONL file with task.eval_path=...")
    assert "\n" not in message


def test_r1_zero_stops_at_the_closing_answer_tag():
    assert prompt_stop_strings("r1_zero") == ("</answer>",)
    assert prompt_stop_strings("question_only") == prompt_stop_strings("chat") == ()
    assert stop_strings(["\n\n", "</answer>"], "r1_zero") == ("\n\n", "</answer>")  # no duplicates
    assert stop_strings([], "chat") == ()


@pytest.mark.parametrize("task", ["math", "gsm8k"])
@pytest.mark.parametrize("prompt", ["r1_zero", "question_only"])
def test_sanity_cases_score_as_documented(task, prompt):
    spec = get_task(task)
    reward = make_reward_fn(task_config(task, f"task.prompt={prompt}"))
    cases = spec.cases_for(prompt)
    assert {c.expected_reward for c in cases} == {0.0, 1.0}
    for case in cases:
        assert reward(case.response, case.ground_truth)["reward"] == case.expected_reward, case.why


def test_numeric_close_rewards_near_answers_when_weighted():
    cfg = task_config("gsm8k", "task.reward_weights.correctness=1", "task.reward_weights.numeric_close=0.5")
    validate_config(compose_config(["task=gsm8k", "task.reward_weights.numeric_close=0.5"]))
    reward = make_reward_fn(cfg)
    exact = reward("</think> <answer>1000</answer>", "1000")
    close = reward("</think> <answer>1005</answer>", "1000")  # within 1%
    far = reward("</think> <answer>1100</answer>", "1000")
    assert (exact["reward"], close["reward"], far["reward"]) == (1.5, 0.5, 0.0)
    assert close["reward/numeric_close"] == 1.0 and close["reward/correctness"] == 0.0
    assert close["answer_reward"] == 0.0  # the task's own answer_reward is unchanged


def test_math_has_no_numeric_close_component():
    with pytest.raises(UserFacingError, match="task=math has no numeric_close component"):
        validate_config(compose_config(["task=math", "task.reward_weights.numeric_close=1"]))
