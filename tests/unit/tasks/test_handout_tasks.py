"""addition and medcalc, the two handout tasks: prompts, data (synthetic, local JSONL, faked hub) and rewards that
must score exactly as the handouts' own functions, copied below as the reference."""

import json
import re
import sys

import pytest

from grpo_cli.config import validate_config
from grpo_cli.errors import UserFacingError
from grpo_cli.tasks import TaskDataError, get_task, load_examples, make_reward_fn
from grpo_cli.tasks.addition import SYSTEM_PROMPT as ADDITION_SYSTEM_PROMPT
from grpo_cli.tasks.addition import addition_reward_fn
from grpo_cli.tasks.medcalc import medcalc_reward_fn, within_atol
from tests.conftest import FIXTURES, FakeDatasets, compose_config

FIXTURE = FIXTURES / "medcalc_sample.jsonl"


def task_config(task: str, *overrides: str):
    return compose_config([f"task={task}", *overrides]).task


# --- the handouts' reward functions, verbatim (torch tensors and list plumbing aside)

HANDOUT_FORMAT_PATTERN = re.compile(r"^<think>\n[\s\S]*\n</think>\n<answer>\n[\s\S]*\n</answer>$", re.MULTILINE)


def handout_addition_format(resp):
    return 1.0 if HANDOUT_FORMAT_PATTERN.match(resp.strip()) else 0.0


def handout_medcalc_format(c):
    pattern = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
    return 1.0 if isinstance(c, str) and pattern.search(c) else 0.0


def handout_exact_answer(c, ref):
    m = re.search(r"<answer>(.*?)</answer>", c, re.DOTALL)
    pred = m.group(1).strip() if m else ""
    return 1.0 if pred == (ref or "").strip() else 0.0


def handout_numeric_tolerance(c, ref, atol=0.5):
    pred_m = re.search(r"<answer>\s*([+-]?[0-9]*\.?[0-9]+)", c)
    ref_m = re.search(r"([+-]?[0-9]*\.?[0-9]+)", ref)
    if pred_m and ref_m:
        return 1.0 if abs(float(pred_m.group(1)) - float(ref_m.group(1))) <= atol else 0.0
    return 0.0


ADDITION_RESPONSES = [
    "<think>\nreasoning goes here\n</think>\n<answer>\nthe meaning of life is\n</answer>",  # the handout's checks
    "<think>missing closing tags",
    "<think>\n90 + 7 = 97\n</think>\n<answer>\n97\n</answer>",
    "  <think>\na\nb\n</think>\n<answer>\n97\n</answer>\n\n",
    "<think>\n</think>\n<answer>\n97\n</answer>",
    "<think>\n\n</think>\n<answer>\n\n</answer>",
    "<think>\nx\n</think>\n<answer>\n97\n</answer>\nmore text",
    "<think>\nx\n</think>\n<answer>\n97\n</answer> more text",
    "<think>\nx\n</think>\n\n<answer>\n97\n</answer>",
    "<think>\nx\n</think> <answer>\n97\n</answer>",
    "Sure! <think>\nx\n</think>\n<answer>\n97\n</answer>",
    "<think>\nx\n</think>\n<answer>97</answer>",
    "",
]

MEDCALC_CASES = [
    ("<think>a</think><answer>26.122</answer>", "26.122"),
    ("<think>a</think>\n\n<answer> 26.122 </answer>", "26.122"),
    ("<answer>26.3</answer>", "26.122"),
    ("<answer>\n-3.5 points</answer>", "-3"),
    ("<answer>.5</answer>", "0.75"),
    ("<answer>26.122", "26.122"),
    ("<think>x</think> the answer is <answer>abc 26</answer>", "26"),
    ("<think>x</think><answer>03/15/2024</answer>", "03/15/2024"),
    ("<think>x</think><answer>3</answer>", "('4 weeks', '3 days')"),
    ("<answer>1</answer><answer>2</answer>", "2"),
    ("<think>unclosed <answer>7</answer>", "7"),
    ("no tags 26.122", "26.122"),
    ("", "5"),
]


@pytest.mark.parametrize("response", ADDITION_RESPONSES)
def test_addition_format_reward_is_the_handouts(response):
    assert addition_reward_fn(response, 97)["format_reward"] == handout_addition_format(response)


@pytest.mark.parametrize(("response", "truth"), MEDCALC_CASES)
def test_medcalc_components_are_the_handouts_functions(response, truth):
    result = medcalc_reward_fn(response, truth)
    assert result["format_reward"] == handout_medcalc_format(response)
    assert result["reward"] == result["answer_reward"] == handout_exact_answer(response, truth)
    for atol in (0.0, 0.5, 2.0):
        assert float(within_atol(response, truth, atol)) == handout_numeric_tolerance(response, truth, atol)


@pytest.mark.parametrize("task", ["addition", "medcalc"])
def test_sanity_cases_score_as_documented(task):
    spec = get_task(task)
    assert len(spec.sanity_cases) >= 8 and {c.expected_reward for c in spec.sanity_cases} == {0.0, 1.0}
    for case in spec.sanity_cases:
        assert spec.reward_fn(case.response, case.ground_truth)["reward"] == case.expected_reward, case.why


