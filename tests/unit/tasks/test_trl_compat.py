"""task=custom as a TRL GRPOTrainer user meets it: conversational datasets, TRL 1.16's completion rule and every
argument it passes, reward factories from YAML, new reward names without +, per-reward check_reward cases.

TRL's own reward functions (`trl.rewards`, installed from PyPI by the [dev] extra) are called unchanged, through
task=custom and directly on the same batch, and must give the same values. The end-to-end tests run the real
`grpo-run` on a user folder in a temporary directory.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from grpo_cli.errors import RewardFunctionError, UserFacingError
from grpo_cli.rollout.evaluation import add_extra_columns
from grpo_cli.rollout.rewards import reward_metrics, score_responses, with_logged_metrics
from grpo_cli.tasks import load_examples, make_reward_fn, validate_task_config
from grpo_cli.tasks.base import TaskDataError
from grpo_cli.tasks.custom import CustomTaskConfig, absolutize_paths
from grpo_cli.tasks.trainer_state import TrainerState
from grpo_cli.tracking.wandb_sink import extra_columns, sample_table_rows
from grpo_cli.usercode.user_code import UserCodeError
from tests.conftest import REPO_ROOT, compose_config
from tests.unit.tasks.test_custom_task import rows_jsonl as jsonl
from tests.unit.tasks.test_custom_task import write

SEED_003_REWARDS = REPO_ROOT / "examples" / "medcalc_trl" / "rewards.py"

CONVERSATION = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris"},
    {"role": "user", "content": "And of Italy?"},
]

USER_REWARDS = """
import json
import os
from pathlib import Path

def record(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **kwargs):
    # What it got, written down for the test (it runs in a worker process unless task.reward_workers=0).
    state = {k: getattr(trainer_state, k) for k in ("global_step", "max_steps", "epoch")}
    seen = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
            "trainer_state": state, "columns": sorted(kwargs), "pid": os.getpid()}
    with open(Path(__file__).parent / "seen.jsonl", "a") as out:
        out.write(json.dumps(seen) + "\\n")
    log_extra("n_ids", [len(ids) for ids in completion_ids])
    log_metric("mean_ids", sum(len(ids) for ids in completion_ids) / len(completion_ids))
    return [float(len(ids)) for ids in completion_ids]

def per_row(response, row):
    row["log_extra"]("first", response[:1])
    row["log_metric"]("ones", 1.0)
    return float(len(row["completion_ids"]) + row["trainer_state"].global_step)

def wrong_extra(completions, log_extra, **kwargs):
    log_extra("short", [1.0])
    return [0.0 for _ in completions]

def swallowing_metric(completions, log_metric, **kwargs):
    try:
        log_metric("bad", "high")
    except Exception:
        pass
    return [0.0 for _ in completions]

def only_ids(completion_ids):
    return [float(len(ids)) for ids in completion_ids]

calls = []

def text(completion):
    return completion[0]["content"] if isinstance(completion, list) else completion

def make_scaled(scale, offset=0.0):
    calls.append(scale)
    def scaled(completions, **kwargs):
        return [scale * len(text(c)) + offset for c in completions]
    return scaled

def length_times(completions, scale, **kwargs):
    return [scale * len(text(c)) for c in completions]

class Counter:
    def __init__(self, start):
        self.n = start
    def __call__(self, completions, **kwargs):
        self.n += 1
        return [float(self.n) for _ in completions]

def broken_factory(x):
    raise ValueError("no good")

def not_a_function(x):
    return 3
