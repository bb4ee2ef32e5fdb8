"""task.environment_factory through grpo-run (docs/multi-turn.md#trls-environment_factory): TRL's own 2048 example
(tests/fixtures/peers/trl/grpo_2048.py, unchanged) trains for 2 steps on the tiny random model, its instances in a
worker process, its reward_score reading environments= there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, episodes_of, train_to_the_end

GAME = REPO_ROOT / "tests" / "fixtures" / "peers" / "trl" / "grpo_2048.py"
# A reward the random model's turns differ in, so that groups have signal beside 2048's score (0 without a move).
PARITY = "def parity(completions, **kwargs):\n    return [float(len(c[-1]['content']) % 2) for c in completions]\n"


@pytest.mark.slow
def test_trls_2048_environment_trains_for_two_steps(tmp_path: Path) -> None:
    prompt = [{"role": "user", "content": "Play 2048 on a 4x4 board."}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": prompt, "id": i}) + "\n" for i in range(8)))
    (tmp_path / "parity.py").write_text(PARITY)
    run_dir = tmp_path / "run"
    args = [
        "debug=smoke",
        "task=custom",
        "task.train_path=train.jsonl",
        "task.eval_path=train.jsonl",
        f"task.environment_factory={GAME}:Game2048Env",
        f"+task.rewards.score={GAME}:reward_score",
        "+task.rewards.parity=parity.py:parity",
        "task.max_turns=2",
        "task.reward_timeout_s=120",  # the first reset imports the example's datasets, peft and trl in the worker
        "rollout.max_tokens=6",
        "model.mixed_precision=no",
        "train.eval_every=0",
    ]
    rows = train_to_the_end(args, tmp_path, run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all("train/reward/score" in r and "train/reward/parity" in r for r in rows)
    assert any(r["train/grad_norm"] > 0 for r in rows)
    episodes = episodes_of(run_dir, 1)
    assert episodes
    for episode in episodes:  # the opening is TRL's: reset's board appended to the prompt's last message
        opening = episode["messages"][0]["content"]
        assert opening.startswith(prompt[0]["content"] + "score=0.0\n") and opening.endswith("done=False")
        assert episode["rewards"]["reward/score"] == 0.0  # no move was made: TRL's reward_score is the score, 0
