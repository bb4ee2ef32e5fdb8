"""Agent-driven episodes on the one rollout path: `AgentRun` is a task.agent task's `runs.RolloutRun`.

The user's agents (usercode/agents.py) run in the worker processes and call the policy through the OpenAI-compatible
endpoint (endpoint/server.py); this module is the other side, in the rollout's own thread: it opens one
`recording.AgentEpisode` per sample, gives each agent its episode's URL, and serves their calls on the engine
until every agent has ended, then hands back the episodes as any multi-turn task's (`Samples`), scored by
`multiturn.score_episodes` (the agent's reward is the episode's `env` component beside task.rewards).

Batching. Calls are gathered until every episode still running has one waiting (or none has arrived for a
while: `AgentRun._gather_window`), then sampled together: one engine.generate per (model call number, sampling
fields). Each call is sampled from the random streams of (turn_seed(step seed, its episode's call number), its
episode's index), the streams a task's own episode turn uses (rollout/episode_rollout.py), so which calls happen to
share a batch never changes what is sampled.
"""

from __future__ import annotations

import functools
import json
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from grpo_cli.endpoint.recording import AgentEpisode, CallPlan, Refused, Reply
from grpo_cli.endpoint.requests import (
    SamplingPolicy,
    chat_response,
    completion_response,
    generate_response,
    sampling_of,
)
from grpo_cli.endpoint.server import AgentServer, ModelCall, error_body, new_episode_id
from grpo_cli.endpoint.vllm_front import OpenEpisode, VLLMFront
from grpo_cli.engines.base import RolloutEngine, SamplingSettings
from grpo_cli.engines.sampling import turn_seed
from grpo_cli.episodes.environments import check_error
from grpo_cli.episodes.tools import prompt_for_schemas
from grpo_cli.episodes.turns import ChatTemplate, EpisodeLimits, SampledTurn
from grpo_cli.errors import EnvironmentFailed
from grpo_cli.rollout.episode_rollout import episode_batch, episode_train_metrics, episode_transcripts
from grpo_cli.rollout.multiturn import EpisodeContext, episode_row, opening_messages, score_episodes
from grpo_cli.rollout.rewards import Scores
from grpo_cli.rollout.runs import Samples, sampling_version
from grpo_cli.tasks.multiturn import agent_value, base_dir_of_task, env_weight
from grpo_cli.usercode.agents import AGENT_KEY, AgentJob, AgentShare, load_agent, run_agents
from grpo_cli.usercode.reward_workers import PendingCall, RewardWorkers, describe_error
from grpo_cli.usercode.user_code import RewardSpec

if TYPE_CHECKING:
    from grpo_cli.config.schemas import GRPOConfig
    from grpo_cli.tasks.base import Example, RewardFn
    from grpo_cli.tasks.trainer_state import TrainerState

# How long a gathered batch waits for more calls when some running episode has none waiting (its agent is busy
# with its own work, or its thread has not been scheduled yet): a quarter of the last engine call's time, at least
# GATHER_S and at most GATHER_MAX_S. A batch served without a straggler costs that straggler a call of its own (a
# second prefill and decode), so waiting a fraction of a call for it is the cheaper side.
GATHER_S = 0.05
GATHER_FRACTION = 0.25
GATHER_MAX_S = 2.0
_POLL_S = 0.005
# The step's deadline is task.agent_timeout_s after its agents start, plus this for a worker to report its agents'
# ends; past it every episode not ended is timed out and a worker still running is killed.
REPORT_GRACE_S = 10.0


@dataclass(frozen=True)
class AgentSettings:
    """What the run gives its agents: task.agent, where its file is found, the worker count, the per-episode time
    limit, the episodes' limits, task.on_reward_error, the `env` weight, the model's name."""

    reference: RewardSpec  # task.agent: a reference string or a _target_ node (usercode/agents.py load_agent)
    base_dir: str
    workers: int
    timeout_s: float | None
    limits: EpisodeLimits
    on_error: str
    env_weight: float
    model_name: str
    tool_call_format: str | None = None


def agent_settings(cfg: GRPOConfig) -> AgentSettings:
    """AgentSettings from the run's config (task.agent and the episode keys, rollout.max_tokens per call)."""
    task = cfg.task
    limits = EpisodeLimits(
        task.max_turns,
        cfg.rollout.max_tokens,
        task.max_episode_tokens,
        max_observation_tokens=task.max_observation_tokens,
    )
    return AgentSettings(
        reference=agent_value(task) or "",
        base_dir=str(base_dir_of_task(task)),
        workers=task.reward_workers,
        timeout_s=task.agent_timeout_s or None,
        limits=limits,
        on_error=task.on_reward_error,
        env_weight=env_weight(task),
        model_name=cfg.model.name,
        tool_call_format=task.tool_call_format,
    )