"""


def custom_cfg(folder: Path, **keys) -> CustomTaskConfig:
    cfg = CustomTaskConfig(name="custom", train_path="train.jsonl", eval_path="train.jsonl")
    for key, value in keys.items():
        setattr(cfg, key, value)
    absolutize_paths(cfg, folder)
    return cfg


def conversational_rows(n: int = 4) -> list[dict]:
    return [
        {"prompt": [*CONVERSATION[:-1], {"role": "user", "content": f"And of country {i}?"}], "solution": f"{i}"}
        for i in range(n)
    ]


@pytest.fixture
def folder(tmp_path):
    return write(tmp_path, {"rewards.py": USER_REWARDS, "train.jsonl": jsonl(conversational_rows())})


def calls_seen(folder: Path) -> list[dict]:
    """What rewards.py:record was called with, in order (it appends to seen.jsonl)."""
    seen = folder / "seen.jsonl"
    return [json.loads(line) for line in seen.read_text().splitlines()] if seen.exists() else []


def trl_rewards():
    return pytest.importorskip("trl.rewards", reason="trl is not installed (pip install -e '.[dev]' installs it)")


# -------------------------------------------------------------------------------------- 1. conversational data


def test_conversational_rows_in_jsonl_parquet_and_a_datasets_directory_are_the_conversation_itself(tmp_path):
    import datasets

    from grpo_cli.engines.base import render_prompts
    from grpo_cli.models import TINY_RANDOM, load_tokenizer

    rows = [{"prompt": CONVERSATION, "answer": "Rome"}, {"prompt": CONVERSATION[1:], "answer": "Rome"}]
    write(tmp_path, {"d.jsonl": jsonl(rows), "rewards.py": USER_REWARDS})
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "ds"))
    tokenizer = load_tokenizer(TINY_RANDOM)
    for source in ({"train_path": "d.jsonl"}, {"train_path": "d.parquet"}, {"dataset": "ds", "split": "train"}):
        cfg = custom_cfg(tmp_path, rewards={"r": "rewards.py:record"}, **{"train_path": None, **source})
        examples = load_examples(cfg, "train")
        assert [e.prompt for e in examples] == [CONVERSATION, CONVERSATION[1:]], source
        assert [e.ground_truth["prompt"] for e in examples] == [CONVERSATION, CONVERSATION[1:]], source
        # Rendered by the model's chat template, system, user and the earlier assistant turn as given.
        expected = tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
        assert (
            render_prompts([examples[0].prompt], tokenizer)[0]
            == tokenizer(expected, add_special_tokens=False)["input_ids"]
        )
        assert "<|im_start|>assistant\nParis<|im_end|>" in expected and "[{" not in expected


def test_a_renamed_column_of_messages_is_the_conversation(tmp_path):
    write(tmp_path, {"train.jsonl": jsonl([{"messages": CONVERSATION}]), "rewards.py": USER_REWARDS})
    cfg = custom_cfg(tmp_path, rewards={"r": "rewards.py:record"}, rename_columns={"messages": "prompt"})
    assert load_examples(cfg, "train")[0].prompt == CONVERSATION


@pytest.mark.parametrize(
    ("keys", "rows", "said"),
    [
        ({"template": "Q: {prompt}"}, None, "task.template='Q: {prompt}' applies to text prompts"),
        ({"system_prompt": "Be brief."}, None, "task.system_prompt applies to text prompts"),
        ({"prompt": "question_only"}, None, "task.prompt=question_only is a text prompt style"),
        ({}, [{"prompt": CONVERSATION}, {"prompt": "text"}], "row 0's prompt is a conversation and row 1's is str"),
        ({}, [{"prompt": [{"role": "user", "content": 3}]}], "row 0: prompt message 0 is"),
        ({}, [{"prompt": [{"from": "human", "value": "hi"}]}], "column 'prompt' is a list of 1 items but not chat"),
    ],
)
def test_conversational_data_that_cannot_be_rendered_as_given_is_one_line(tmp_path, keys, rows, said):
    write(tmp_path, {"train.jsonl": jsonl(rows or [{"prompt": CONVERSATION}]), "rewards.py": USER_REWARDS})
    cfg = custom_cfg(tmp_path, rewards={"r": "rewards.py:record"}, **keys)
    with pytest.raises(UserFacingError) as info:
        load_examples(cfg, "train")
    assert said in str(info.value) and "\n" not in str(info.value)


# ------------------------------------------------------------------------------------ 2. TRL's completion rule


def test_seed_003s_functions_score_with_a_text_template_under_the_default_chat_prompt(tmp_path):
    rows = [{"note": "BMI?", "Ground Truth Answer": "26.122"}]
    write(tmp_path, {"train.jsonl": jsonl(rows)})
    cfg = custom_cfg(
        tmp_path,
        template="{note}",
        rename_columns={"Ground Truth Answer": "references"},
        rewards={"fmt": f"{SEED_003_REWARDS}:format_reward", "num": f"{SEED_003_REWARDS}:numeric_tolerance_reward"},
    )
    assert cfg.prompt == "chat"  # the default prompt style: text data still gets text completions (TRL's rule)
    example = load_examples(cfg, "train")[0]
    assert example.prompt == [{"role": "user", "content": "BMI?"}] and example.ground_truth["prompt"] == "BMI?"
    reward = make_reward_fn(cfg)
    both = reward("<think>80/1.75^2</think> <answer>26.12</answer>", example.ground_truth)
    assert (both["reward/fmt"], both["reward/num"]) == (1.0, 1.0)
    assert reward("<answer>30</answer>", example.ground_truth)["reward"] == 0.0


def test_prompts_and_completions_follow_the_data_and_completion_format_forces_them(folder, tmp_path):
    text_folder = write(tmp_path / "text", {"rewards.py": USER_REWARDS, "train.jsonl": jsonl([{"q": "x"}])})
    cases = [
        (folder, {}, CONVERSATION[:-1] + [{"role": "user", "content": "And of country 0?"}], True),
        (text_folder, {"template": "Q: {q}", "system_prompt": "Be brief."}, "Be brief.\n\nQ: x", False),
        (folder, {"completion_format": "text"}, None, False),
        (text_folder, {"template": "{q}", "completion_format": "messages"}, "x", True),
    ]
    for where, keys, prompt, as_messages in cases:
        cfg = custom_cfg(where, rewards={"r": "rewards.py:record"}, **keys)
        truth = load_examples(cfg, "train")[0].ground_truth
        (where / "seen.jsonl").unlink(missing_ok=True)
        score_responses(make_reward_fn(cfg), ["hi"], [truth], completion_ids=[[5, 6, 2]])
        [call] = calls_seen(where)
        if prompt is not None:
            assert call["prompts"] == [prompt]
        assert call["completions"] == ([[{"role": "assistant", "content": "hi"}]] if as_messages else ["hi"]), keys


def test_trls_think_format_and_accuracy_rewards_score_conversational_data_as_trl_does(tmp_path):
    rewards = trl_rewards()
    rows = [{"prompt": [{"role": "user", "content": "1/3 as a fraction?"}], "solution": r"\frac{1}{3}"}] * 3
    write(tmp_path, {"train.jsonl": jsonl(rows)})
    cfg = custom_cfg(
        tmp_path, rewards={"think": "trl.rewards:think_format_reward", "acc": "trl.rewards:accuracy_reward"}
    )
    truths = [e.ground_truth for e in load_examples(cfg, "train")]
    responses = [r"<think>x</think> \boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}", r"<think>y</think>\boxed{1/3}"]
    scores = score_responses(make_reward_fn(cfg), responses, truths, completion_ids=[[1], [2], [3]])
    completions = [[{"role": "assistant", "content": r}] for r in responses]
    assert [r["reward/think"] for r in scores.rewards] == rewards.think_format_reward(completions) == [1.0, 0.0, 1.0]
    direct = rewards.accuracy_reward(completions, [row["solution"] for row in rows])
    assert [r["reward/acc"] for r in scores.rewards] == direct == [1.0, 0.0, 1.0]
    # accuracy_reward logs its parsing with log_extra: columns of the eval samples
    assert scores.extra_columns["solution"] == [r"\frac{1}{3}"] * 3 and "answer_parsed" in scores.extra_columns


# --------------------------------------------------------------------------- 3. every argument TRL 1.16 passes


def trl_batch(rewards):
    """Six of trl.rewards' functions as a user configures them, a batch, and their values called directly on it."""
    rows = [
        {"prompt": [{"role": "user", "content": f"q{i}"}], "solution": s}
        for i, s in enumerate([r"\frac{1}{3}", "2", "5", r"\frac{1}{3}"])
    ]
    responses = [
        r"<think>ok</think> The answer is \boxed{\frac{1}{3}}",
        r"no think \boxed{3}",
        r"<think>a</think><think>b</think> \boxed{5}",
        r"<think>partial \boxed{\frac{1}{3}}",
    ]
    ids = [[7, 8, 9, 7, 8, 9, 2], [5] * 30, list(range(40)), [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 2]]
    specs = {
        "think": "trl.rewards.think_format_reward",
        "acc": "trl.rewards:accuracy_reward",
        "reasoning": {"_target_": "trl.rewards.reasoning_accuracy_reward", "_partial_": True},
        "rep": {"_target_": "trl.rewards.get_repetition_penalty_reward", "ngram_size": 2, "max_penalty": -0.5},
        "cos": {"_target_": "trl.rewards.get_cosine_scaled_reward", "max_len": 32},
        "long": {
            "_target_": "trl.rewards.get_soft_overlong_punishment",
            "max_completion_len": 32,
            "soft_punish_cache": 8,
        },
    }
    completions = [[{"role": "assistant", "content": r}] for r in responses]
    solution = [row["solution"] for row in rows]
    direct = {
        "think": rewards.think_format_reward(completions),
        "acc": rewards.accuracy_reward(completions, solution),
        "reasoning": rewards.reasoning_accuracy_reward(completions, solution),
        "rep": rewards.get_repetition_penalty_reward(ngram_size=2, max_penalty=-0.5)(completion_ids=ids),
        "cos": rewards.get_cosine_scaled_reward(max_len=32)(completions, solution, ids),
        "long": rewards.get_soft_overlong_punishment(max_completion_len=32, soft_punish_cache=8)(ids),
    }
    return rows, responses, ids, specs, direct


