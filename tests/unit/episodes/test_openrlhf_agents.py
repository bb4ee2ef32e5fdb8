"""OpenRLHF's agent class through task.environment (episodes/adapters/openrlhf.py), on OpenRLHF's own files copied
unchanged into tests/fixtures/peers/openrlhf/: its examples/python/agent_func.py, run by its own
MultiTurnAgentExecutor (openrlhf/utils/agent.py) for the expected numbers, and by grpo-run's job=check_reward."""

from __future__ import annotations

import asyncio
import io
import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from rich.console import Console

from grpo_cli.errors import UserFacingError
from grpo_cli.jobs.check_reward import run as check_reward
from grpo_cli.models import EMBEDDED_SMOLLM2, load_tokenizer
from grpo_cli.tasks.custom import CustomTaskConfig, absolutize_paths
from tests.conftest import REPO_ROOT, compose_config

PEERS = REPO_ROOT / "tests" / "fixtures" / "peers" / "openrlhf"
SEED = 7
ACTIONS = ["I think it is 4.", "Let me check again: 4.", "Final answer: 4.", "Still 4."]


class ScriptedEngine:
    """OpenRLHF's llm_engine.generate, answering each call with the next scripted action."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.queue = tokenizer, list(ACTIONS)

    async def generate(self, prompt_ids, sampling_params, multi_modal_data=None):
        text = self.queue.pop(0)
        ids = self.tokenizer(text=text, add_special_tokens=False)["input_ids"]
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, text=text, logprobs=None)])


def openrlhfs_own_rewards(n_cases: int, prompt: str, label: str) -> list[tuple[float, int]]:
    """(total reward, steps) of each case as OpenRLHF's MultiTurnAgentExecutor runs agent_func's AgentInstance."""
    sys.path.insert(0, str(PEERS))
    try:
        agent_func = __import__("agent_func")
    finally:
        sys.path.remove(str(PEERS))
    tokenizer = load_tokenizer(EMBEDDED_SMOLLM2)
    executor = agent_func.AgentExecutor()
    out = []
    for _ in range(n_cases):
        engine = ScriptedEngine(tokenizer)
        params = SimpleNamespace(max_tokens=64, logprobs=None)
        result = asyncio.run(executor.execute(prompt, label, params, 100_000, tokenizer, engine))
        out.append((result["reward"], len(result["action_ranges"])))
    return out


def test_openrlhfs_agent_func_scores_as_openrlhfs_own_executor(tmp_path: Path) -> None:
    prompt, label, n_cases = "What is 2 + 2?", "4", 6
    random.seed(SEED)
    torch.manual_seed(SEED)
    expected = openrlhfs_own_rewards(n_cases, prompt, label)
    assert len({steps for _, steps in expected}) > 1 and len({r for r, _ in expected}) > 1, "varied episodes"
    cases = [
        {"prompt": prompt, "label": label, "turns": ACTIONS, "expected": {"env": reward},
         "why": "OpenRLHF's MultiTurnAgentExecutor on agent_func.AgentInstance"}
        for reward, _ in expected
    ]  # fmt: skip
    (tmp_path / "cases.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cases))
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": prompt, "label": label}) + "\n")
    node = {
        "_target_": "grpo_cli.episodes.adapters.openrlhf.OpenRLHFAgent",
        "agent": f"{PEERS}/agent_func.py:AgentInstance",
    }
    task = CustomTaskConfig(
        name="custom", train_path="train.jsonl", eval_path="train.jsonl", cases_path="cases.jsonl", environment=node
    )  # type: ignore[arg-type]
    task.reward_workers = 0  # in this process: the seeds below drive OpenRLHF's run and ours alike
    task.max_turns = len(ACTIONS)
    absolutize_paths(task, tmp_path)
    cfg = compose_config(["job=check_reward", "task=custom", f"task.base_dir={tmp_path}"])
    cfg.task = task
    out = Console(file=io.StringIO(), width=240, highlight=False)
    random.seed(SEED)
    torch.manual_seed(SEED)
    try:
        assert check_reward(cfg, tmp_path, out) == {"n": n_cases, "n_disagree": 0}
    except UserFacingError as error:
        raise AssertionError(out.file.getvalue()) from error
    text = out.file.getvalue()
    # each episode ran as many model turns as OpenRLHF's steps, the feedback as the next user message
    for index, (_, steps) in enumerate(expected, start=1):
        block = text.split(f"case {index}:\n")[1].split("\ncase ")[0]
        assert block.count("assistant: ") == steps and "ended: done" in block
    assert "[INCORRECT]" in text and "[CORRECT]" in text
