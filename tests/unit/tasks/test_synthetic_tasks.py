"""lipogram, json and regex_sum: reward rules, deterministic data, options, local JSONL."""

import json
import re

import pytest

from grpo_cli.errors import UserFacingError
from grpo_cli.tasks import get_task, load_examples, make_reward_fn
from grpo_cli.tasks.json_extraction import FIELDS, PASSAGES, json_reward_fn
from grpo_cli.tasks.lipogram import TOPICS, lipogram_reward_fn
from grpo_cli.tasks.regex_sum import regex_sum_reward_fn, sum_of_numbers
from tests.conftest import compose_config

SYNTHETIC = ["lipogram", "json", "regex_sum"]


def task_config(task: str, *overrides: str):
    return compose_config([f"task={task}", *overrides]).task


@pytest.mark.parametrize("task", SYNTHETIC)
def test_sanity_cases_score_as_documented(task):
    spec = get_task(task)
    assert len(spec.sanity_cases) >= 5 and {c.expected_reward for c in spec.sanity_cases} == {0.0, 1.0}
    for case in spec.sanity_cases:
        assert spec.reward_fn(case.response, case.ground_truth)["reward"] == case.expected_reward, case.why


@pytest.mark.parametrize("task", SYNTHETIC)
def test_data_is_deterministic_chat_by_default_and_splits_differ(task):
    cfg = task_config(task, "task.n_train=30", "task.n_eval=30")
    train, again, held_out = load_examples(cfg, "train"), load_examples(cfg, "train"), load_examples(cfg, "eval")
    assert train == again and len(train) == 30
    assert [e.prompt for e in train] != [e.prompt for e in held_out]
    assert load_examples(task_config(task, "task.n_train=30", "task.data_seed=7"), "train") != train
    assert train[0].prompt[0]["role"] == "user"
    r1 = load_examples(task_config(task, "task.n_train=1", "task.prompt=r1_zero"), "train")[0]
    assert r1.prompt.endswith("Assistant: <think>")


# --- lipogram


def test_every_lipogram_topic_can_be_written_without_e():
    assert not [t for t in TOPICS if "e" in t.lower()]


def test_lipogram_prompt_states_the_rule_and_min_words_is_an_option():
    example = load_examples(task_config("lipogram", "task.n_train=1", "task.min_words=25"), "train")[0]
    assert example.ground_truth["min_words"] == 25
    text = example.prompt[0]["content"]
    assert "at least 25 words" in text and f'"{example.ground_truth["topic"]}"' in text and "letter e" in text


def test_lipogram_answer_reward_is_the_share_of_e_free_words():
    truth = {"topic": "owl", "min_words": 2}
    result = lipogram_reward_fn("The owl hoots at night", truth)  # "The" has an e: 4 of 5 words are e-free
    assert result == {"reward": 0.0, "format_reward": 1.0, "answer_reward": 0.8}


# --- json


def test_json_truth_values_come_from_the_passage():
    for example in load_examples(task_config("json", "task.n_train=50"), "train"):
        passage = example.prompt[0]["content"].split("Passage: ")[1]
        for key, value in example.ground_truth.items():
            assert str(value) in passage, (key, value)
            assert f'"{key}" ({FIELDS[key][0]})' in example.prompt[0]["content"]
        assert len(example.ground_truth) == 3


def test_json_start_year_is_after_the_person_turned_18():
    for example in load_examples(task_config("json", "task.n_train=200", "task.fields_per_prompt=5"), "train"):
        truth = example.ground_truth
        assert truth["start_year"] >= 2024 - truth["age"] + 18


def test_json_passage_templates_use_every_field():
    for template in PASSAGES:
        assert set(re.findall(r"\{(\w+)\}", template)) == {"first", *FIELDS}


def test_json_partial_credit_and_unparseable():
    truth = {"name": "Ana Silva", "age": 34, "city": "Lima"}
    half = json_reward_fn(json.dumps({"name": "Ana Silva", "age": 35, "city": "lima"}), truth)
    assert half == {"reward": 0.0, "format_reward": 1.0, "answer_reward": pytest.approx(2 / 3), "unparseable": 0.0}
    assert json_reward_fn('{"name": true, "age": true, "city": null}', truth)["answer_reward"] == 0.0
    assert json_reward_fn("[1, 2]", truth)["unparseable"] == 1.0
    assert json_reward_fn("[" * 100_000, truth)["unparseable"] == 1.0  # deep nesting: no RecursionError


# --- regex_sum


def test_regex_sum_truth_is_the_sum_of_the_paragraph_numbers():
    cfg = task_config("regex_sum", "task.n_train=40", "task.numbers_per_prompt=6", "task.max_number=500")
    for example in load_examples(cfg, "train"):
        paragraph = example.prompt[0]["content"].split("Paragraph: ")[1]
        numbers = [int(n) for n in re.findall(r"\d+", paragraph)]
        assert len(numbers) == 6 and all(1 <= n <= 500 for n in numbers)
        assert example.ground_truth == sum(numbers) == sum_of_numbers(paragraph)


def test_regex_sum_unparseable_and_format():
    assert regex_sum_reward_fn("<ans>x</ans>", 3) == {
        "reward": 0.0,
        "format_reward": 1.0,
        "answer_reward": 0.0,
        "unparseable": 1.0,
    }
    assert regex_sum_reward_fn("<ans>1,2</ans>", 3)["unparseable"] == 1.0  # not a thousands separator


def test_regex_sum_numeric_close_component():
    reward = make_reward_fn(
        task_config("regex_sum", "task.reward_weights.numeric_close=1", "task.numeric_tolerance=0.1")
    )
    assert reward("<ans>105</ans>", 100)["reward"] == 1.0  # within 10%: numeric_close only
    assert reward("<ans>100</ans>", 100)["reward"] == 2.0
    assert reward("<ans>120</ans>", 100)["reward"] == 0.0


@pytest.mark.parametrize(
    ("task", "override"),
    [
        ("lipogram", "task.min_words=0"),
        ("json", "task.fields_per_prompt=6"),
        ("regex_sum", "task.numbers_per_prompt=0"),
    ],
)
def test_bad_options_fail_in_one_line_naming_the_key(task, override):
    with pytest.raises(UserFacingError, match=override):
        load_examples(task_config(task, override), "train")


def test_synthetic_tasks_also_read_local_jsonl(tmp_path):
    path = tmp_path / "sums.jsonl"
    path.write_text('{"question": "Add 2 and 3.", "ground_truth": 5}\n')
    examples = load_examples(task_config("regex_sum", f"task.eval_path={path}"), "eval")
    assert [(e.prompt, e.ground_truth) for e in examples] == [([{"role": "user", "content": "Add 2 and 3."}], 5)]