def test_trls_own_reward_functions_give_the_values_of_a_direct_call_on_the_same_batch(tmp_path):
    rows, responses, ids, specs, direct = trl_batch(trl_rewards())
    write(tmp_path, {"train.jsonl": jsonl(rows)})
    cfg = custom_cfg(tmp_path, rewards=specs)
    validate_task_config(cfg)
    truths = [e.ground_truth for e in load_examples(cfg, "train")]
    scores = score_responses(make_reward_fn(cfg), responses, truths, completion_ids=ids)
    assert scores.n_errors == 0
    for name, values in direct.items():
        assert [r.get(f"reward/{name}") for r in scores.rewards] == values, name
    # the values are not all trivial: each function sees what it reads
    assert direct["rep"][0] < 0 and direct["long"][2] == -1.0 and direct["acc"][0] == 1.0 and direct["think"][2] == 0


@pytest.mark.parametrize("workers", [1, 0])
def test_completion_ids_trainer_state_loggers_and_columns_reach_a_function(folder, workers):
    import dataclasses
    import os

    cfg = custom_cfg(folder, rewards={"r": "rewards.py:record"}, reward_workers=workers)
    truths = [e.ground_truth for e in load_examples(cfg, "train")[:2]]
    state = TrainerState(global_step=3, max_steps=10, epoch=0.5)
    scores = score_responses(make_reward_fn(cfg), ["a", "b"], truths, completion_ids=[[1, 2], [3]], trainer_state=state)
    assert [r["reward/r"] for r in scores.rewards] == [2.0, 1.0]
    assert scores.extra_columns == {"n_ids": [2, 1]} and scores.logged_metrics == {"mean_ids": [1.5]}
    metrics = with_logged_metrics(reward_metrics(scores, "train"), scores, "train")
    assert metrics["train/mean_ids"] == 1.5
    call = calls_seen(folder)[-1]
    assert call["completion_ids"] == [[1, 2], [3]] and call["trainer_state"] == dataclasses.asdict(state)
    assert call["columns"] == ["solution"]  # every column; the prompt is prompts=
    # in a worker process (its log_extra and log_metric replayed here), or with 0 workers in this one
    assert (call["pid"] == os.getpid()) == (workers == 0)


