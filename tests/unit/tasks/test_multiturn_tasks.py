"""The task side of multi-turn episodes: the task.* keys and their one-line errors, rewards on whole episodes
(score_episodes: the env component and its weight, task=custom's functions given the episode's messages and
per-turn ids), and the built-in multi-turn tasks' rewards on hand-made episodes. No model, no tokenizer: the
episodes are built by hand (episodes/turns.py's own tests cover how their tokens are built)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grpo_cli.config.validation import validate_config
from grpo_cli.episodes.turns import Episode
from grpo_cli.errors import UserFacingError
from grpo_cli.rollout.multiturn import EpisodeContext, episode_row, score_episodes
from grpo_cli.tasks import absolutize_task_paths, env_weight, is_multiturn, load_examples, make_reward_fn
from grpo_cli.tasks import validate_task_config as validate
from grpo_cli.tasks.base import Example
from grpo_cli.tasks.custom import CustomTaskConfig, absolutize_paths
from grpo_cli.tasks.guess_number import GuessNumber
from grpo_cli.tasks.schema import TaskConfig
from tests.conftest import compose_config, write_my_tools

REWARDS_PY = """
SEEN = []

def last_says_72(completions, completion_ids, **kwargs):
    # a file the test reads back: what the function was given (a worker process runs it)
    import json, os
    with open(os.environ["SEEN_FILE"], "a") as f:
        f.write(json.dumps({"completions": completions, "completion_ids": completion_ids}) + "\\n")
    return [float("72" in c[-1]["content"]) for c in completions]

def per_sample_turns(response, row):
    return float(len([m for m in response if m["role"] == "assistant"]))
