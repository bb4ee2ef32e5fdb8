"""A skyrl-gym environment, installed and unchanged, trained on through grpo-run (docs/multi-turn.md#environments):
SkyRL's own gsm8k_multi_turn rows (examples/train/turn_level_rewards/gsm8k_multi_turn_dataset.py's shape) through
the SkyRL adapter, 2 steps of the tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import episodes_of, train_to_the_end

# The random model never writes "#### N", so the environment's reward is 0 throughout; a reward of the user's own
# (the last turn's length parity) gives each group a signal, so the 2 steps update the weights.
PARITY_PY = """
def parity(completions, **kwargs):
    return [float(len(messages[-1]["content"]) % 2) for messages in completions]
"""


def skyrl_rows(n: int) -> list[dict]:
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f'What is {3 + i} times {4 + i}? Answer after "####".'}],
            "env_class": "gsm8k_multi_turn",
            "reward_spec": {"method": "rule", "ground_truth": str((3 + i) * (4 + i))},
            "extra_info": {"max_turns": 5, "split": "train", "index": i},
        }
        for i in range(n)
    ]


def test_a_skyrl_gym_environment_trains_two_steps(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in skyrl_rows(8)))
    (tmp_path / "rewards.py").write_text(PARITY_PY)
    run_dir = tmp_path / "run"
    args = [
        "debug=smoke",
        "task=custom",
        "task.train_path=train.jsonl",
        "task.eval_path=train.jsonl",
        "task.prompt=chat",
        "task.environment={_target_: grpo_cli.episodes.environments.SkyRLGymEnvironment, env: gsm8k_multi_turn}",
        "task.rewards={parity: rewards.py:parity}",
        "task.max_turns=2",
        "train.eval_every=0",
        "model.mixed_precision=no",
    ]
    rows = train_to_the_end(args, tmp_path, run_dir, timeout=300)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/reward/env"] == 0.0 and r["train/turns"] == 2.0 for r in rows)
    assert any(r["train/grad_norm"] > 0 for r in rows)
    for episode in episodes_of(run_dir, 1):
        # task.max_turns=2 reached the environment as extras["max_turns"] (the row says 5): after the first turn it
        # asks for the final answer, and it ends the episode itself at the second (done, not turn-limited).
        assert episode["messages"][2]["content"].startswith("Now provide only the final numeric answer")
        assert episode["stop_reason"] == "done" and episode["turns"] == 2