@pytest.mark.parametrize("workers", [1, 0])
def test_a_per_sample_function_gets_the_same_extras_in_its_row(folder, workers):
    cfg = custom_cfg(
        folder, rewards={"p": "rewards.py:per_row"}, reward_convention="per_sample", reward_workers=workers
    )
    truths = [e.ground_truth for e in load_examples(cfg, "train")[:2]]
    state = TrainerState(global_step=4, max_steps=8, epoch=1.0)
    scores = score_responses(
        make_reward_fn(cfg), ["xy", "z"], truths, completion_ids=[[1, 2, 3], [1]], trainer_state=state
    )
    assert [r["reward/p"] for r in scores.rewards] == [7.0, 5.0]
    assert scores.extra_columns == {"first": ["x", "z"]} and scores.logged_metrics == {"ones": [1.0, 1.0]}


@pytest.mark.parametrize(
    ("function", "said"),
    [
        ("wrong_extra", "called log_extra('short', ...) with 1 values for 2 completions"),
        ("swallowing_metric", "called log_metric('bad', 'high'): give a finite number"),
    ],
)
def test_misused_loggers_are_one_line_even_when_the_function_swallows_errors(folder, function, said):
    cfg = custom_cfg(folder, rewards={"r": f"rewards.py:{function}"}, on_reward_error="skip")
    truths = [e.ground_truth for e in load_examples(cfg, "train")[:2]]
    with pytest.raises(RewardFunctionError) as info:
        score_responses(make_reward_fn(cfg), ["a", "b"], truths, completion_ids=[[1], [2]])
    assert said in str(info.value) and "\n" not in str(info.value)