"""


def task_cfg(name: str, **keys) -> TaskConfig:
    cfg = compose_config([f"task={name}"]).task
    for key, value in keys.items():
        setattr(cfg, key, value)
    return cfg


def episode(messages: list[dict], n_prompt: int, turns: list[list[int]], step_rewards=(), truth=None) -> Episode:
    """A finished episode as the driver leaves it: its messages, the model's ids per turn, the hook's rewards."""
    example = Example(messages[:n_prompt], truth)
    return Episode(
        prompt_messages=messages[:n_prompt],
        prompt_ids=[1, 2, 3],
        ids=[i for turn in turns for i in turn],
        loss_mask=[1 for turn in turns for _ in turn],
        messages=list(messages),
        model_turns=[list(t) for t in turns],
        step_rewards=list(step_rewards),
        finished=True,
        context=EpisodeContext(example, episode_row(example)),
    )


USER = {"role": "user", "content": "Natalia sold 48 clips in April and 24 in May. How many in all?"}
CALL = {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "48+24"}}'}
TOOL = {"role": "tool", "name": "calculator", "content": "72"}


# ------------------------------------------------------------------------------------------------ the keys


def test_single_turn_tasks_are_unchanged_by_the_new_keys():
    cfg = task_cfg("gsm8k")
    assert not is_multiturn(cfg) and cfg.tools == {} and cfg.environment is None and cfg.max_turns == 4
    assert env_weight(cfg) == 1.0
    validate(cfg)  # no multi-turn check applies
    assert make_reward_fn(cfg)("</think> <answer>72</answer>", "72")["reward"] == 1.0


def test_on_reward_error_and_reward_workers_are_keys_of_every_task_and_custom_keeps_them():
    assert task_cfg("gsm8k").on_reward_error == "stop" and task_cfg("guess_number").reward_workers == 1
    custom = CustomTaskConfig(name="custom")
    assert (custom.on_reward_error, custom.reward_workers) == ("stop", 1)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            {"tools": {"calculator": "grpo_cli.episodes.builtin_tools:calculator"}},
            r"^task.tools and task.environment together: .*drop one",
        ),
        ({"prompt": "r1_zero", "environment": None}, None),  # guess_number's prompts are chat only (below)
    ],
)
def test_tools_and_an_environment_together_is_one_line(keys, message):
    cfg = task_cfg("guess_number", **keys)
    if message is None:
        with pytest.raises(UserFacingError, match=r"task.prompt=r1_zero does not suit task=guess_number"):
            validate(cfg)
        return
    with pytest.raises(UserFacingError, match=message):
        validate(cfg)


def test_a_text_prompt_with_tools_is_one_line():
    cfg = task_cfg("gsm8k", prompt="r1_zero", tools={"calculator": "grpo_cli.episodes.builtin_tools:calculator"})
    with pytest.raises(UserFacingError, match=r"^task.tools with task.prompt=r1_zero: .*use task.prompt=chat$"):
        validate(cfg)


def test_a_tool_call_format_without_tools_is_one_line():
    with pytest.raises(UserFacingError, match=r"^task.tool_call_format=hermes without task.tools: "):
        validate(task_cfg("gsm8k", tool_call_format="hermes"))


def test_the_task_check_refuses_without_the_multiturn_check_registered(monkeypatch):
    """tasks/ does not import episodes/ (the multi-turn check registers itself in the config's registry when
    episodes/config.py is imported): a process that forgot that import must fail, never skip checking the tools."""
    from grpo_cli.config import task_registry

    cfg = task_cfg("gsm8k", prompt="r1_zero", tools={"calculator": "grpo_cli.episodes.builtin_tools:calculator"})
    monkeypatch.setattr(task_registry, "_EPISODE_CHECKS", [])
    with pytest.raises(RuntimeError, match=r"import grpo_cli\.episodes\.config before validating a task config"):
        validate(cfg)


def test_importing_the_tasks_loads_no_episode_or_rollout_code():
    """The layer table's tasks row (config, errors, usercode, sandbox), as a process sees it: the tasks package and
    every task's schema load without the episode machinery, which imports the tasks' declarations instead (the
    sandbox, a leaf, they may load: task.sandbox's settings are declared in sandbox/settings.py)."""
    code = (
        "import sys, grpo_cli.tasks, grpo_cli.tasks.multiturn, grpo_cli.sandbox.settings; "
        "print(sorted(m for m in sys.modules if m.startswith('grpo_cli.') "
        "and m.split('.')[1] in {'episodes', 'rollout', 'endpoint', 'engines'}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"


def test_a_tool_or_environment_that_does_not_load_is_one_line_at_preflight(tmp_path, monkeypatch):
    write_my_tools(tmp_path)
    monkeypatch.chdir(tmp_path)
    cfg = task_cfg("gsm8k", prompt="chat", tools={"t": "my_tools.py:no_doc"})
    with pytest.raises(UserFacingError, match=r"^task.tools.t=my_tools.py:no_doc: .*docstring"):
        validate(cfg)
    cfg = task_cfg("gsm8k", prompt="chat", tools={"t": "missing.py:add"})
    with pytest.raises(UserFacingError, match=r"task.tools.t"):
        validate(cfg)
    cfg = task_cfg("gsm8k", prompt="chat", environment="my_tools.py:add")
    with pytest.raises(UserFacingError, match=r"^task.environment=my_tools.py:add: add is not a class"):
        validate(cfg)


def test_max_turns_below_one_is_one_line():
    cfg = compose_config(["task=guess_number", "task.max_turns=0"])
    with pytest.raises(UserFacingError, match=r"task.max_turns"):
        validate_config(cfg)


def test_relative_tool_and_environment_files_are_made_absolute_against_the_start_folder(tmp_path):
    write_my_tools(tmp_path)
    cfg = task_cfg(
        "gsm8k", prompt="chat", tools={"add": "my_tools.py:add", "calc": "grpo_cli.episodes.builtin_tools:calculator"}
    )
    absolutize_task_paths(cfg, tmp_path)
    assert cfg.tools == {"add": f"{tmp_path / 'my_tools.py'}:add", "calc": "grpo_cli.episodes.builtin_tools:calculator"}
    validate(cfg)  # loads from the absolute path, whatever the working directory
    env = task_cfg("guess_number", environment={"_target_": "envs.py:Game", "size": 3})
    absolutize_task_paths(env, tmp_path)
    assert env.environment == {"_target_": f"{tmp_path / 'envs.py'}:Game", "size": 3}


# ------------------------------------------------------------------------------------- rewards on episodes


def test_a_builtin_reward_grades_the_last_model_turn():
    reward_fn = make_reward_fn(task_cfg("gsm8k_tools"))
    right = episode([USER, CALL, TOOL, {"role": "assistant", "content": "So 72. The answer is 72."}], 1, [[5], [6]])
    wrong = episode([USER, CALL, TOOL, {"role": "assistant", "content": "The answer is 70."}], 1, [[5], [6]])
    only_call = episode([USER, CALL, TOOL], 1, [[5]])  # ended by max_turns on a call: no answer
    for ep in (right, wrong, only_call):
        ep.context = EpisodeContext(Example([USER], "72"), {})
    scores = score_episodes(reward_fn, [right, wrong, only_call])
    assert [r["reward"] for r in scores.rewards] == [1.0, 0.0, 0.0]
    assert all("reward/env" not in r for r in scores.rewards)  # tools give no step reward


def test_the_environments_step_rewards_are_the_env_component_weighted_by_reward_weights_env():
    cfg = task_cfg("guess_number")
    truth = {"target": 37, "low": 1, "high": 100}
    won = episode(
        [USER, {"role": "assistant", "content": "50"}, {"role": "user", "content": "Lower."},
         {"role": "assistant", "content": "37"}],
        1, [[5], [6]], step_rewards=[0.0, 1.0], truth=truth,
    )  # fmt: skip
    lost = episode([USER, {"role": "assistant", "content": "50"}], 1, [[5]], step_rewards=[0.0], truth=truth)
    no_reward = episode([USER, {"role": "assistant", "content": "37"}], 1, [[5]], step_rewards=[None], truth=truth)
    scores = score_episodes(make_reward_fn(cfg), [won, lost, no_reward], env_weight(cfg))
    assert [r["reward"] for r in scores.rewards] == [1.0, 0.0, 0.0]  # correctness weighs 0: the env's reward only
    assert [r.get("reward/env") for r in scores.rewards] == [1.0, 0.0, None]
    assert [r["correctness"] for r in scores.rewards] == [1.0, 0.0, 1.0]  # the last guess (eval/pass@k)
    weighted = dataclasses.replace(
        cfg, reward_weights=dataclasses.replace(cfg.reward_weights, correctness=1.0, env=0.5)
    )
    scores = score_episodes(make_reward_fn(weighted), [won, lost], env_weight(weighted))
    assert [r["reward"] for r in scores.rewards] == [1.5, 0.0]
    assert [r["reward/env"] for r in scores.rewards] == [1.0, 0.0]


def test_custom_rewards_get_the_episodes_messages_and_the_sampled_ids_per_turn(tmp_path, monkeypatch):
    seen = tmp_path / "seen.jsonl"
    monkeypatch.setenv("SEEN_FILE", str(seen))
    (tmp_path / "rewards.py").write_text(textwrap.dedent(REWARDS_PY))
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": [USER], "answer": "72"}) + "\n")
    cfg = CustomTaskConfig(
        name="custom", train_path="train.jsonl", eval_path="train.jsonl", prompt="chat", reward_workers=0,
        rewards={"says_72": "rewards.py:last_says_72"},
        tools={"calculator": "grpo_cli.episodes.builtin_tools:calculator"},
    )  # fmt: skip
    absolutize_paths(cfg, tmp_path)
    validate(cfg)
    truth = load_examples(cfg, "train")[0].ground_truth
    final = {"role": "assistant", "content": "The answer is 72."}
    ep = episode([USER, CALL, TOOL, final], 1, [[11, 12, 2], [13, 2]], truth=truth)
    scores = score_episodes(make_reward_fn(cfg), [ep])
    assert scores.rewards[0]["reward"] == 1.0 and scores.rewards[0]["reward/says_72"] == 1.0
    call = json.loads(seen.read_text())
    assert call["completions"] == [[CALL, TOOL, final]]  # the messages after the prompt, always messages
    assert call["completion_ids"] == [[[11, 12, 2], [13, 2]]]  # each turn's sampled ids

    per_sample = dataclasses.replace(
        cfg, reward_convention="per_sample", rewards={"turns": f"{tmp_path / 'rewards.py'}:per_sample_turns"}
    )
    assert score_episodes(make_reward_fn(per_sample), [ep]).rewards[0]["reward"] == 2.0


def test_a_custom_task_with_an_environment_weighs_env_and_may_have_no_reward_of_its_own(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": [USER], "target": 37}) + "\n")
    cfg = CustomTaskConfig(
        name="custom", train_path="train.jsonl", eval_path="train.jsonl", prompt="chat", reward_workers=0,
        environment="grpo_cli.tasks.guess_number:GuessNumber", reward_weights={"env": 2.0},
    )  # fmt: skip
    absolutize_paths(cfg, tmp_path)
    validate(cfg)
    assert env_weight(cfg) == 2.0
    truth = load_examples(cfg, "train")[0].ground_truth
    won = episode([USER, {"role": "assistant", "content": "37"}], 1, [[5]], step_rewards=[1.0], truth=truth)
    assert score_episodes(make_reward_fn(cfg), [won], env_weight(cfg)).rewards[0]["reward"] == 2.0
    without = dataclasses.replace(cfg, environment=None)  # then a reward of its own is needed, as before
    with pytest.raises(UserFacingError, match=r"^task=custom has no reward: "):
        validate(without)


# ------------------------------------------------------------------------------------------ built-in tasks


def test_guess_number_games_are_drawn_from_the_data_seed_and_the_eval_games_differ():
    cfg = task_cfg("guess_number", n_train=50, n_eval=50)
    train, again, held_out = load_examples(cfg, "train"), load_examples(cfg, "train"), load_examples(cfg, "eval")
    assert train == again and train != held_out and len(train) == 50
    row = episode_row(train[0])
    assert 1 <= row["target"] <= 100 and GuessNumber().reset(row) == train[0].prompt


def test_the_tool_tasks_read_the_local_gsm8k_and_math_samples_as_chat_prompts_with_their_system_message():
    fixtures = Path(__file__).parents[2] / "fixtures"
    gsm8k = load_examples(task_cfg("gsm8k_tools", eval_path=str(fixtures / "gsm8k_sample.jsonl")), "eval")
    math = load_examples(task_cfg("python_math", eval_path=str(fixtures / "math500_sample.jsonl")), "eval")
    for examples, words in ((gsm8k, "calculator tool"), (math, "python tool")):
        prompt = examples[0].prompt
        assert [m["role"] for m in prompt] == ["system", "user"] and words in prompt[0]["content"]
    assert gsm8k[0].ground_truth == "72" and isinstance(math[0].ground_truth, str)


def test_python_math_grades_the_boxed_answer_of_the_last_turn():
    reward_fn = make_reward_fn(task_cfg("python_math"))
    code = {"role": "assistant", "content": '<tool_call>{"name": "python", "arguments": {"code": "print(55)"}}'}
    boxed = {"role": "assistant", "content": "It printed 55, so $\\boxed{55}$."}
    ep = episode([USER, code, {"role": "tool", "content": "55"}, boxed], 1, [[5], [6]])
    ep.context = EpisodeContext(Example([USER], "55"), {})
    assert score_episodes(reward_fn, [ep]).rewards[0]["reward"] == 1.0


# ------------------------------------------------------------------ episodes scored as documented (issue #39)

GUESS_PY = Path(__file__).parents[3] / "examples" / "multiturn_guess" / "guess.py"


def guess8_cfg(tmp_path: Path, **keys) -> CustomTaskConfig:
    """examples/multiturn_guess's layout: task=custom, its GuessNumber environment the only reward."""
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"target": t}) + "\n" for t in (5, 3)))
    cfg = CustomTaskConfig(
        name="custom", train_path="train.jsonl", eval_path="train.jsonl", prompt="chat", reward_workers=0,
        template="Guess my number.", environment=f"{GUESS_PY}:GuessNumber", max_turns=3,
    )  # fmt: skip
    for key, value in keys.items():
        setattr(cfg, key, value)
    absolutize_paths(cfg, tmp_path)
    validate(cfg)
    return cfg


