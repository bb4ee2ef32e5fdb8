"""What driving episodes through the OpenAI-compatible endpoint (task.agent) costs against the same conversations run
by the rollout's own episode loop (task.environment): one batch of E episodes of T model turns each, the same
opening, the same fixed observation after every turn, the same sampling settings, each way in turn, alternating
their order every round (the first round is a warm-up and not counted).

    python benchmarks/agent_endpoint.py [--model tiny-random] [--episodes 16] [--turns 3] [--max-tokens 16]
        [--rounds 4] [--workers 1]

The agent side: an OpenAI-client loop of a few lines in task.reward_workers worker processes (one thread per
episode), every call through HTTP on loopback, batched by the rollout thread (rollout/agent_run.py). The episode
side: run_on_engine with an in-process hook answering each turn with the same message. Prints each way's median
and minimum seconds, their ratio, the sampled tokens per second, and whether the two sampled the same tokens (they
should: the same random streams per episode and turn, the same prompts).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from grpo_cli.episodes.turns import ChatTemplate, Episode, EpisodeLimits, TurnOutcome, start_episode
from grpo_cli.models import TINY_RANDOM, load_policy
from grpo_cli.rollout import HFRolloutEngine, SamplingSettings
from grpo_cli.rollout.agent_run import AgentRun, AgentSettings
from grpo_cli.rollout.episode_rollout import run_on_engine
from grpo_cli.tasks.base import Example

OBSERVATION = "Noted. Go on."
AGENT = """
from openai import OpenAI

def agent(prompt, base_url, api_key):
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(prompt)
    for _ in range({turns}):
        reply = client.chat.completions.create(model="policy", messages=messages)
        messages += [{{"role": "assistant", "content": reply.choices[0].message.content or ""}},
                     {{"role": "user", "content": "{observation}"}}]
"""


class CountingEngine:
    """The engine, counting its generate calls (a batch split in two costs a second prefill and decode)."""

    def __init__(self, engine: HFRolloutEngine) -> None:
        self.engine, self.calls = engine, 0

    @property
    def context_length(self) -> int | None:
        return self.engine.context_length

    def generate(self, prompt_ids: list[list[int]], settings: SamplingSettings) -> Any:
        self.calls += 1
        return self.engine.generate(prompt_ids, settings)


def opening(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell me about the number {i}."}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=TINY_RANDOM)
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()

    model, tokenizer = load_policy(args.model, torch.device("cpu"), torch.float32, seed=0)
    engine = CountingEngine(HFRolloutEngine(model, tokenizer))
    settings = SamplingSettings(n=1, temperature=1.0, max_tokens=args.max_tokens, seed=7)
    limits = EpisodeLimits(args.turns, args.max_tokens)
    template = ChatTemplate(tokenizer)
    folder = Path(tempfile.mkdtemp(prefix="agent-bench-"))
    (folder / "agent.py").write_text(
        textwrap.dedent(AGENT.format(turns=args.turns, observation=OBSERVATION)), encoding="utf-8"
    )
    agent = AgentRun(
        AgentSettings(f"{folder}/agent.py:agent", str(folder), args.workers, 600.0, limits, "stop", 1.0, "policy"),
        tokenizer,
        lambda *a, **k: None,
    )
    examples = [Example(opening(i), None) for i in range(args.episodes)]

    def hook(episodes: Sequence[Episode]) -> list[TurnOutcome]:
        return [TurnOutcome([{"role": "user", "content": OBSERVATION}]) for _ in episodes]

    def by_loop() -> list[Episode]:
        episodes = [start_episode(template, opening(i)) for i in range(args.episodes)]
        return run_on_engine(engine, settings, episodes, template, hook, limits)

    def by_agent() -> list[Episode]:
        return agent.sample(engine, settings, examples).episodes

    ways = {"episode loop (task.environment)": by_loop, "agent endpoint (task.agent)": by_agent}
    times: dict[str, list[float]] = {name: [] for name in ways}
    tokens: dict[str, int] = {}
    calls: dict[str, list[int]] = {name: [] for name in ways}
    ids: dict[str, list[list[int]]] = {}
    try:
        for round_index in range(args.rounds + 1):
            order = list(ways) if round_index % 2 == 0 else list(reversed(ways))
            for name in order:
                start, before = time.perf_counter(), engine.calls
                episodes = ways[name]()
                elapsed = time.perf_counter() - start
                if round_index:  # round 0 warms up (the worker processes start, the server binds)
                    times[name].append(elapsed)
                    calls[name].append(engine.calls - before)
                tokens[name] = sum(e.model_tokens for e in episodes)
                ids[name] = [[*e.prompt_ids, *e.ids] for e in episodes]
    finally:
        agent.close()
    loop_name, agent_name = list(ways)
    print(
        f"{args.episodes} episodes x {args.turns} turns, <= {args.max_tokens} tokens per turn, {args.model}, "
        f"{torch.get_num_threads()} threads, {args.rounds} rounds after a warm-up"
    )
    for name in ways:
        median = statistics.median(times[name])
        print(
            f"  {name:34s} median {median:6.2f}s  min {min(times[name]):6.2f}s  "
            f"{tokens[name] / median:7.1f} sampled tokens/s  generate calls per batch {calls[name]}"
        )
    ratio = statistics.median(times[agent_name]) / statistics.median(times[loop_name])
    print(f"  agent / loop: {ratio:.2f}x; same sampled tokens: {ids[agent_name] == ids[loop_name]}")


if __name__ == "__main__":
    main()