def test_logged_columns_join_the_eval_records_and_the_wandb_table_and_metric_names_may_not_collide():
    records = [{"prompt": "p", "response": "r", "ground_truth": 1, "reward": 1.0, "n_tokens": 3, "reward/a": 1.0}]
    add_extra_columns(records, {"gold": ["x"]})
    assert records[0]["gold"] == "x" and extra_columns(records) == ["gold"]
    assert sample_table_rows(records, 2, 5, ["gold"])[0] == [2, "p", "r", 1, 1.0, None, None, "x"]
    with pytest.raises(UserFacingError, match="log_extra\\('response', ...\\), which would overwrite"):
        add_extra_columns(records, {"response": ["x"]})
    from grpo_cli.rollout.rewards import Scores

    scores = Scores([{"reward": 1.0, "format_reward": 0.0, "answer_reward": 0.0}], 0, logged_metrics={"reward": [1.0]})
    with pytest.raises(UserFacingError, match="log_metric\\('reward', ...\\), which would overwrite grpo-cli's own"):
        with_logged_metrics(reward_metrics(scores, "eval"), scores, "eval")


def test_a_function_without_kwargs_gets_only_what_it_names(folder):
    cfg = custom_cfg(folder, rewards={"ids": "rewards.py:only_ids"})
    truths = [e.ground_truth for e in load_examples(cfg, "train")[:1]]
    assert score_responses(make_reward_fn(cfg), ["a"], truths, completion_ids=[[1, 2, 3]]).rewards[0]["reward"] == 3.0


def test_trainer_state_epoch_counts_the_passes_over_the_prompts_drawn_and_survives_a_resume():
    from grpo_cli.drivers.prompts import PromptSampler

    sampler = PromptSampler(list(range(4)), seed=0)
    assert sampler.epoch == 0.0
    sampler.next_batch(3)
    sampler.next_batch(3)
    assert sampler.epoch == 1.5  # 6 of 4 prompts drawn
    resumed = PromptSampler(list(range(4)), seed=0)
    resumed.load_state(json.loads(json.dumps(sampler.state())))
    assert resumed.epoch == 1.5 and resumed.next_batch(2) == sampler.next_batch(2)
    old = {k: v for k, v in sampler.state().items() if k != "drawn"}  # a checkpoint from before the count
    resumed.load_state(old)
    assert resumed.epoch == old["position"] / 4


# ------------------------------------------------------------------------------------ 4. factories from YAML


