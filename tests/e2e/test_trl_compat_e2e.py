"""The grpo-run end-to-end half of tests/unit/tasks/test_trl_compat.py: grpo-run as a subprocess."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO_ROOT, run_grpo
from tests.unit.tasks.test_custom_task import rows_jsonl as jsonl
from tests.unit.tasks.test_custom_task import write
from tests.unit.tasks.test_trl_compat import trl_rewards

E2E_REWARDS = """
def ids_seen(completion_ids, trainer_state, log_extra, log_metric, **kwargs):
    # Shows what the run passes: the sampled ids and the step, as eval-file columns and a metric.
    log_extra("ids", completion_ids)
    log_extra("global_step", [trainer_state.global_step] * len(completion_ids))
    log_metric("ids_mean", sum(len(ids) for ids in completion_ids) / len(completion_ids))
    return [None for _ in completion_ids]
"""


E2E_TASK = """
defaults:
  - custom
  - _self_
train_path: data.jsonl
eval_path: data.jsonl
n_train: null
n_eval: null
rewards:
  think: trl.rewards.think_format_reward
  acc: trl.rewards.accuracy_reward
  reasoning: {_target_: trl.rewards.reasoning_accuracy_reward, _partial_: true}
  rep: {_target_: trl.rewards.get_repetition_penalty_reward, ngram_size: 2, max_penalty: -0.5}
  cos: {_target_: trl.rewards.get_cosine_scaled_reward, max_len: 8}
  long: {_target_: trl.rewards.get_soft_overlong_punishment, max_completion_len: 8, soft_punish_cache: 4}
cases_path: cases.jsonl
"""


def trl_direct(rewards, responses: list[str], solution: list[str], ids: list[list[int]]) -> dict[str, list]:
    """The values of E2E_TASK's six functions called directly on a batch."""
    completions = [[{"role": "assistant", "content": r}] for r in responses]
    return {
        "think": rewards.think_format_reward(completions),
        "acc": rewards.accuracy_reward(completions, solution),
        "reasoning": rewards.reasoning_accuracy_reward(completions, solution),
        "rep": rewards.get_repetition_penalty_reward(ngram_size=2, max_penalty=-0.5)(ids),
        "cos": rewards.get_cosine_scaled_reward(max_len=8)(completions, solution, ids),
        "long": rewards.get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4)(ids),
    }


@pytest.mark.slow
def test_trls_functions_through_check_reward_and_a_two_step_run_give_their_direct_values(tmp_path):
    rewards = trl_rewards()
    from grpo_cli.models import TINY_RANDOM, load_tokenizer

    rows = [
        {
            "prompt": [{"role": "system", "content": "Think, then box."}, {"role": "user", "content": f"{i} + {i}?"}],
            "solution": str(2 * i),
        }
        for i in range(4)
    ]
    responses = [r"<think>2+2</think> \boxed{4}", r"\boxed{3}", "a b a b a b a b a b", r"<think>x</think>\boxed{6}"]
    case_ids = [[5, 6, 2], [9] * 6, [7, 8, 7, 8, 7, 8, 7, 8, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    solutions = ["4", "2", "0", "6"]
    direct = trl_direct(rewards, responses, solutions, case_ids)
    cases = [
        {
            "prompt": rows[0]["prompt"],
            "solution": s,
            "response": r,
            "completion_ids": ids,
            "expected": {name: values[i] for name, values in direct.items()},
        }
        for i, (r, s, ids) in enumerate(zip(responses, solutions, case_ids, strict=True))
    ]
    write(
        tmp_path,
        {
            "data.jsonl": jsonl(rows),
            "cases.jsonl": jsonl(cases),
            "rewards.py": E2E_REWARDS,
            "conf/task/trl.yaml": E2E_TASK,
        },
    )
    check = run_grpo(["--config-dir", "conf", "task=trl", "job=check_reward", "output_dir=check"], cwd=tmp_path)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-2000:]
    assert "all 4 cases agree" in check.stdout

    run = run_grpo(
        [
            "--config-dir",
            "conf",
            "task=trl",
            "model=tiny_random",
            "task.rewards.ids=rewards.py:ids_seen",  # a name the YAML does not have, without +
            "train.steps=2",
            "train.rollout_batch_size=4",
            "train.group_size=2",
            "train.train_batch_size=4",
            "train.eval_every=1",
            "rollout.eval_temperature=1.0",  # sampled, so the eval completions differ
            "rollout.max_tokens=10",
            "output_dir=run",
        ],
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if "train/reward" in m]
    assert len(train) == 2 and all("train/ids_mean" in m and "train/reward/long" in m for m in train)
    tokenizer = load_tokenizer(TINY_RANDOM)
    for step in (0, 1, 2):
        records = [json.loads(line) for line in (tmp_path / "run" / "eval" / f"step_{step:05d}.jsonl").open()]
        ids = [r["ids"] for r in records]
        # the sampled ids: as many as the engine counted, decoding to the response the rewards read
        assert [len(i) for i in ids] == [r["n_tokens"] for r in records]
        assert [tokenizer.decode(i, skip_special_tokens=True) for i in ids] == [r["response"] for r in records]
        assert {r["global_step"] for r in records} == {step}  # trainer_state.global_step: updates behind them
        assert "gold_parsed" in records[0]  # accuracy_reward's own log_extra columns
        values = trl_direct(
            rewards, [r["response"] for r in records], [r["ground_truth"]["solution"] for r in records], ids
        )
        for name, expected in values.items():
            assert [r.get(f"reward/{name}") for r in records] == expected, (step, name)
    assert "eval/ids_mean" in metrics[0]


@pytest.mark.slow
def test_the_readmes_task_custom_line_runs_as_written(tmp_path):
    import shlex

    repo = REPO_ROOT
    line = next(
        text.strip() for text in (repo / "README.md").read_text().splitlines() if "grpo-run task=custom" in text
    )
    # The README's line runs from any folder: task.base_dir names the example's folder (here, this checkout's).
    args = shlex.split(line.replace("/path/to/grpo-cli", str(repo)))[1:]
    # as written, then only what makes it a seconds-long run (a tiny model, one short step) and where it writes
    quick = ["model=tiny_random", "train.steps=1", "train.rollout_batch_size=4", "train.group_size=2"]
    # hydra.run.dir, not output_dir: Hydra writes its .hydra/ there, which must not land in the repository's folder
    quick += ["train.train_batch_size=4", "task.n_eval=2", "rollout.max_tokens=8", f"hydra.run.dir={tmp_path / 'run'}"]
    run = run_grpo([*args, *quick], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("train/reward/f" in row and "train/boxed_frac" in row for row in rows)