def vocabulary_size(engine: RolloutEngine, tokenizer: Any) -> int:
    """The token ids a prompt may hold: the policy's embedding rows (which may exceed the tokenizer's length, and
    which the model may sample), else the tokenizer's length (an engine without the policy, as job=check_reward's)."""
    embeddings = getattr(getattr(engine, "model", None), "get_input_embeddings", None)
    if callable(embeddings):
        rows = getattr(embeddings(), "num_embeddings", None)
        if isinstance(rows, int):
            return rows
    return len(tokenizer)


class Share(NamedTuple):
    """One worker's share of the agents: its episode keys, its pool (None: threads here), its call or thread."""

    keys: list[str]
    pool: RewardWorkers | None
    handle: PendingCall | threading.Thread


class AgentRun:
    """A task.agent task as the rollout worker runs it (module docstring)."""

    def __init__(self, settings: AgentSettings, tokenizer: Any, reward_fn: RewardFn) -> None:
        self.settings = settings
        self.template = ChatTemplate(tokenizer)
        self.reward_fn = reward_fn
        self._server: AgentServer | None = None
        self._front: VLLMFront | None = None
        # Each worker's call is killed at the step's deadline (REPORT_GRACE_S): its agents are threads that cannot
        # be stopped one by one, and a worker wedged past the time limit would hold the step.
        limit = None if settings.timeout_s is None else settings.timeout_s + REPORT_GRACE_S
        self._pools = [RewardWorkers(1, limit) for _ in range(settings.workers)]
        self._loader = functools.partial(AgentShare, settings.reference, settings.base_dir, settings.timeout_s)
        self._prompts: dict[str, Any] = {}
        self._tokenizer_dir: tempfile.TemporaryDirectory[str] | None = None
        self._last_answer_s = 0.0  # the last batch's time on the engine (the gather window's measure)
        self._local_agent: Callable[..., Any] | None = None  # task.reward_workers=0: the agent, loaded here

    # ----------------------------------------------------------------------------------------- RolloutRun
    def sample(self, engine: RolloutEngine, settings: SamplingSettings, examples: Sequence[Example]) -> Samples:
        server = self._start(engine)
        if isinstance(server, AgentServer):
            server.model_card["max_model_len"] = engine.context_length
        n = settings.n
        limits = replace(self.settings.limits, context_length=engine.context_length)
        first = settings.first_prompt_index * n
        examples_n = [example for example in examples for _ in range(n)]
        episodes: dict[str, AgentEpisode] = {}
        jobs: list[tuple[str, AgentJob]] = []
        for offset, example in enumerate(examples_n):
            key = new_episode_id()
            row = episode_row(example)
            episodes[key] = AgentEpisode(
                first + offset, self.template, limits, self._prompt_for, EpisodeContext(example, row)
            )
            jobs.append((key, self._job(server, key, row, example)))
        ends: dict[str, tuple[float | None, str | None]] = {}
        if isinstance(server, VLLMFront):  # vLLM's own server samples; its front records (endpoint/vllm_front.py)
            for key, agent_episode in episodes.items():
                server.open[key] = OpenEpisode(
                    agent_episode, settings.seed, settings.temperature, settings.top_p, settings.min_tokens
                )
            try:
                self._await_ends(server, episodes, ends, self._start_agents(jobs))
            finally:
                for key in episodes:
                    if (open_ := server.open.pop(key, None)) is not None:
                        open_.close()
            return self._finished(episodes, ends, examples_n)
        server.known.update(episodes)
        server.policy = SamplingPolicy(
            settings.temperature, settings.top_p, settings.min_tokens, vocabulary_size(engine, self.template.tokenizer)
        )
        try:
            shares = self._start_agents(jobs)
            self._serve(server, engine, settings, episodes, ends, shares, [k for k, _ in jobs])
        finally:
            server.known.difference_update(episodes)
        return self._finished(episodes, ends, examples_n)

    def _finished(
        self,
        episodes: dict[str, AgentEpisode],
        ends: dict[str, tuple[float | None, str | None]],
        examples_n: Sequence[Example],
    ) -> Samples:
        """The ended episodes as the step's samples; an agent's error is its episode's (task.on_reward_error)."""
        finished = []
        for key, agent_episode in episodes.items():
            reward, error = ends.get(key, (None, "did not report its end"))
            episode = agent_episode.end(reward, error)
            if episode.error is not None:
                assert isinstance(episode.context, EpisodeContext)
                check_error(AGENT_KEY, self.settings.on_error, episode.error, episode.context.row, "the agent")
            finished.append(episode)
        return episode_batch(finished, [e.ground_truth for e in examples_n])

    def score(self, samples: Samples, trainer_state: TrainerState | None) -> Scores:
        return score_episodes(self.reward_fn, samples.episodes, self.settings.env_weight, trainer_state)

    def metrics(self, samples: Samples, prefix: str) -> dict[str, float]:
        metrics = episode_train_metrics(samples.episodes, prefix)
        for name in ("rewritten_turns", "dropped_model_tokens", "retried_turns"):
            metrics.setdefault(f"{prefix}/{name}", 0.0)
        return metrics

    def transcripts(self, samples: Samples, rewards: Sequence[dict[str, float]] | None) -> list[dict[str, Any]] | None:
        return episode_transcripts(samples.episodes, rewards)

    def prompt_text(self, prompt_ids: Sequence[int]) -> str:
        return self.template.decode(prompt_ids)

    def first_prompt_past_context(self, examples: Sequence[Example], context_length: int) -> tuple[int, int] | None:
        return None  # the agent writes the opening; a call past the context is refused and the episode ends

    def close(self) -> None:
        for pool in self._pools:
            pool.close()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._front is not None:
            self._front.close()
            self._front = None
        if self._tokenizer_dir is not None:
            self._tokenizer_dir.cleanup()
            self._tokenizer_dir = None

    # ----------------------------------------------------------------------------------------- machinery
    def _start(self, engine: RolloutEngine) -> AgentServer | VLLMFront:
        """The endpoint the agents call: grpo-cli's, or the front of vLLM's own server when the engine serves one
        (rollout.openai_server=vllm)."""
        served = getattr(engine, "openai_server", None)
        endpoint: AgentServer | VLLMFront
        if served is not None:
            if self._front is None or self._front.served is not served:
                self._front = VLLMFront(served)
            endpoint = self._front
        else:
            if self._server is None:
                self._server = AgentServer(self.settings.model_name)
            endpoint = self._server
        if self._tokenizer_dir is None:  # the policy's tokenizer where an agent's own renderer can load it
            self._tokenizer_dir = tempfile.TemporaryDirectory(prefix="grpo-cli-tokenizer-")
            self.template.tokenizer.save_pretrained(self._tokenizer_dir.name)
        return endpoint

    def _prompt_for(self, tools: list[dict[str, Any]]) -> Any:
        key = json.dumps(tools, sort_keys=True)
        if key not in self._prompts:
            self._prompts[key] = prompt_for_schemas(self.template.tokenizer, tools, self.settings.tool_call_format)
        return self._prompts[key]

    def _job(self, server: AgentServer | VLLMFront, key: str, row: dict[str, Any], example: Example) -> AgentJob:
        base_url = server.base_url(key)
        return AgentJob(
            row=row,
            prompt=opening_messages(example),
            base_url=base_url,
            api_key=server.token,
            model=self.settings.model_name,
            end_url=f"{base_url.removesuffix('/v1')}/end",
            tokenizer_path=self._tokenizer_dir.name if self._tokenizer_dir is not None else "",
        )

    def _start_agents(self, jobs: list[tuple[str, AgentJob]]) -> list[Share]:
        """Each worker's share of the agents started: (its episode keys, its PendingCall or thread)."""
        if not self._pools:  # task.reward_workers=0: threads of this process
            if self._local_agent is None:  # loaded once, as a worker loads it once (a node's factory called once)
                self._local_agent = load_agent(self.settings.reference, Path(self.settings.base_dir))
            thread = threading.Thread(
                target=run_agents, args=(self._local_agent, [j for _, j in jobs], self.settings.timeout_s), daemon=True
            )
            thread.start()
            return [Share([k for k, _ in jobs], None, thread)]
        shares: list[Share] = []
        for index, pool in enumerate(self._pools):
            mine = jobs[index :: len(self._pools)]
            if not mine:
                continue
            payload = [vars(job) for _, job in mine]
            pending = pool.submit(self._loader, (payload,), {}, label="the agent (task.agent)")
            shares.append(Share([k for k, _ in mine], pool, pending))
        return shares

    def _serve(
        self,
        server: AgentServer,
        engine: RolloutEngine,
        settings: SamplingSettings,
        episodes: dict[str, AgentEpisode],
        ends: dict[str, tuple[float | None, str | None]],
        shares: list[Share],
        order: list[str],
    ) -> None:
        """Answer the agents' calls until every episode has ended (module docstring)."""
        waiting: list[ModelCall] = []
        last_arrival = time.monotonic()
        deadline = self._deadline()
        while len(ends) < len(episodes):
            try:
                call = server.calls.get(timeout=_POLL_S)
                last_arrival = time.monotonic()
                if call.episode not in episodes:
                    call.reply(404, error_body("no open episode at this URL", "unknown_episode"))
                elif call.route == "end":
                    ends.setdefault(call.episode, (call.body.get("reward"), call.body.get("error")))
                    call.reply(200, {"ok": True})
                elif call.episode in ends:
                    call.reply(409, error_body("the episode has ended", "episode_ended"))
                else:
                    waiting.append(call)
                continue  # take every call already queued before deciding
            except queue.Empty:
                pass
            self._check_shares(shares, ends)
            self._past_deadline(deadline, episodes, ends)
            running = {key for key in episodes if key not in ends}
            asking = {call.episode for call in waiting}
            if waiting and (running <= asking or time.monotonic() - last_arrival > self._gather_window()):
                started = time.monotonic()
                waiting = self._answer(engine, settings, episodes, waiting, order)
                self._last_answer_s = time.monotonic() - started
        for call in waiting:
            call.reply(409, error_body("the episode has ended", "episode_ended"))
        for share in shares:  # every agent has reported: its share's call returns (or its time limit ends it)
            self._settle(share)

    def _await_ends(
        self,
        front: VLLMFront,
        episodes: dict[str, AgentEpisode],
        ends: dict[str, tuple[float | None, str | None]],
        shares: list[Share],
    ) -> None:
        """Wait until every episode's agent has reported its end (or its worker died): vLLM's server answers the
        calls meanwhile."""
        deadline = self._deadline()
        while len(ends) < len(episodes):
            try:
                key, reward, error = front.ends.get(timeout=_POLL_S * 10)
            except queue.Empty:  # no report for a while: has a worker died with its agents, or the step run out?
                self._check_shares(shares, ends)
                self._past_deadline(deadline, episodes, ends)
                continue
            if key in episodes:
                ends.setdefault(key, (reward, error))
        for share in shares:
            self._settle(share)

    def _deadline(self) -> float | None:
        """When the step's agents are out of time (REPORT_GRACE_S), from now; None without a time limit."""
        timeout = self.settings.timeout_s
        return None if timeout is None else time.monotonic() + timeout + REPORT_GRACE_S

    def _past_deadline(
        self,
        deadline: float | None,
        episodes: dict[str, AgentEpisode],
        ends: dict[str, tuple[float | None, str | None]],
    ) -> None:
        """Past the step's deadline every episode not ended is timed out (its agent never reported: a worker or,
        with task.reward_workers=0, a thread that the time limit could not stop)."""
        if deadline is None or time.monotonic() < deadline:
            return
        error = f"took longer than {self.settings.timeout_s:g}s (task.agent_timeout_s) and did not report its end"
        for key in episodes:
            ends.setdefault(key, (None, error))

    def _settle(self, share: Share) -> None:
        """Wait for a share's call or thread to return; a worker with agents still running is replaced. A thread
        (task.reward_workers=0) is waited for REPORT_GRACE_S at most: an agent thread cannot be stopped, so one
        still running is left behind (docs/multi-turn.md)."""
        if isinstance(share.handle, threading.Thread):
            share.handle.join(REPORT_GRACE_S)
            return
        try:
            left = share.handle.result().get("left_running", 0)
        except Exception:  # noqa: BLE001 - the worker crashed after every agent reported: nothing is lost
            left = 0
        if left and share.pool is not None:
            share.pool.close()

    def _gather_window(self) -> float:
        """How long the gathered calls wait for one more (the constants' comment)."""
        return min(GATHER_MAX_S, max(GATHER_S, GATHER_FRACTION * self._last_answer_s))

    def _check_shares(self, shares: list[Share], ends: dict[str, tuple[float | None, str | None]]) -> None:
        """A share whose worker died or was killed ends its episodes that have not reported, with that error."""
        for keys, pool, handle in shares:
            if isinstance(handle, PendingCall):
                assert pool is not None
                pool.poll(0)
                if not handle.done:
                    continue
                try:
                    handle.result()
                    error = "did not report its end"
                except Exception as e:  # noqa: BLE001 - the worker crashed or was killed: its episodes' error
                    error = describe_error(e)
            else:
                if handle.is_alive():
                    continue
                error = "did not report its end"
            for key in keys:
                ends.setdefault(key, (None, error))

    def _answer(
        self,
        engine: RolloutEngine,
        settings: SamplingSettings,
        episodes: dict[str, AgentEpisode],
        calls: list[ModelCall],
        order: list[str],
    ) -> list[ModelCall]:
        """Plan each call on its episode, sample the planned ones in groups, answer them; returns the calls left for
        the next batch (a second call of an episode whose first is in this one: an episode's calls are taken one
        at a time, in the order they arrived)."""
        planned: dict[tuple[Any, ...], list[tuple[ModelCall, CallPlan]]] = {}
        rank = {key: i for i, key in enumerate(order)}
        later: list[ModelCall] = []
        for call in sorted(calls, key=lambda c: (rank[c.episode], c.arrived)):
            if any(call.episode == other.episode for group in planned.values() for other, _ in group):
                later.append(call)
                continue
            episode = episodes[call.episode]
            try:  # the call was checked (requests.check_body): a failure here is that call's 400, not the step's
                sampling = sampling_of(call.body, settings.temperature, settings.top_p)
                if call.route == "chat":
                    plan = episode.plan_chat(
                        call.body["messages"], call.body.get("tools"), sampling.n, sampling.max_tokens
                    )
                else:
                    prompt = call.body["prompt"]
                    ids = self.template.encode(prompt) if isinstance(prompt, str) else list(prompt)
                    plan = episode.plan_tokens(ids, sampling.n, sampling.max_tokens)
            except Refused as e:
                call.reply(400, error_body(str(e), e.code))
                continue
            except Exception as e:  # noqa: BLE001 - a message the template cannot render: that call's 400
                call.reply(400, error_body(describe_error(e), "invalid_request"))
                continue
            planned.setdefault((plan.turn, sampling), []).append((call, plan))
        for (turn, sampling), group in planned.items():
            group_settings = replace(
                settings,
                n=sampling.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                stop=sampling.stop,
                max_tokens=max(plan.max_tokens for _, plan in group),
                min_tokens=min([settings.min_tokens, *(plan.max_tokens for _, plan in group)]),
                seed=turn_seed(settings.seed, turn),
                first_prompt_index=0,
                prompt_indices=tuple(episodes[call.episode].index for call, _ in group),
            )
            try:
                batch = engine.generate([plan.prompt_ids for _, plan in group], group_settings)
            except Exception as e:  # noqa: BLE001 - a checked call the engine cannot sample: a device fault
                for call in calls:  # every call of this batch is answered before the step stops
                    call.reply(500, error_body(describe_error(e), "engine_error", "server_error"))
                # The loop stops on it in one line, keeping the last update (drivers/loop.py, as for a failed
                # environment): the requests were checked, so this is the engine's own failure.
                raise EnvironmentFailed(
                    f"{AGENT_KEY}: the engine failed sampling the agents' calls ({describe_error(e)}); out of "
                    "memory: lower train.rollout_batch_size or rollout.max_tokens"
                ) from e
            for row, (call, plan) in enumerate(group):
                rows = range(row * sampling.n, (row + 1) * sampling.n)
                turns = [
                    SampledTurn(
                        list(batch.completion_ids[r]),
                        None if batch.sampler_log_probs is None else list(batch.sampler_log_probs[r]),
                        not batch.truncated[r],
                        sampling_version(engine),
                    )
                    for r in rows
                ]
                with_tools = bool(call.body.get("tools")) and call.body.get("tool_choice") != "none"
                replies = episodes[call.episode].take(turns, with_tools=with_tools)
                call.reply(200, self._response(call, plan, replies))
        return later

    def _response(self, call: ModelCall, plan: CallPlan, replies: list[Reply]) -> dict[str, Any]:
        logprobs = bool(call.body.get("logprobs"))

        def text_of(token: int) -> str:  # a token's text, as OpenAI's log-prob entries show it
            return self.template.decode([token])

        if call.route == "chat":
            return chat_response(plan, replies, self.settings.model_name, logprobs, text_of)
        if call.route == "generate":
            return generate_response(plan, replies[0])
        return completion_response(plan, replies, self.settings.model_name, logprobs, text_of)