# --- addition


def test_addition_data_is_the_handouts_questions_seeded_and_split():
    cfg = task_config("addition", "task.n_train=200", "task.n_eval=200")
    train, again, held_out = load_examples(cfg, "train"), load_examples(cfg, "train"), load_examples(cfg, "eval")
    assert train == again and len(train) == 200 and train != held_out
    assert load_examples(task_config("addition", "task.n_train=200", "task.data_seed=7"), "train") != train
    question = re.compile(r"If you add (\d+) and (\d+), what is the result\?")
    pairs = [tuple(map(int, question.fullmatch(e.meta["question"]).groups())) for e in train]
    assert {a for a, _ in pairs} <= set(range(10, 100)) and len({a for a, _ in pairs}) > 60
    assert {b for _, b in pairs} == set(range(1, 10))
    for (a, b), example in zip(pairs, train, strict=True):
        assert example.ground_truth == a + b
        assert example.prompt == [
            {"role": "system", "content": ADDITION_SYSTEM_PROMPT},
            {"role": "user", "content": example.meta["question"]},
        ]


def test_addition_system_prompt_is_the_handouts_template():
    assert ADDITION_SYSTEM_PROMPT == (
        "You are a helpful assistant. First reason internally, then provide the user answer. Respond using the "
        "template:\n<think>\n...\n</think>\n<answer>\n...\n</answer>"
    )


def test_addition_question_only_is_the_system_prompt_then_the_question():
    example = load_examples(task_config("addition", "task.n_train=1", "task.prompt=question_only"), "train")[0]
    assert example.prompt == f"{ADDITION_SYSTEM_PROMPT}\n\n{example.meta['question']}"


def test_addition_jsonl_questions_get_the_same_system_prompt(tmp_path):
    path = tmp_path / "sums.jsonl"
    path.write_text(json.dumps({"question": "If you add 40 and 2, what is the result?", "ground_truth": 42}) + "\n")
    (example,) = load_examples(task_config("addition", f"task.eval_path={path}"), "eval")
    assert example.prompt[0] == {"role": "system", "content": ADDITION_SYSTEM_PROMPT}
    assert example.ground_truth == 42


def test_addition_weights_give_the_handouts_format_only_objective_or_a_shaped_one():
    good = "<think>\n40 + 2 = 42\n</think>\n<answer>\n42\n</answer>"
    wrong = "<think>\n40 + 2 = 43\n</think>\n<answer>\n43\n</answer>"
    handout = make_reward_fn(
        task_config("addition", "task.reward_weights.correctness=0", "task.reward_weights.format=1")
    )
    assert handout(good, 42)["reward"] == handout(wrong, 42)["reward"] == 1.0
    shaped = make_reward_fn(task_config("addition", "task.reward_weights.format=0.1"))
    assert shaped(good, 42)["reward"] == pytest.approx(1.1) and shaped(wrong, 42)["reward"] == pytest.approx(0.1)
    assert shaped(wrong, 42)["reward/format"] == 1.0 and shaped(wrong, 42)["reward/correctness"] == 0.0
    assert make_reward_fn(task_config("addition"))(good, 42) == addition_reward_fn(good, 42)


@pytest.mark.parametrize("task", ["addition", "medcalc"])
def test_r1_zero_is_refused_in_one_line(task):
    with pytest.raises(UserFacingError) as info:
        validate_config(compose_config([f"task={task}", "task.prompt=r1_zero"]))
    assert str(info.value).startswith(f"task.prompt=r1_zero does not suit task={task}'s prompts and reward")
    assert "\n" not in str(info.value)


# --- medcalc

HANDOUT_MEDCALC_PROMPT = (
    "You are a clinical calculator assistant. Provide concise reasoning in <think>...</think> and the final "
    "numeric result in <answer>...</answer>.\n\nPatient Note: {note}\nQuestion: {question}\n"
    "Answer with <think> and <answer> tags."
)


def test_medcalc_jsonl_rows_become_the_handouts_prompt():
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    examples = load_examples(task_config("medcalc", f"task.eval_path={FIXTURE}"), "eval")
    assert [e.ground_truth for e in examples] == ["26.122", "100.0", "447.214", "3", "03/15/2024"]
    for row, example in zip(rows, examples, strict=True):
        assert example.prompt == HANDOUT_MEDCALC_PROMPT.format(note=row["Patient Note"], question=row["Question"])
    assert examples[0].meta == {
        "question": rows[0]["Question"],
        "Row Number": 1,
        "Calculator ID": 6,
        "Calculator Name": "Body Mass Index (BMI)",
        "Category": "physical",
        "Output Type": "decimal",
        "Note ID": "fixture-1",
    }