@pytest.mark.parametrize("workers", [1, 0])
def test_a_factory_node_is_instantiated_once_per_process_and_partial_and_file_targets_work(folder, workers):
    import sys

    specs = {
        "scaled": {"_target_": "rewards.py:make_scaled", "scale": 2.0, "offset": 1.0},
        "partial": {"_target_": "rewards.py:length_times", "_partial_": True, "scale": 3.0},
        "counter": {"_target_": "rewards.py:Counter", "start": 10},
    }
    cfg = custom_cfg(folder, rewards=specs, reward_workers=workers)
    assert cfg.rewards["scaled"]["_target_"] == f"{folder / 'rewards.py'}:make_scaled"  # made absolute
    truths = [e.ground_truth for e in load_examples(cfg, "train")[:2]]
    reward = make_reward_fn(cfg)
    first = score_responses(reward, ["ab", "c"], truths).rewards
    second = score_responses(reward, ["ab", "c"], truths).rewards
    rebuilt = make_reward_fn(custom_cfg(folder, rewards=dict(specs), reward_workers=workers))
    again = score_responses(rebuilt, ["ab", "c"], truths).rewards
    assert [r["reward/scaled"] for r in first] == [5.0, 3.0] and [r["reward/partial"] for r in first] == [6.0, 3.0]
    # one instance per process, built in the process that calls it (a worker's own): it keeps counting
    counter = [[r["reward/counter"] for r in scores] for scores in (first, second, again)]
    assert counter[:2] == [[11.0, 11.0], [12.0, 12.0]]
    # a new task build: the same instance in this process; a new worker pool's process builds its own
    assert counter[2] == ([13.0] * 2 if workers == 0 else [11.0] * 2)
    module = next(m for m in sys.modules.values() if getattr(m, "__file__", None) == str(folder / "rewards.py"))
    assert module.calls == [2.0]  # this process built it once (to check it), however many task builds


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ({"scale": 1}, "a reward (or tool) given as a node names what to call in _target_"),
        ({"_target_": "rewards.py:broken_factory", "x": 1}, "rewards.py:broken_factory failed: ValueError: no good"),
        ({"_target_": "rewards.py:not_a_function", "x": 1}, "returned a int, not a function"),
        ({"_target_": "rewards.py:make_scaled"}, "missing 1 required positional argument: 'scale'"),
        ({"_target_": "no_such_pkg_t.mod.f"}, "no module named no_such_pkg_t"),
        (3, "give path/to/file.py:function, package.module:function or a node"),
        ("rewards.py:only_ids", "overlong is the name of a shaping term"),
    ],
)
def test_a_bad_factory_node_is_one_line(folder, spec, said):
    name = "overlong" if "shaping" in said else "bad"
    with pytest.raises(UserFacingError) as info:
        validate_task_config(custom_cfg(folder, rewards={name: spec}))
    assert said in str(info.value) and "\n" not in str(info.value)


def test_naming_a_factory_as_a_function_says_how_to_give_its_arguments(folder):
    trl_rewards()
    cfg = custom_cfg(folder, rewards={"long": "trl.rewards:get_soft_overlong_punishment"})
    with pytest.raises(UserCodeError) as info:
        validate_task_config(cfg)
    assert (
        "give it as a node with its arguments: task.rewards.long={_target_: "
        "trl.rewards.get_soft_overlong_punishment, max_completion_len: ..., soft_punish_cache: ...}"
    ) in str(info.value)


# --------------------------------------------------------------------------- 5. new names without + on the CLI


def test_a_new_reward_name_and_weight_need_no_plus_and_other_dicts_say_to_add_one():
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException

    from grpo_cli.cli import config_error_line

    cfg = compose_config(
        [
            "task=custom",
            "task.rewards.fmt=rewards.py:format_reward",
            "task.rewards.long={_target_: trl.rewards.get_soft_overlong_punishment, max_completion_len: 48,"
            " soft_punish_cache: 8}",
            "task.reward_weights.fmt=0.5",
        ]
    )
    assert cfg.task.rewards["fmt"] == "rewards.py:format_reward" and cfg.task.reward_weights == {"fmt": 0.5}
    assert cfg.task.rewards["long"] == {
        "_target_": "trl.rewards.get_soft_overlong_punishment",
        "max_completion_len": 48,
        "soft_punish_cache": 8,
    }
    with initialize_config_module(config_module="grpo_cli.conf", version_base="1.3"):
        with pytest.raises(HydraException) as info:
            compose(config_name="config", overrides=["task=math", "task.eval_sets.x=test", "output_dir=."])
    line = config_error_line(info.value)
    assert line.endswith("add it with +task.eval_sets.x=... (task.eval_sets is a dict of names of your own)"), line
    assert "str]" not in line


