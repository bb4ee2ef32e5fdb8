"""A bad-input sweep over the agent endpoint (issue #48): what each bad request gets, whether the step goes on, and
how long stuck agents hold it. Loopback only, bounded in count and time.

    python benchmarks/endpoint_sweep.py [--flood 300] [--flood-threads 32]

On the tiny random model (rollout=hf, fp32, the CPU), through a real AgentRun (grpo-cli's endpoint, one worker
process), one episode whose agent sends, from its worker: requests of each wrong type on every route, a body past
the size limit, one nested past what JSON parsing walks, one that is not JSON, a wrong key, an unknown episode, a
streamed call whose client disconnects before the reply, then a flood of parallel calls (malformed, unauthorized and
valid ones of its own episode), then one good call. Then stuck agents against task.agent_timeout_s (in worker
processes and as threads, task.reward_workers=0), and an engine that fails on a checked call. Prints one markdown
table per part (docs/results/2026-12-06-endpoint-sweep.md holds a run's output).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from grpo_cli.episodes.turns import EpisodeLimits
from grpo_cli.models import TINY_RANDOM, load_policy
from grpo_cli.rollout import HFRolloutEngine, SamplingSettings
from grpo_cli.rollout.agent_run import AgentRun, AgentSettings
from grpo_cli.tasks.base import Example

AGENT = """
import json, socket, time
from concurrent.futures import ThreadPoolExecutor
import httpx

OUT = {out!r}
FLOOD, THREADS = {flood}, {threads}
HUGE = 8 * 1024 * 1024 + 1

def sweep(row, base_url, api_key):
    headers = {{"Authorization": f"Bearer {{api_key}}"}}
    root = base_url.removesuffix("/v1")
    chat, completions = f"{{base_url}}/chat/completions", f"{{base_url}}/completions"
    generate = f"{{root}}/inference/v1/generate"
    ask = lambda **fields: {{"model": "p", "messages": row["prompt"], "max_tokens": 4, **fields}}
    tokens = lambda **params: {{"model": "p", "token_ids": [1, 2, 3], "sampling_params": {{"max_tokens": 4, **params}}}}
    cases = {{
        "generate temperature='hot'": (generate, tokens(temperature="hot")),
        "generate stop=5": (generate, tokens(stop=5)),
        "generate temperature=-3": (generate, tokens(temperature=-3)),
        "generate top_p=7": (generate, tokens(top_p=7)),
        "generate n='x'": (generate, tokens(n="x")),
        "generate top_k=5": (generate, tokens(top_k=5)),
        "generate logit_bias={{'3': 5}}": (generate, tokens(logit_bias={{"3": 5}})),
        "generate token_ids=[10**9]": (generate, {{"token_ids": [10**9]}}),
        "generate token_ids='1 2'": (generate, {{"token_ids": "1 2"}}),
        "chat temperature=0.2 (run: 0.7)": (chat, ask(temperature=0.2)),
        "chat top_p=0.5": (chat, ask(top_p=0.5)),
        "chat max_tokens='4'": (chat, ask(max_tokens="4")),
        "chat n=1000": (chat, ask(n=1000)),
        "chat messages=[]": (chat, ask(messages=[])),
        "chat messages='hi'": (chat, ask(messages="hi")),
        "chat response_format json_object": (chat, ask(response_format={{"type": "json_object"}})),
        "chat tool_choice='required'": (chat, ask(tool_choice="required")),
        "chat presence_penalty=1": (chat, ask(presence_penalty=1)),
        "chat unknown field 'frobnicate'": (chat, ask(frobnicate=1)),
        "chat top_logprobs=3": (chat, ask(logprobs=True, top_logprobs=3)),
        "completions prompt=5": (completions, {{"prompt": 5}}),
        "completions prompt=[1, -1]": (completions, {{"prompt": [1, -1]}}),
        "body a JSON list": (chat, ["a", "list"]),
    }}
    rows = []
    def record(name, reply):
        try:
            error = reply.json().get("error") or {{}}
        except ValueError:
            error = {{"message": reply.text[:80]}}
        message = (error.get("message") or "")[:150]
        rows.append([name, reply.status_code, error.get("code"), error.get("param"), message])
    for name, (url, body) in cases.items():
        record(name, httpx.post(url, headers=headers, json=body, timeout=60))
    huge = b'{{"messages": "' + b"x" * HUGE + b'"}}'
    record(f"body of {{HUGE}} bytes", httpx.post(chat, headers=headers, content=huge, timeout=60))
    nested = b"[" * 100000 + b"]" * 100000
    record("body nested 100000 deep", httpx.post(chat, headers=headers, content=nested, timeout=60))
    record("body not JSON", httpx.post(chat, headers=headers, content=b"{{not json", timeout=60))
    record("wrong key", httpx.post(chat, headers={{"Authorization": "Bearer nope"}}, json=ask(), timeout=60))
    elsewhere = chat.replace(root.rsplit("/", 1)[1], "0123456789abcdef")
    record("unknown episode", httpx.post(elsewhere, headers=headers, json=ask(), timeout=60))
    # A streamed call whose client goes away before the reply: the raw request, then the socket closed.
    host, port = root.split("//")[1].split("/")[0].split(":")
    body = json.dumps(ask(stream=True)).encode()
    path = chat.split(port, 1)[1]
    request = (f"POST {{path}} HTTP/1.1\\r\\nHost: {{host}}\\r\\nAuthorization: Bearer {{api_key}}\\r\\n"
               f"Content-Type: application/json\\r\\nContent-Length: {{len(body)}}\\r\\n\\r\\n").encode() + body
    with socket.create_connection((host, int(port))) as s:
        s.sendall(request)
    time.sleep(0.5)
    again = httpx.post(chat, headers=headers, json=ask(), timeout=60)
    record("the same call again after the client disconnected", again)
    # The flood: malformed, unauthorized and valid calls (retries of the episode's last call), all at once.
    kinds = [("malformed", headers, tokens(temperature="hot")), ("wrong key", {{"Authorization": "Bearer x"}}, ask()),
             ("valid", headers, ask())]
    def one(k):
        kind, h, b = kinds[k % 3]
        started = time.monotonic()
        reply = httpx.post(generate if kind == "malformed" else chat, headers=h, json=b, timeout=120)
        return kind, reply.status_code, time.monotonic() - started
    started = time.monotonic()
    with ThreadPoolExecutor(THREADS) as pool:
        flood = list(pool.map(one, range(FLOOD)))
    took = time.monotonic() - started
    counts = {{}}
    for kind, status, _ in flood:
        counts[f"{{kind}} {{status}}"] = counts.get(f"{{kind}} {{status}}", 0) + 1
    slowest = max(s for _, _, s in flood)
    record("a good call after the flood", httpx.post(chat, headers=headers, json=ask(), timeout=60))
    with open(OUT, "w") as f:
        json.dump({{"rows": rows, "flood": counts, "flood_s": took, "slowest_s": slowest}}, f)
    return 1.0

