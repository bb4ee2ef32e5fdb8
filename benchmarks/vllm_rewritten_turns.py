"""Why vLLM's own OpenAI server (rollout.openai_server=vllm) starts new segments: for every chat call whose prompt ids
(vLLM's rendering of the whole conversation) do not extend the episode's ids so far, print where the two part, as
text and ids. The same agent and openings as benchmarks/vllm_openai_server.py.

    python benchmarks/vllm_rewritten_turns.py [--model smollm2] [--batches 3] [--episodes 8] [--max-tokens 32]

A diagnostic, not a timing: it wraps AgentEpisode.plan_tokens to compare each call's ids with the episode's.
"""

from __future__ import annotations

import argparse
import tempfile
import textwrap
from pathlib import Path

import torch
from agent_endpoint import AGENT, OBSERVATION, opening
from vllm_openai_server import MODELS

from grpo_cli.config import VLLMRolloutConfig
from grpo_cli.endpoint.recording import AgentEpisode
from grpo_cli.engines.vllm_engine import VLLMRolloutEngine
from grpo_cli.episodes.turns import EpisodeLimits
from grpo_cli.models import load_policy
from grpo_cli.rollout import SamplingSettings
from grpo_cli.rollout.agent_run import AgentRun, AgentSettings
from grpo_cli.tasks.base import Example


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    model, tokenizer = load_policy(MODELS[args.model], torch.device("cpu"), torch.float32, seed=0)
    folder = Path(tempfile.mkdtemp(prefix="vllm-rewrites-"))
    (folder / "agent.py").write_text(textwrap.dedent(AGENT.format(turns=3, observation=OBSERVATION)), encoding="utf-8")
    planned = AgentEpisode.plan_tokens
    parted: list[str] = []

    def compared(self: AgentEpisode, ids, n, max_tokens, messages=None):  # noqa: ANN001 - plan_tokens' own
        if self.segment is not None and self._replies:
            so_far = [*self.segment.prompt_ids, *self.segment.ids, *self._replies[0].turn.ids]
            if list(ids[: len(so_far)]) != so_far:
                k = next(
                    (i for i, (a, b) in enumerate(zip(so_far, ids, strict=False)) if a != b), min(len(so_far), len(ids))
                )
                sampled, rendered = so_far[max(0, k - 3) : k + 3], list(ids[max(0, k - 3) : k + 3])
                parted.append(
                    f"  at id {k} of {len(so_far)}: sampled {tokenizer.decode(sampled)!r} {sampled}, "
                    f"vLLM rendered {tokenizer.decode(rendered)!r} {rendered}"
                )
        return planned(self, ids, n, max_tokens, messages)

    AgentEpisode.plan_tokens = compared  # type: ignore[method-assign]
    rollout = VLLMRolloutConfig(engine="vllm", temperature=1.0, openai_server="vllm", sync_probe=False)
    engine = VLLMRolloutEngine(model, tokenizer, rollout, served_model_name="policy")
    limits = EpisodeLimits(3, args.max_tokens)
    run = AgentRun(
        AgentSettings(f"{folder}/agent.py:agent", str(folder), 0, 600.0, limits, "stop", 1.0, "policy"),
        tokenizer,
        lambda *a, **k: None,
    )
    try:
        for batch in range(args.batches):
            settings = SamplingSettings(n=1, temperature=1.0, max_tokens=args.max_tokens, seed=7 + batch)
            run.sample(engine, settings, [Example(opening(i), None) for i in range(args.episodes)])
    finally:
        run.close()
        engine.close()
    calls = args.batches * args.episodes * 2
    print(f"{len(parted)} of {calls} continuing calls did not extend the episode's ids ({args.model}, temperature 1):")
    print("\n".join(parted))


if __name__ == "__main__":
    main()