# ----------------------------------------------------------------------------- 6. check_reward per reward


def test_check_reward_cases_may_expect_each_reward_or_the_total(folder, tmp_path):
    from rich.console import Console

    from grpo_cli.jobs.check_reward import run as check_reward
    from grpo_cli.models import TINY_RANDOM, load_tokenizer

    tokenizer = load_tokenizer(TINY_RANDOM)
    # A case without its own completion_ids gets its response's tokens under the model's tokenizer, then EOS.
    n_ids = len(tokenizer("abc", add_special_tokens=False)["input_ids"]) + 1
    prompt = [{"role": "user", "content": "q"}]
    cases = [
        {"prompt": prompt, "solution": "1", "response": "abc", "expected": {"scaled": 7.0, "ids": float(n_ids)}},
        {"prompt": prompt, "solution": "1", "response": "ab", "completion_ids": [1, 2, 3, 4], "expected": 9.0},
        {"prompt": prompt, "solution": "1", "response": "a", "expected": {"ids": 0.0}, "why": "deliberately wrong"},
    ]
    (folder / "cases.jsonl").write_text(jsonl(cases))
    rewards = {
        "scaled": {"_target_": "rewards.py:make_scaled", "scale": 2.0, "offset": 1.0},
        "ids": "rewards.py:only_ids",
    }
    cfg = compose_config(["job=check_reward", "task=custom", "model=tiny_random", f"task.base_dir={folder}"])
    cfg.task = custom_cfg(folder, rewards=rewards, cases_path="cases.jsonl")
    out = Console(file=io.StringIO(), width=220, highlight=False)
    with pytest.raises(UserFacingError, match=r"1 of 3 reward sanity cases of task=custom disagree \(rows 3\)"):
        check_reward(cfg, tmp_path, out)
    table = out.file.getvalue()
    assert f"scaled=7 ids={n_ids}" in table and "DIFFERS" in table and "deliberately wrong" in table
    assert "completion_ids: each response tokenized by random:tiny-llama's tokenizer" in table
    (folder / "bad_cases.jsonl").write_text(jsonl([{**cases[0], "expected": {"nope": 1}}]))
    cfg.task = custom_cfg(folder, rewards=rewards, cases_path="bad_cases.jsonl")
    with pytest.raises(TaskDataError, match="names 'nope', which is no reward of this task: use scaled, ids"):
        validate_task_config(cfg.task)


# ------------------------------------------------------------------------------------------- end to end


def test_a_reward_that_returns_none_for_every_row_of_a_batch_is_said_once(tmp_path, caplog):
    """TRL warns when no function gave a row a reward; here a helper that forgot its `return` gives none."""
    write(
        tmp_path,
        {
            "train.jsonl": jsonl([{"q": "x", "answer": "1"}, {"q": "y", "answer": "2"}]),
            "forgot.py": (
                "def score(completion):\n    value = float(len(completion) > 0)  # and no return\n\n\n"
                "def reward(completions, **kwargs):\n    return [score(c) for c in completions]\n"
            ),
            "some.py": "def reward(completions, **kwargs):\n    return [None, 1.0][: len(completions)]\n",
        },
    )
    cfg = custom_cfg(tmp_path, template="{q}", rewards={"forgot": "forgot.py:reward", "some": "some.py:reward"})
    truths = [e.ground_truth for e in load_examples(cfg, "train")]
    reward_fn = make_reward_fn(cfg)
    with caplog.at_level("WARNING", logger="grpo_cli.tasks.custom.reward"):
        for _ in range(2):
            scores = score_responses(reward_fn, ["a", "b"], truths)
    assert [r["reward"] for r in scores.rewards] == [0.0, 1.0]  # the direct sum: forgot gives none, some one row
    said = [r.getMessage() for r in caplog.records if "returned None" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("reward task.rewards.forgot=") and "all 2 completions" in said[0]