def stuck(row, base_url):
    time.sleep(60)
"""


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def agent_run(tokenizer: Any, path: Path, fn: str, workers: int, timeout: float, max_turns: int = 64) -> AgentRun:
    settings = AgentSettings(
        f"{path}:{fn}", str(path.parent), workers, timeout, EpisodeLimits(max_turns, 8), "skip", 1.0, "tiny"
    )
    return AgentRun(settings, tokenizer, lambda *a, **k: None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flood", type=int, default=300)
    parser.add_argument("--flood-threads", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_policy(TINY_RANDOM, torch.device("cpu"), torch.float32, seed=0)
    engine = HFRolloutEngine(model, tokenizer)
    settings = SamplingSettings(n=1, temperature=0.7, max_tokens=8, seed=5)
    folder = Path(tempfile.mkdtemp(prefix="endpoint-sweep-"))
    out = folder / "sweep.json"
    path = folder / "agent.py"
    path.write_text(textwrap.dedent(AGENT.format(out=str(out), flood=args.flood, threads=args.flood_threads)))
    example = [Example([{"role": "user", "content": "Add 2 and 3."}], None)]

    run = agent_run(tokenizer, path, "sweep", workers=1, timeout=300.0, max_turns=1000)
    started = time.monotonic()
    try:
        (episode,) = run.sample(engine, settings, example).episodes
    finally:
        run.close()
    step_s = time.monotonic() - started
    found = json.loads(out.read_text())
    print("## Requests\n")
    print(table(["request", "HTTP", "code", "param", "message"], found["rows"]))
    flood = ", ".join(f"{k}: {v}" for k, v in sorted(found["flood"].items()))
    print(f"\nflood of {args.flood} calls ({args.flood_threads} threads): {flood}; {found['flood_s']:.1f} s, ")
    print(f"slowest call {found['slowest_s']:.2f} s")
    print(
        f"\nthe step: {step_s:.1f} s; the episode: error={episode.error!r}, reward={episode.step_reward}, "
        f"turns={episode.n_turns}, counts={dict(episode.counts)}, stop={episode.stop_reason}"
    )

    print("\n## Stuck agents (task.agent_timeout_s=2, 4 episodes, each sleeping 60 s)\n")
    rows = []
    for workers in (1, 0):
        run = agent_run(tokenizer, path, "stuck", workers=workers, timeout=2.0)
        started = time.monotonic()
        try:
            episodes = run.sample(engine, settings, example * 4).episodes
        finally:
            run.close()
        errors = Counter(str(e.error) for e in episodes)
        rows.append([workers, f"{time.monotonic() - started:.1f}", "; ".join(f"{n} x {e}" for e, n in errors.items())])
    print(table(["task.reward_workers", "step s", "episodes' errors"], rows))

    print("\n## An engine that fails on a checked call\n")

    class FailingEngine(HFRolloutEngine):
        def generate(self, prompt_ids: Any, settings: Any) -> Any:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    path.write_text(
        path.read_text()
        + "\ndef once(row, client):\n    client.chat.completions.create(model='p', messages=row['prompt'])\n"
    )
    run = agent_run(tokenizer, path, "once", workers=1, timeout=60.0)
    try:
        run.sample(FailingEngine(model, tokenizer), settings, example)
    except Exception as e:  # noqa: BLE001 - what the run stops with is the measurement
        print(f"{type(e).__name__}: {e}")
    finally:
        run.close()


if __name__ == "__main__":
    main()
