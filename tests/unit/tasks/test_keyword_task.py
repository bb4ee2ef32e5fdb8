"""Keyword task: whole-word, case-insensitive matching and deterministic synthetic data."""

import pytest

from grpo_cli.tasks import get_task, load_examples
from grpo_cli.tasks.keyword import SANITY_CASES, build_keyword_examples, keyword_inclusion_reward_fn, keyword_present


@pytest.mark.parametrize("case", SANITY_CASES, ids=lambda c: c.why)
def test_sanity_cases_score_as_documented(case):
    assert keyword_inclusion_reward_fn(case.response, case.ground_truth)["reward"] == case.expected_reward


@pytest.mark.parametrize(
    ("response", "keyword", "present"),
    [
        ("An apple.", "apple", True),
        ("APPLE", "apple", True),
        ("(apple)", "apple", True),
        ("apple's core", "apple", True),  # the apostrophe ends the word
        ("snapple", "apple", False),
        ("apples", "apple", False),
        ("apple2", "apple", False),  # digits glue onto the word
        ("", "apple", False),
        ("ice cream", "ice cream", True),  # multi-word keywords match as a phrase
        ("a+b", "a+b", True),  # regex metacharacters are escaped
    ],
)
def test_keyword_present(response, keyword, present):
    assert keyword_present(response, keyword) is present


def test_reward_has_three_keys_and_partial_answer_reward():
    # one of two keywords present: not rewarded, but answer_reward shows the half-way progress
    result = keyword_inclusion_reward_fn("the river is cold", ["river", "guitar"])
    assert result == {"reward": 0.0, "format_reward": 1.0, "answer_reward": 0.5}
    assert keyword_inclusion_reward_fn("   ", ["river"])["format_reward"] == 0.0


def test_empty_keyword_list_is_an_error():
    with pytest.raises(ValueError, match="at least one keyword"):
        keyword_inclusion_reward_fn("anything", [])


def test_synthetic_data_is_deterministic_and_splits_differ():
    a = build_keyword_examples("train", 50, seed=7)
    b = build_keyword_examples("train", 50, seed=7)
    c = build_keyword_examples("eval", 50, seed=7)
    assert a == b
    assert [e.ground_truth for e in a] != [e.ground_truth for e in c]
    assert build_keyword_examples("train", 50, seed=8) != a


def test_prompts_follow_the_prompt_style():
    chat = build_keyword_examples("train", 1, seed=0, prompt_style="chat", keywords_per_prompt=3)[0]
    assert chat.prompt[0]["role"] == "user"
    words = chat.ground_truth
    assert len(words) == 3 and len(set(words)) == 3
    assert chat.prompt[0]["content"] == f"Write one short sentence that includes the words: {', '.join(words)}."
    text = build_keyword_examples("train", 1, seed=0, prompt_style="r1_zero")[0]
    assert isinstance(text.prompt, str) and text.prompt.endswith("Assistant: <think>")


def test_every_sanity_case_answer_matches_its_prompt_words():
    # the task ships its own checks for `check_reward`; they must at least be consistent
    task = get_task("keyword")
    assert len(task.sanity_cases) >= 5
    assert {c.expected_reward for c in task.sanity_cases} == {0.0, 1.0}


def test_local_jsonl_overrides_synthetic_data(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text(
        '{"question": "Use: cat, dog.", "ground_truth": ["cat", "dog"]}\n\n'
        '{"question": "Use: sun.", "ground_truth": ["sun"]}\n'
    )

    class TaskCfg:
        name, prompt, train_path, eval_path = "keyword", "chat", None, str(path)
        n_train, n_eval, data_seed, keywords_per_prompt = 4, None, 0, 2

    examples = load_examples(TaskCfg, "eval")
    assert [e.ground_truth for e in examples] == [["cat", "dog"], ["sun"]]
    assert len(load_examples(TaskCfg, "train")) == 4  # train split still synthetic
