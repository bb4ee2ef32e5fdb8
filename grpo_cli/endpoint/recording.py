"""Agent-driven episodes: the model calls an agent's code makes through the OpenAI-compatible endpoint, recorded
as the episode's tokens, exactly as sampled (pure Python: no torch, no HTTP).

An agent (task.agent) holds the conversation itself and sends it whole with every call. `AgentEpisode` turns its
calls into one `episodes.Episode`, the same tokens a task's own episodes have (episodes/turns.py), so the learner
never re-tokenizes what the agent sends back:

    first call        its messages (and tools) rendered by the chat template and tokenized once: the prompt
    each call's reply the ids the engine SAMPLED (mask 1) and their log-probs; the reply the agent reads is their text
                      (tool calls parsed into OpenAI's `tool_calls` when the call gave tools)
    a later call      when its messages begin with the conversation so far and the reply the agent got (compared as
                      the agent sees them: role, text, tool calls and their parsed arguments, tool_call_id, name), the
                      messages after that are the environment's turn: their delta tokenized once, mask 0
                      (`episodes.env_delta`, whose rule 2 counts the turns the template re-renders), cut at
                      task.max_observation_tokens as any observation
    a rewritten turn  a call whose messages do not extend the conversation that way (the agent dropped or edited an
                      earlier message, summarised its history, changed its tools): the tokens so far are DROPPED from
                      training and the episode goes on as a new segment, its prompt the new messages rendered fresh;
                      counted in `rewritten_turns` and `dropped_model_tokens`. The learner trains on the last segment,
                      the tokens the model saw when it sampled each of its turns. (verl's agent loop and SkyRL's
                      token-in-token-out generator keep one token sequence and never re-render it; prime-rl splits a
                      broken prefix into separate samples; one sequence per episode keeps the group's advantage
                      arithmetic as it is, so a rewrite costs its earlier turns instead.)
    a repeated call   the same messages again (a client's retry): the earlier reply is discarded, the turn sampled
                      again from the same tokens (`retried_turns`)
    n > 1             the n replies are sampled from one prompt; the next call's messages say which one the agent kept
                      (an agent that ends after an n > 1 call keeps its first)

Token prompts (the completions route given token ids, verifiers' /inference/v1/generate) are the same with ids for
messages: a call continues the episode when its ids begin with the ids so far and the kept reply's, the rest
being the environment's tokens.

Limits are the episode's own (`episodes.EpisodeLimits`): a call past task.max_turns, or with no room left in
task.max_episode_tokens or the model's context, is refused (`Refused`: the endpoint answers HTTP 400 naming the
limit) and the episode is turn-limited, scored as such.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from grpo_cli.episodes.tool_calls import DEFAULT_FORMAT, TOOL_CALL_FORMATS
from grpo_cli.episodes.tools import ToolPrompt
from grpo_cli.episodes.turns import (
    ChatTemplate,
    Episode,
    EpisodeLimits,
    Message,
    SampledTurn,
    StopReason,
    add_model_turn,
    append_env,
    cut_observation,
    cut_turn,
    env_delta,
    finish_episode,
    start_episode,
)

Comparable = tuple[Any, ...]


class Refused(Exception):
    """A call the episode cannot take (a limit reached, a malformed message): the endpoint's HTTP 400."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def message_text(content: Any) -> str:
    """A message's text as the agent sees it: a string as it is, OpenAI's content parts' texts joined, None as ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    return str(content)


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def tool_call_list(message: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(name, parsed arguments) of each of an assistant message's tool calls (OpenAI's shape or TRL's)."""
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function", call) if isinstance(call, Mapping) else {}
        calls.append((str(function.get("name", "")), _arguments(function.get("arguments", {}))))
    return calls


def comparable(message: Mapping[str, Any]) -> Comparable:
    """A message as the agent sees it, for the prefix rule (module docstring): a client's extra fields (refusal,
    annotations, a null function_call) and how arguments are serialized do not make two messages differ."""
    calls = json.dumps(tool_call_list(message), sort_keys=True)
    text = message_text(message.get("content"))
    return (message.get("role"), text, calls, message.get("tool_call_id"), message.get("name"))