def played(example: Example, guesses: list[str]) -> Episode:
    """An episode of examples/multiturn_guess's GuessNumber, played for real on `guesses`: its messages and step
    rewards are the environment's own (a direct call of the user's class on the same messages)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("guess_for_test", GUESS_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    env = module.GuessNumber()
    row = episode_row(example)
    messages = env.reset(row)
    opening, rewards, turns, ended = list(messages), [], [], ""
    for index, guess in enumerate(guesses):
        messages.append({"role": "assistant", "content": guess})
        turns.append([10 + index])
        observation, reward, done = env.step(messages)
        rewards.append(reward)
        messages.extend(observation or [])
        if done:
            ended = "done"
            break
    ep = episode(messages, len(opening), turns, rewards, example.ground_truth)
    ep.context = EpisodeContext(example, row)
    ep.stop_reason = ended or "max_turns"
    ep.turn_limited = not ended
    return ep


def test_correctness_of_an_environment_only_task_is_the_environments_reward(tmp_path):
    from grpo_cli.rollout.episode_rollout import transcript
    from grpo_cli.rollout.evaluation import summarize

    cfg = guess8_cfg(tmp_path)
    five, three = load_examples(cfg, "eval")
    episodes = [
        played(five, ["4", "5"]),  # found: the environment's reward 1
        played(five, ["1", "2", "3"]),  # out of turns: 0
        played(three, ["3"]),
        played(three, ["8", "7", "6"]),
    ]
    env = [sum(r for r in e.step_rewards if r is not None) for e in episodes]
    assert env == [1.0, 0.0, 1.0, 0.0]  # the environment's own answers on these messages
    scores = score_episodes(make_reward_fn(cfg), episodes, env_weight(cfg))
    texts = [e.messages[-1]["content"] for e in episodes]
    metrics, records = summarize(
        ["p5", "p3"], texts, [e.context.example.ground_truth for e in episodes], scores, [1] * 4, [False] * 4, 2,
        transcripts=[transcript(e) for e in episodes],
    )  # fmt: skip
    # eval/reward is the environment's mean, and so are mean@2, pass@1 (each prompt won 1 of 2) and the correctness
    # of each record; before, correctness was the custom rewards' total without env: 0 everywhere.
    assert metrics["eval/reward"] == sum(env) / 4 == 0.5
    assert metrics["eval/mean@2"] == metrics["eval/pass@1"] == 0.5 and metrics["eval/pass@2"] == 1.0
    assert [r["correctness"] for r in records] == env == [r["answer_reward"] for r in records]


def test_answer_from_env_is_a_choice_beside_the_rewards_and_needs_an_environment(tmp_path):
    (tmp_path / "r.py").write_text("def short(completions, **kw):\n    return [0.5 for _ in completions]\n")
    cfg = guess8_cfg(tmp_path, rewards={"short": f"{tmp_path / 'r.py'}:short"})
    five, _ = load_examples(cfg, "eval")
    won, lost = played(five, ["5"]), played(five, ["1", "2", "3"])
    # two weighted rewards: the default is the weighted total (env included), so correctness is 1.5 and 0.5
    total = score_episodes(make_reward_fn(cfg), [won, lost], env_weight(cfg)).rewards
    assert [r["reward"] for r in total] == [1.5, 0.5] and [r["correctness"] for r in total] == [1.5, 0.5]
    chosen = guess8_cfg(tmp_path, rewards={"short": f"{tmp_path / 'r.py'}:short"}, answer_from="env")
    scores = score_episodes(make_reward_fn(chosen), [won, lost], env_weight(chosen)).rewards
    assert [r["correctness"] for r in scores] == [1.0, 0.0] and [r["reward/short"] for r in scores] == [0.5, 0.5]
    with pytest.raises(UserFacingError, match=r"^task.answer_from=env without task.environment: "):
        guess8_cfg(tmp_path, rewards={"short": f"{tmp_path / 'r.py'}:short"}, answer_from="env", environment=None)


def test_no_correctness_is_never_a_silent_zero_the_metrics_are_not_logged_and_one_line_says_why(tmp_path, caplog):
    from grpo_cli.rollout.evaluation import summarize

    rewards = "def some(completions, **kw):\n    return [None if len(c) > 2 else 1.0 for c in completions]\n"
    (tmp_path / "r.py").write_text(rewards)
    cfg = guess8_cfg(tmp_path, rewards={"some": f"{tmp_path / 'r.py'}:some"}, answer_from="some")
    five, _ = load_examples(cfg, "eval")
    episodes = [played(five, ["5"]), played(five, ["1", "2", "3"])]  # the second: `some` gives None
    scores = score_episodes(make_reward_fn(cfg), episodes, env_weight(cfg))
    assert scores.rewards[0]["correctness"] == 1.0 and "correctness" not in scores.rewards[1]
    with caplog.at_level("WARNING"):
        metrics, records = summarize(["p"], ["5", "3"], [five.ground_truth] * 2, scores, [1, 1], [False] * 2, 2)
    assert not any(key.startswith(("eval/mean@", "eval/pass@", "eval/maj@")) for key in metrics)
    assert [r["correctness"] for r in records] == [1.0, None]
    (line,) = [r.getMessage() for r in caplog.records if "not logged" in r.getMessage()]
    assert "1 of 2 samples have no correctness (task.answer_from=some gave no value (None)" in line


def test_a_skipped_episode_gets_no_reward_of_any_component(tmp_path):
    cfg = guess8_cfg(tmp_path, on_reward_error="skip")
    five, three = load_examples(cfg, "eval")
    failed = played(five, ["1", "5"])
    failed.step_rewards = [0.5]  # what its first step earned before the second failed
    failed.error, failed.stop_reason = "raised ValueError: the board", "error"
    kept = played(three, ["3"])
    scores = score_episodes(make_reward_fn(cfg), [failed, kept], env_weight(cfg))
    assert scores.skipped == [0] and scores.n_errors == 1
    assert not any(k.startswith("reward/") for k in scores.rewards[0]) and "correctness" not in scores.rewards[0]
    assert scores.rewards[1]["reward/env"] == 1.0
    # the means are over the scored episode alone (before: the failed episode kept its 0.5 and counted)
    assert scores.mean("reward") == 1.0 and scores.component_mean("reward/env") == 1.0


def test_a_turn_limited_episode_has_no_final_answer_even_with_a_call_pending():
    reward_fn = make_reward_fn(task_cfg("gsm8k_tools"))
    pending = {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "72"}}'}
    cut = episode([USER, CALL, TOOL, pending, TOOL], 1, [[5], [6]])
    cut.context = EpisodeContext(Example([USER], "72"), {})
    cut.stop_reason, cut.turn_limited = "max_turns", True
    assert reward_fn(pending["content"], "72")["reward"] == 1.0  # the last number of the call: before, it scored 1
    assert score_episodes(reward_fn, [cut]).rewards[0]["reward"] == reward_fn("", "72")["reward"] == 0.0


TRL_PROMPTS_PY = """
import json, os