def test_medcalc_chat_sends_the_same_text_as_one_user_message():
    plain = load_examples(task_config("medcalc", f"task.eval_path={FIXTURE}", "task.n_eval=1"), "eval")[0]
    chat = load_examples(
        task_config("medcalc", f"task.eval_path={FIXTURE}", "task.n_eval=1", "task.prompt=chat"), "eval"
    )
    assert chat[0].prompt == [{"role": "user", "content": plain.prompt}]


def test_medcalc_default_reward_is_the_handouts_format_plus_numeric_tolerance():
    reward = make_reward_fn(task_config("medcalc"))
    think = "<think>80 / 1.75^2</think>"
    scored = {
        "exact, formatted": reward(f"{think}<answer>26.122</answer>", "26.122"),
        "rounded, formatted": reward(f"{think}<answer>26.1</answer>", "26.122"),
        "0.878 off": reward(f"{think}<answer>27</answer>", "26.122"),
        "no <think>": reward("<answer>26.122</answer>", "26.122"),
        "unclosed": reward(f"{think}<answer>26.122", "26.122"),
        "no answer": reward(f"{think}26.122", "26.122"),
    }
    assert {name: result["reward"] for name, result in scored.items()} == {
        "exact, formatted": 2.0,
        "rounded, formatted": 2.0,
        "0.878 off": 1.0,
        "no <think>": 1.0,
        "unclosed": 1.0,  # the handout's numeric reward reads the number after <answer> without the closing tag
        "no answer": 0.0,
    }
    rounded = scored["rounded, formatted"]
    assert (rounded["reward/format"], rounded["reward/numeric_close"], rounded["answer_reward"]) == (1.0, 1.0, 0.0)


def test_answer_atol_is_an_absolute_tolerance_and_must_not_be_negative():
    tight = make_reward_fn(task_config("medcalc", "task.answer_atol=0.01"))
    assert tight("<answer>26.12</answer>", "26.122")["reward/numeric_close"] == 1.0
    assert tight("<answer>26.1</answer>", "26.122")["reward/numeric_close"] == 0.0
    loose = make_reward_fn(task_config("medcalc", "task.answer_atol=5"))
    assert loose("<answer>104</answer>", "100.0")["reward/numeric_close"] == 1.0
    with pytest.raises(UserFacingError, match=r"^task.answer_atol=-1.0 must be >= 0$"):
        validate_config(compose_config(["task=medcalc", "task.answer_atol=-1"]))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"Question": "BMI?", "Ground Truth Answer": "20"}', "missing field 'Patient Note'"),
        ('{"Patient Note": "175 cm, 80 kg", "Ground Truth Answer": "26"}', "missing field 'Question'"),
        ('{"Patient Note": "175 cm, 80 kg", "Question": "BMI?"}', "missing field 'Ground Truth Answer'"),
        ('{"Patient Note": "n", "Question": "BMI?", "Ground Truth Answer": " "}', "field 'Ground Truth Answer' must"),
        ('{"Patient Note": "n", "Question": null, "Ground Truth Answer": "2"}', "field 'Question' must be a non-empty"),
        ('{"Patient Note": "n", "Question": "BMI?"', "not valid JSON"),
    ],
)
def test_bad_medcalc_lines_name_the_file_the_line_and_the_field(tmp_path, line, message):
    path = tmp_path / "medcalc.jsonl"
    path.write_text(FIXTURE.read_text().splitlines()[0] + f"\n{line}\n")
    with pytest.raises(TaskDataError) as info:
        load_examples(task_config("medcalc", f"task.train_path={path}"), "train")
    assert str(info.value).startswith(f"{path}:2: ") and message in str(info.value)
    assert "\n" not in str(info.value)


def test_hub_path_loads_medcalc_bench_with_its_columns(monkeypatch):
    monkeypatch.setattr("grpo_cli.tasks.hub.hub_dataset_cached", lambda name: True)  # the fake: a cached copy
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    fake = FakeDatasets(rows)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    examples = load_examples(task_config("medcalc", "task.n_eval=2"), "eval")
    assert fake.calls == [("ncbi/MedCalc-Bench-v1.0", None, "test")]
    assert [e.ground_truth for e in examples] == ["26.122", "100.0"]
    assert examples[1].prompt == HANDOUT_MEDCALC_PROMPT.format(
        note=rows[1]["Patient Note"], question=rows[1]["Question"]
    )

    load_examples(task_config("medcalc", "task.n_train=1"), "train")
    assert fake.calls[-1] == ("ncbi/MedCalc-Bench-v1.0", None, "train")


def test_hub_rows_with_a_missing_column_name_the_dataset_and_row(monkeypatch):
    monkeypatch.setattr("grpo_cli.tasks.hub.hub_dataset_cached", lambda name: True)  # the fake: a cached copy
    monkeypatch.setitem(sys.modules, "datasets", FakeDatasets([{"Patient Note": "n", "Ground Truth Answer": "1"}]))
    with pytest.raises(TaskDataError, match=r"ncbi/MedCalc-Bench-v1.0 split 'test' row 0: missing field 'Question'"):
        load_examples(task_config("medcalc"), "eval")