def renderable_message(message: Mapping[str, Any], prompt: ToolPrompt | None) -> Message:
    """An agent's message as the chat template is given it: text content, a tool call's arguments as an object
    (templates write them with tojson), and for a template that does not render tool calls (the default tool
    prompt's) the calls written into the text in the prompt's format (ToolCallFormat.write_call)."""
    shown: Message = {"role": message.get("role"), "content": message_text(message.get("content"))}
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            shown[key] = message[key]
    calls = tool_call_list(message)
    if calls:
        if prompt is not None and prompt.native:
            shown["tool_calls"] = [
                {"type": "function", "function": {"name": name, "arguments": arguments}} for name, arguments in calls
            ]
        else:
            fmt = prompt.fmt if prompt is not None else TOOL_CALL_FORMATS[DEFAULT_FORMAT]
            written = "".join("\n" + fmt.write_call(name, arguments) for name, arguments in calls)
            shown["content"] = (shown["content"] + written).lstrip("\n")
    return shown


@dataclass(frozen=True)
class Reply:
    """One sampled reply: its turn (ids, log-probs, whether it stopped), its text, the message the agent reads
    (chat calls) and how it finished (OpenAI's finish_reason)."""

    turn: SampledTurn
    text: str
    message: Message
    finish_reason: Literal["stop", "length", "tool_calls"]


@dataclass
class CallPlan:
    """What the engine samples for one call: from `prompt_ids`, at most `max_tokens`, `n` replies, as the episode's
    model call number `turn` (its random streams')."""

    prompt_ids: list[int]
    max_tokens: int
    n: int
    turn: int