def opening_length(prompts, completions, **kwargs):
    with open(os.environ["SEEN_FILE"], "a") as f:
        f.write(json.dumps(prompts) + "\\n")
    return [float(len(p[0]["content"])) for p in prompts]
"""


def test_trl_rewards_get_the_opening_the_environment_gave_as_prompts(tmp_path, monkeypatch):
    seen = tmp_path / "seen.jsonl"
    monkeypatch.setenv("SEEN_FILE", str(seen))
    (tmp_path / "p.py").write_text(TRL_PROMPTS_PY)
    cfg = guess8_cfg(tmp_path, rewards={"opening": f"{tmp_path / 'p.py'}:opening_length"})
    five, _ = load_examples(cfg, "eval")
    ep = played(five, ["5"])
    assert ep.prompt_messages != five.prompt  # reset() gave its own opening, not the row's "Guess my number."
    scores = score_episodes(make_reward_fn(cfg), [ep], env_weight(cfg))
    assert json.loads(seen.read_text()) == [ep.prompt_messages]
    # a direct call of the user's function on the same messages gives the same reward
    import importlib.util

    spec = importlib.util.spec_from_file_location("p_direct", tmp_path / "p.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    direct = module.opening_length(prompts=[ep.prompt_messages], completions=[ep.completion_messages])
    assert scores.rewards[0]["reward/opening"] == direct[0] == len(ep.prompt_messages[0]["content"])