@dataclass
class AgentEpisode:
    """One agent-driven episode's tokens and transcript (module docstring). `index`: the episode's place in the
    step's episodes (its random streams); `context`: the caller's (the example and row, for scoring)."""

    index: int
    template: ChatTemplate
    limits: EpisodeLimits
    prompt_for_tools: Any  # (tools schemas) -> ToolPrompt | None: how the template shows a call's tools
    context: Any = None
    segment: Episode | None = None
    mode: Literal["chat", "tokens"] = "chat"
    calls: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    ended: StopReason = ""
    _view: list[Comparable] = field(default_factory=list)  # the segment's conversation as the agent sees it
    _tools_key: str = ""
    _prompt: ToolPrompt | None = None
    _segment_template: ChatTemplate | None = None
    _replies: list[Reply] = field(default_factory=list)  # the last call's, not yet continued
    _budget: int = 0
    _sent: list[Message] = field(default_factory=list)  # a rendered chat call's messages (plan_tokens)

    # ----------------------------------------------------------------------------------------- a model call
    def plan_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        n: int,
        max_tokens: int | None,
    ) -> CallPlan:
        """The call's prompt (continuing the segment or a new one), or Refused."""
        self._check_open()
        if not messages:
            raise Refused("a chat call needs at least one message", "invalid_request")
        tools_key = json.dumps(list(tools or ()), sort_keys=True)
        seen = [comparable(m) for m in messages]
        if self.segment is not None and self.mode == "chat" and tools_key == self._tools_key:
            if seen == self._view:
                self._retry()
                return self._plan(n, max_tokens)
            for reply in self._replies:
                known = [*self._view, comparable(reply.message)]
                if len(seen) > len(known) and seen[: len(known)] == known:
                    self._continue(reply, [dict(m) for m in messages[len(known) :]], seen[len(known) :])
                    return self._plan(n, max_tokens)
        self._new_segment("chat", tools_key, tools)
        assert self._segment_template is not None
        shown = [renderable_message(m, self._prompt) for m in messages]
        self.segment = start_episode(self._segment_template, shown, self.context)
        self._view = seen
        return self._plan(n, max_tokens)

    def plan_tokens(
        self,
        prompt_ids: Sequence[int],
        n: int,
        max_tokens: int | None,
        messages: Sequence[Mapping[str, Any]] | None = None,
    ) -> CallPlan:
        """A token prompt's call (module docstring), or Refused. `messages`: the chat call a server rendered into
        `prompt_ids` (vLLM's own, endpoint/vllm_front.py); the ids alone decide what continues, the messages are
        what rewards and transcripts see (the environment's new messages, instead of their decoded ids)."""
        self._check_open()
        sent, self._sent = self._sent, [dict(m) for m in messages or ()]
        ids = [int(i) for i in prompt_ids]
        if not ids:
            raise Refused("a call needs at least one prompt token", "invalid_request")
        if self.segment is not None and self.mode == "tokens":
            so_far = [*self.segment.prompt_ids, *self.segment.ids]
            if ids == so_far:
                self._retry()
                return self._plan(n, max_tokens)
            for reply in self._replies:
                known = [*so_far, *reply.turn.ids]
                if len(ids) > len(known) and ids[: len(known)] == known:
                    self._keep(reply)
                    extra = ids[len(known) :]
                    room, limit = self.limits.room(self.segment)
                    if room is not None and len(extra) >= room:
                        self._end(limit)
                        raise Refused(f"the episode has no room left ({limit})", limit)
                    text = self.template.decode(extra)
                    new = self._sent[len(sent) + 1 :] if sent and len(self._sent) > len(sent) + 1 else None
                    append_env(self.segment, new or [{"role": "user", "content": text}], extra, "", False)
                    return self._plan(n, max_tokens)
        self._new_segment("tokens", "", None)
        text = self.template.decode(ids)
        opening = self._sent or [{"role": "user", "content": text}]
        self.segment = Episode(
            prompt_messages=[dict(m) for m in opening],
            prompt_ids=ids,
            messages=[dict(m) for m in opening],
            rendered=text,
            context=self.context,
        )
        return self._plan(n, max_tokens)

    def take(
        self, turns: Sequence[SampledTurn], with_tools: bool, messages: Sequence[Message] | None = None
    ) -> list[Reply]:
        """The engine's samples for the planned call: each cut at the call's budget and its first stop token, kept
        as the replies the next call may continue. `messages`: each reply as a server parsed it (vLLM's own, with
        its tool parser's tool_calls), what rewards and transcripts then see."""
        assert self.segment is not None
        template = self._segment_template or self.template
        replies: list[Reply] = []
        for sampled in turns:
            turn = cut_turn(sampled, self._budget, template.stop_token_ids)
            ended = template.ends_turn(turn.ids)
            text = template.decode(turn.ids[:-1] if ended else turn.ids)
            stopped = ended if turn.stopped is None else turn.stopped
            message: Message = {"role": "assistant", "content": text}
            reason: Literal["stop", "length", "tool_calls"] = "stop" if stopped else "length"
            if with_tools and self._prompt is not None:
                parsed = self._prompt.assistant_message(text)
                calls = [
                    {
                        "id": f"call_{self.index}_{self.calls}_{k}",
                        "type": "function",
                        "function": {"name": name, "arguments": json.dumps(arguments)},
                    }
                    for k, (name, arguments) in enumerate(tool_call_list(parsed))
                ]
                if calls:
                    message = {"role": "assistant", "content": parsed.get("content") or None, "tool_calls": calls}
                    reason = "tool_calls" if stopped else "length"
            if messages is not None:
                message = dict(messages[len(replies)])
            replies.append(Reply(turn, text, message, reason))
        self._replies = replies
        return replies

    # ----------------------------------------------------------------------------------------- the end
    def end(self, reward: float | None, error: str | None) -> Episode:
        """The finished episode as the learner trains it: its last segment with the kept reply (the first of an
        n > 1 call no later call continued), the agent's reward as the episode's step reward (the `env`
        component), its counts; an agent that raised, timed out or never called the model is the episode's
        error (task.on_reward_error decides)."""
        if self.segment is None:
            self.segment = Episode(prompt_messages=[], prompt_ids=[], context=self.context)
            error = error or "never called the model"
        if self._replies:
            self._keep(self._replies[0])
        episode = self.segment
        episode.step_rewards.append(reward)
        for name, value in self.counts.items():
            episode.counts[name] = episode.counts.get(name, 0) + value
        episode.error = error
        reason: StopReason = self.ended or ("error" if error is not None else "done")
        finish_episode(episode, reason)
        return episode

    # ----------------------------------------------------------------------------------------- machinery
    def _check_open(self) -> None:
        if self.ended:
            raise Refused(f"the episode has ended ({self.ended}): no more model calls", self.ended)
        if self.calls >= self.limits.max_turns:
            self._end("max_turns")
            raise Refused(f"the episode reached task.max_turns={self.limits.max_turns} model calls", "max_turns")

    def _count(self, name: str, value: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + value

    def _end(self, reason: StopReason) -> None:
        self.ended = reason
        if self._replies:
            self._keep(self._replies[0])

    def _retry(self) -> None:
        self._replies = []
        self._count("retried_turns")

    def _keep(self, reply: Reply) -> None:
        """The reply the agent went on from becomes the segment's model turn."""
        assert self.segment is not None
        add_model_turn(self.segment, self._segment_template or self.template, reply.turn)
        if reply.message.get("tool_calls"):  # rewards and transcripts see the calls as the agent did
            self.segment.parsed[len(self.segment.messages) - 1] = dict(reply.message)
        self._replies = []

    def _continue(self, reply: Reply, new: list[Message], seen: list[Comparable]) -> None:
        assert self.segment is not None and self._segment_template is not None
        self._keep(reply)
        self._view.extend([comparable(reply.message), *seen])
        shown = [renderable_message(m, self._prompt) for m in new]
        if self.limits.max_observation_tokens is not None:
            cuts = [cut_observation(self._segment_template, m, self.limits.max_observation_tokens) for m in shown]
            shown = [m for m, _ in cuts]
            self._count("truncated_observations", sum(cut for _, cut in cuts))
        delta_ids, after, rerendered = env_delta(self.segment, self._segment_template, shown)
        room, limit = self.limits.room(self.segment)
        if room is not None and len(delta_ids) >= room:
            self.segment.messages.extend(shown)
            self._end(limit)
            raise Refused(f"the episode has no room left ({limit})", limit)
        append_env(self.segment, shown, delta_ids, after, rerendered)

    def _new_segment(self, mode: Literal["chat", "tokens"], tools_key: str, tools: Any) -> None:
        """Start over: a segment so far is dropped from training (a rewritten turn)."""
        if self.segment is not None:
            dropped = self.segment.model_tokens + (len(self._replies[0].turn.ids) if self._replies else 0)
            self._count("rewritten_turns")
            self._count("dropped_model_tokens", dropped)
        self.mode, self._tools_key, self._replies = mode, tools_key, []
        self._prompt = self.prompt_for_tools(list(tools)) if tools else None
        if self._prompt is not None:
            self._segment_template = ChatTemplate.for_tools(
                self.template.tokenizer, self._prompt, stop_token_ids=sorted(self.template.stop_token_ids)
            )
        else:
            self._segment_template = self.template

    def _plan(self, n: int, max_tokens: int | None) -> CallPlan:
        assert self.segment is not None
        budget = (
            self.limits.max_tokens_per_turn if max_tokens is None else min(max_tokens, self.limits.max_tokens_per_turn)
        )
        room, limit = self.limits.room(self.segment)
        if room is not None and room < 1:
            self._end(limit)
            raise Refused(f"the episode has no room left ({limit})", limit)
        self._budget = max(1, budget if room is None else min(budget, room))
        self.calls += 1
        return CallPlan([*self.segment.prompt_ids, *self.segment.ids], self._budget, n, self.calls - 1)
