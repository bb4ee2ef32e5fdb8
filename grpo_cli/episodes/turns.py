"""Multi-turn episodes, tokens in and tokens out: the ids the learner scores are the ids the sampler saw.

An episode is a conversation: the opening messages, then model turns, each followed by the messages a tool or an
environment answers with, until the hook says done or a limit ends it. Its token ids are built once, as they are
sampled, and never re-tokenized from text:

    prompt_ids   the opening messages rendered by the chat template (add_generation_prompt) and tokenized once
    model turn   the ids the engine SAMPLED, as they are (loss_mask 1), the stop token included when it ended one
    env turn     the "delta" (loss_mask 0): the text the template adds after the model's sampled text (the end of
                 its turn, the new tool/environment messages, the next generation prompt), tokenized once

How the delta is found (`ChatTemplate.delta`). After a model turn whose text is `sampled_text` (its ids decoded,
special tokens kept), and with `before` the rendering the turn was sampled from:
1. the prefix rule: render the conversation with the new assistant message and the new messages (with the next
   generation prompt); when `before + sampled_text` is a prefix of it, the delta is the rest. The model's turn
   ended by its stop token (`<|im_end|>`, sampled, in the loss): the delta starts after it ("\\n<|im_start|>...");
   cut by the per-turn max tokens: the delta starts with the template's end of turn ("<|im_end|>\\n"), mask 0.
2. the template altered the earlier conversation (it strips reasoning from earlier assistant turns, its
   generation prompt differs from how it renders an assistant turn, it trims whitespace, ...), so rule 1's
   prefix does not hold: the delta is what the template renders after a placeholder assistant content in the
   same conversation (the last assistant content swapped for a sentinel, the new messages and the generation
   prompt after it), less the stop token's text when the model sampled it. The episode counts these turns in
   `Episode.rerendered_turns`.
Either way the sampled ids stay as sampled: the learner trains on exactly the sequence the model saw when it
sampled each turn, which after a rule-2 turn is not what the template would render for the whole conversation
(that rendering would put tokens under the model that it never conditioned on).

Limits (`EpisodeLimits`): `max_turns` model turns, `max_tokens_per_turn` sampled tokens per turn, and
`max_episode_tokens` tokens after the prompt in all (model and environment tokens). A turn is sampled with the
smaller of the per-turn limit and what is left of the episode's; an episode the hook has not ended when a limit is
reached stops with `turn_limited` set and `stop_reason` naming the limit (TURN_LIMITED: the game ran out of room;
it is an ended episode, scored as such). `truncated` is something else: the episode's last model turn was cut at
its token limit mid-generation (no stop token), what train.mask_truncated leaves out of the loss, as a cut
single-turn completion. Messages that arrive when the episode ends (the hook's last answer) are kept in
`messages` (transcripts and rewards see them) but not tokenized: no model turn would follow them.

The driver (`run_episodes`) runs a batch turn by turn: the unfinished episodes generate together through a
`generate(prompts, max_tokens)` callable (bound to an engine by the caller), then the hook answers all of them
at once (so tools and environments of different episodes can run in parallel). Pure Python: no torch here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from grpo_cli.episodes.chat_roles import renderable
from grpo_cli.errors import UserFacingError

if TYPE_CHECKING:
    from grpo_cli.episodes.environments import EnvironmentRunner
    from grpo_cli.episodes.tools import ToolPrompt, ToolRunner

# How a conversation is rendered when not by the tokenizer's template as it is (a tools prompt's render, which adds
# the default tool prompt or shows tool results as user turns): (messages, add_generation_prompt) -> text.
Renderer = Callable[[Sequence["Message"], bool], str]

# A chat message, {"role": ..., "content": ...} (and whatever else the template reads: tool_calls, name, ...).
Message = dict[str, Any]

# What stands in for the last assistant content under rule 2: plain text no template alters.
# The version recorded at tokens no policy sampled (an episode's tool and environment tokens; never in the loss).
ENV_VERSION = -1
_SENTINEL = "\u2063GRPO_CLI_ASSISTANT_TURN\u2063"


class ContextFullError(UserFacingError):
    """An episode's opening leaves no room in the model's context for one sampled token."""


def _opening_too_long(episode: Episode, limits: EpisodeLimits) -> str:
    first = next((str(m.get("content", "")) for m in episode.prompt_messages), "")
    shown = " ".join(first.split())
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return (
        f"an episode's opening ({shown!r}) is {len(episode.prompt_ids)} tokens and the model's context is "
        f"{limits.context_length}: shorten the opening messages, or raise the context (rollout.max_model_len for "
        "rollout.engine=vllm, else a model with a longer max_position_embeddings)"
    )


class ChatTemplateError(UserFacingError):
    """The chat template cannot render an episode's turns in a way its tokens can be built from."""


@dataclass(frozen=True)
class SampledTurn:
    """What the engine sampled for one episode's turn: the token ids (cut after the first stop token or stop string,
    both kept), the log-prob of each under the sampler (None when the engine gives none), and whether the turn
    stopped on its own (a stop token or a stop string; vLLM's finish_reason "stop") rather than at its token limit
    (None: the engine does not say; then a turn stopped iff its last id is a stop token)."""

    ids: list[int]
    logprobs: list[float] | None = None
    stopped: bool | None = None
    # The policy version that sampled the turn (sync=async: the generator applies updates between turns only);
    # None: not recorded.
    version: int | None = None


class Generate(Protocol):
    """The engine: one sampled turn per prompt (token ids in), at most `max_tokens` tokens each."""

    def __call__(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> Sequence[SampledTurn]: ...


@dataclass(frozen=True)
class TurnOutcome:
    """The answer of a tool runner or environment to an episode's last model turn.

    messages: to append (tool results, the environment's observation); None or [] ends the episode.
    reward: this step's reward (an environment's; summed over the episode by `Episode.step_reward`), or None.
    done: the episode is over (its last messages, if any, are kept in the transcript but not tokenized).
    error: the tool runner or environment failed on this turn (raised, timed out): the episode ends, and the
           caller applies task.on_reward_error to it (`Episode.error`).
    counts: per-turn counters the caller sums into metrics (e.g. {"tool_calls": 2, "tool_errors": 1}).
    """

    messages: list[Message] | None = None
    reward: float | None = None
    done: bool = False
    error: str | None = None
    counts: Mapping[str, int] = field(default_factory=dict)


# Answers each episode's last model turn; all unfinished episodes of a batch at once, one outcome each in order.
TurnHook = Callable[[Sequence["Episode"]], Sequence[TurnOutcome]]


def one_at_a_time(on_turn: Callable[[Episode], TurnOutcome]) -> TurnHook:
    """A hook that answers one episode at a time, as a TurnHook."""

    def hook(episodes: Sequence[Episode]) -> list[TurnOutcome]:
        return [on_turn(episode) for episode in episodes]

    return hook


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int  # model turns per episode
    max_tokens_per_turn: int  # sampled tokens per model turn (rollout.max_tokens)
    max_episode_tokens: int | None = None  # tokens after the prompt, model and environment ones together
    # The model's context (the engine's `context_length`): the prompt and every token after it, all together.
    context_length: int | None = None
    # Tokens of one observation's content (a tool result, an environment message) kept; the rest is cut, with a
    # marker the model reads (`cut_observation`). None: not cut.
    max_observation_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_tokens_per_turn < 1:
            raise ValueError(f"an episode needs max_turns >= 1 and max_tokens_per_turn >= 1, not {self}")
        for name in ("max_episode_tokens", "context_length", "max_observation_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or None), not {value}")

    def room(self, episode: Episode) -> tuple[int | None, StopReason]:
        """Tokens the episode may still add after its ids (None: unbounded), and the limit that binds: its own
        max_episode_tokens or the model's context less the prompt (the smaller; max_episode_tokens on a tie)."""
        bounds: list[tuple[int, StopReason]] = []
        if self.max_episode_tokens is not None:
            bounds.append((self.max_episode_tokens - len(episode.ids), "max_episode_tokens"))
        if self.context_length is not None:
            bounds.append((self.context_length - len(episode.prompt_ids) - len(episode.ids), "context"))
        if not bounds:
            return None, "max_episode_tokens"
        return min(bounds, key=lambda bound: bound[0])


@dataclass(frozen=True)
class TokenSpan:
    """A run of `Episode.ids`: a model turn (`model`, loss_mask 1) or what the template and the tools or
    environment added after one (`env`, loss_mask 0); [start, end) indexes `Episode.ids`."""

    kind: Literal["model", "env"]
    start: int
    end: int


# "context": the model's context is full (EpisodeLimits.context_length): no room for one more sampled token.
StopReason = Literal["", "done", "no_messages", "error", "max_turns", "max_episode_tokens", "context"]
# The stop reasons of an episode that ran out of room before its hook ended it: turn-limited (`Episode.turn_limited`).
TURN_LIMITED: frozenset[str] = frozenset({"max_turns", "max_episode_tokens", "context"})


@dataclass
class Episode:
    """One conversation's tokens and transcript. `ids`, `loss_mask` and `sampler_logprobs` run in step after
    `prompt_ids`; the learner scores `prompt_ids + ids` with `loss_mask` as the response mask (holes at the
    environment's tokens)."""

    prompt_messages: list[Message]
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    # The sampler's log-prob of each model token; 0.0 at environment tokens, NaN where the engine gave none.
    sampler_logprobs: list[float] = field(default_factory=list)
    # The policy version that sampled each token (sync=async); -1 at environment tokens, None where not recorded.
    versions: list[int | None] = field(default_factory=list)
    spans: list[TokenSpan] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)  # the whole conversation, the opening messages first
    model_turns: list[list[int]] = field(default_factory=list)  # each model turn's sampled ids
    turn_cut: list[bool] = field(default_factory=list)  # per model turn: cut by a token limit (no stop token)
    step_rewards: list[float | None] = field(default_factory=list)  # the hook's reward after each model turn
    counts: dict[str, int] = field(default_factory=dict)  # the hook's counters, summed over the turns
    finished: bool = False
    # Its last model turn was cut at its token limit mid-generation (no stop token): train.mask_truncated's.
    truncated: bool = False
    # Ended by a limit (TURN_LIMITED: max_turns, max_episode_tokens, the context) before the hook ended it.
    turn_limited: bool = False
    stop_reason: StopReason = ""
    error: str | None = None  # the hook's error that ended the episode
    rerendered_turns: int = 0  # turns whose delta needed rule 2 (the template altered the earlier conversation)
    # The template's rendering of the conversation the next turn is (or the last turn was) sampled from.
    rendered: str = ""
    # The caller's own data for this episode (its row, its environment session, ...); the driver never reads it.
    context: Any = None
    # Messages as rewards and transcripts see them where that differs from what the template renders, by index
    # in `messages`: a model turn of a tool episode as TRL 1.16 parses it (`tool_calls`, ...; tools_hook sets it).
    parsed: dict[int, Message] = field(default_factory=dict)

    @property
    def n_turns(self) -> int:
        return len(self.model_turns)

    @property
    def model_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def env_tokens(self) -> int:
        return len(self.ids) - sum(self.loss_mask)

    @property
    def skipped(self) -> bool:
        """Its environment failed on it (`error`; a run gets this far with one only under
        task.on_reward_error=skip): it gets no reward of any component and leaves the loss and its group's
        advantage statistics (rollout/worker.py)."""
        return self.error is not None

    @property
    def step_reward(self) -> float | None:
        """The hook's rewards summed over the turns (the `env` reward component); None when it gave none."""
        given = [r for r in self.step_rewards if r is not None]
        return float(sum(given)) if given else None

    @property
    def public_messages(self) -> list[Message]:
        """The whole conversation as rewards, transcripts and check_reward see it: `messages`, a tool episode's
        model turns as TRL 1.16 gives them (tools.assistant_message: the calls as `tool_calls`, ...)."""
        return [self.parsed.get(index, message) for index, message in enumerate(self.messages)]

    @property
    def completion_messages(self) -> list[Message]:
        """The messages after the opening ones (what a reward function gets as this episode's completion)."""
        return self.public_messages[len(self.prompt_messages) :]


class ChatTemplate:
    """A tokenizer's chat template as the episodes use it: render, tokenize once, decode as sampled.

    `tools` (JSON schemas) and `template_kwargs` (e.g. enable_thinking) go to every rendering; `stop_token_ids`
    end a model turn (default: the tokenizer's EOS and `<|im_end|>` when the vocabulary has it); `chat_template`
    replaces the tokenizer's template (None: its own); `renderer` replaces the rendering altogether (then `tools`,
    `template_kwargs` and `chat_template` are its business): `ChatTemplate.for_tools` makes one from a tools prompt."""

    def __init__(
        self,
        tokenizer: Any,  # a transformers PreTrainedTokenizerBase (untyped library boundary)
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        chat_template: str | None = None,
        renderer: Renderer | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template  # None: the tokenizer's own
        self.renderer = renderer
        self.tools = [dict(t) for t in tools] if tools else None
        self.template_kwargs = dict(template_kwargs or {})
        if stop_token_ids is None:
            stops = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
            im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
            if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
                stops.add(im_end)
            stop_token_ids = sorted(stops)
        self.stop_token_ids = frozenset(stop_token_ids)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        if self.renderer is not None:
            return self.renderer(messages, add_generation_prompt)
        text = self.tokenizer.apply_chat_template(
            renderable(self.tokenizer, messages, self.chat_template),  # a template without a system role: folded
            tools=self.tools,
            add_generation_prompt=add_generation_prompt,
            chat_template=self.chat_template,
            tokenize=False,
            **self.template_kwargs,
        )
        if not isinstance(text, str):
            raise ChatTemplateError(f"the chat template rendered a {type(text).__name__}, not text")
        return text

    @classmethod
    def for_tools(
        cls, tokenizer: Any, prompt: ToolPrompt, stop_token_ids: Sequence[int] | None = None, **template_kwargs: Any
    ) -> ChatTemplate:
        """The template as a tools prompt (episodes/tools.py) renders it: the tools in the template's own way or the
        default tool prompt, tool results as `tool` messages or as user turns when the template has no tool role."""

        def render(messages: Sequence[Message], add_generation_prompt: bool) -> str:
            text = prompt.render(
                tokenizer, messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
            )
            return str(text)

        return cls(tokenizer, stop_token_ids=stop_token_ids, renderer=render)

    def encode(self, text: str) -> list[int]:
        """The text's ids, no special tokens added (the template writes its own BOS and turn markers)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """The ids' text with the special tokens kept, spaces as they are (what the template would see)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def ends_turn(self, ids: Sequence[int]) -> bool:
        return bool(ids) and ids[-1] in self.stop_token_ids

    def delta(
        self, before: str, conversation: Sequence[Message], sampled: Sequence[int], new: Sequence[Message]
    ) -> tuple[str, str, bool]:
        """(the delta's text, the full rendering after it, whether rule 2 gave it): what the template adds after
        the model's sampled ids, `conversation` ending with the assistant message made of them, `before` the
        rendering they were sampled from (module docstring)."""
        after = self.render([*conversation, *new], add_generation_prompt=True)
        sampled_text = self.decode(sampled)
        if after.startswith(before + sampled_text):
            return after[len(before) + len(sampled_text) :], after, False
        placeholder = [*conversation[:-1], {**conversation[-1], "content": _SENTINEL}]
        with_sentinel = self.render([*placeholder, *new], add_generation_prompt=True)
        at = with_sentinel.rfind(_SENTINEL)
        if at < 0:
            raise ChatTemplateError(
                "the chat template drops the assistant's content from the conversation, so an episode's tokens "
                "cannot be built from it: use a template that renders each assistant turn"
            )
        delta = with_sentinel[at + len(_SENTINEL) :]
        if self.ends_turn(sampled):
            stop_text = self.decode(sampled[-1:])
            if delta.startswith(stop_text):
                delta = delta[len(stop_text) :]
        return delta, after, True


def start_episode(template: ChatTemplate, messages: Sequence[Message], context: Any = None) -> Episode:
    """An episode at its opening messages: rendered with the generation prompt and tokenized once."""
    rendered = template.render(messages, add_generation_prompt=True)
    opening = [dict(m) for m in messages]
    return Episode(
        prompt_messages=opening,
        prompt_ids=template.encode(rendered),
        messages=list(opening),
        rendered=rendered,
        context=context,
    )


def add_model_turn(episode: Episode, template: ChatTemplate, sampled: SampledTurn) -> None:
    """Append a sampled turn: its ids as they are (mask 1), its text as the assistant message (the stop token's
    text left out of the content, as the template writes that itself). A turn ended by a stop string keeps it in
    its content, and the template's end of turn follows it out of the loss, as after a cut turn."""
    ids = list(sampled.ids)
    if sampled.logprobs is not None and len(sampled.logprobs) != len(ids):
        raise ValueError(f"the engine gave {len(sampled.logprobs)} log-probs for {len(ids)} sampled tokens")
    ended = template.ends_turn(ids)
    start = len(episode.ids)
    episode.ids.extend(ids)
    episode.loss_mask.extend([1] * len(ids))
    episode.sampler_logprobs.extend(sampled.logprobs if sampled.logprobs is not None else [math.nan] * len(ids))
    episode.versions.extend([sampled.version] * len(ids))
    episode.spans.append(TokenSpan("model", start, len(episode.ids)))
    episode.model_turns.append(ids)
    episode.turn_cut.append(not (ended if sampled.stopped is None else sampled.stopped))
    episode.messages.append({"role": "assistant", "content": template.decode(ids[:-1] if ended else ids)})


def add_env_turn(episode: Episode, template: ChatTemplate, new: Sequence[Message]) -> list[int]:
    """Append the messages that answer the last model turn: their delta tokenized once, mask 0; its ids."""
    new_messages = [dict(m) for m in new]
    delta_ids, after, rerendered = env_delta(episode, template, new_messages)
    append_env(episode, new_messages, delta_ids, after, rerendered)
    return delta_ids


def env_delta(episode: Episode, template: ChatTemplate, new: list[Message]) -> tuple[list[int], str, bool]:
    delta, after, rerendered = template.delta(episode.rendered, episode.messages, episode.model_turns[-1], new)
    return template.encode(delta), after, rerendered


def append_env(episode: Episode, new: list[Message], delta_ids: list[int], after: str, rerendered: bool) -> None:
    start = len(episode.ids)
    episode.ids.extend(delta_ids)
    episode.loss_mask.extend([0] * len(delta_ids))
    episode.sampler_logprobs.extend([0.0] * len(delta_ids))
    episode.versions.extend([ENV_VERSION] * len(delta_ids))
    episode.spans.append(TokenSpan("env", start, len(episode.ids)))
    episode.messages.extend(new)
    episode.rendered = after
    episode.rerendered_turns += int(rerendered)


def finish_episode(episode: Episode, reason: StopReason, limit_hit: bool = False) -> None:
    """The episode ends for `reason`: turn-limited when the reason is one of TURN_LIMITED (`limit_hit` says so
    for a reason that is not), truncated when its last model turn was cut mid-generation."""
    episode.finished = True
    episode.stop_reason = reason
    episode.turn_limited = limit_hit or reason in TURN_LIMITED
    episode.truncated = bool(episode.turn_cut and episode.turn_cut[-1])


def _turn_budget(episode: Episode, limits: EpisodeLimits) -> int:
    """The next turn's most sampled tokens: the per-turn limit, or what the episode's limits leave if less."""
    room, _ = limits.room(episode)
    return limits.max_tokens_per_turn if room is None else min(limits.max_tokens_per_turn, room)


# What the model reads after an observation cut at task.max_observation_tokens.
OBSERVATION_CUT = "\n[... observation cut: its first {kept} of {total} tokens shown]"


def cut_observation(template: ChatTemplate, message: Message, max_tokens: int) -> tuple[Message, bool]:
    """`message` with its text content cut to its first `max_tokens` tokens and a marker the model reads saying
    so (a tool result or an environment message); whether it was cut. Other content (a list of parts) is kept."""
    content = message.get("content")
    if not isinstance(content, str) or len(content.encode()) <= max_tokens:  # a token holds at least one byte
        return message, False
    ids = template.encode(content)
    if len(ids) <= max_tokens:
        return message, False
    kept = str(template.tokenizer.decode(ids[:max_tokens], skip_special_tokens=False))
    return {**message, "content": kept + OBSERVATION_CUT.format(kept=max_tokens, total=len(ids))}, True


def cut_turn(sampled: SampledTurn, budget: int, stop_token_ids: frozenset[int]) -> SampledTurn:
    """The turn cut after its first stop token (an engine may pad after it) and at the episode's budget (exact:
    a token's log-prob depends only on the tokens before it)."""
    ids = list(sampled.ids)
    stop = next((i + 1 for i, t in enumerate(ids) if t in stop_token_ids), None)
    end = min(stop or len(ids), budget)
    logprobs = list(sampled.logprobs[:end]) if sampled.logprobs is not None else None
    if stop is not None and stop <= budget:
        return SampledTurn(ids[:end], logprobs, True, sampled.version)
    return SampledTurn(ids[:end], logprobs, sampled.stopped if end == len(ids) else False, sampled.version)


def apply_outcome(episode: Episode, template: ChatTemplate, outcome: TurnOutcome, limits: EpisodeLimits) -> None:
    """What follows a model turn: the hook's reward and counters recorded, then the episode ends (done, no
    messages, an error, a limit) or the new messages are appended as its next environment turn."""
    episode.step_rewards.append(outcome.reward)
    for name, count in outcome.counts.items():
        episode.counts[name] = episode.counts.get(name, 0) + int(count)
    new = [dict(m) for m in outcome.messages or []]
    if limits.max_observation_tokens is not None:
        cuts = [cut_observation(template, m, limits.max_observation_tokens) for m in new]
        new = [m for m, _ in cuts]
        cut = sum(was_cut for _, was_cut in cuts)
        if cut:
            episode.counts["truncated_observations"] = episode.counts.get("truncated_observations", 0) + cut
    if outcome.error is not None or outcome.done or not new:
        episode.messages.extend(new)
        episode.error = outcome.error
        finish_episode(episode, "error" if outcome.error is not None else "done" if outcome.done else "no_messages")
        return
    if episode.n_turns >= limits.max_turns:
        episode.messages.extend(new)
        finish_episode(episode, "max_turns")
        return
    delta_ids, after, rerendered = env_delta(episode, template, new)
    # Room for the environment's tokens and at least one sampled token after them, or the episode ends here.
    room, limit = limits.room(episode)
    if room is not None and len(delta_ids) >= room:
        episode.messages.extend(new)
        finish_episode(episode, limit)
        return
    append_env(episode, new, delta_ids, after, rerendered)


def run_episodes(
    episodes: Sequence[Episode],
    template: ChatTemplate,
    generate: Generate,
    on_turn: TurnHook,
    limits: EpisodeLimits,
) -> list[Episode]:
    """Run `episodes` (from `start_episode`) to their end, turn by turn: each round the unfinished ones generate
    together (one `generate` call, `max_tokens` the largest budget among them, each turn then cut to its own),
    and `on_turn` answers all of them at once. Returns the episodes, finished, in their order."""
    for episode in episodes:
        if not episode.ids and _turn_budget(episode, limits) < 1:
            raise ContextFullError(_opening_too_long(episode, limits))
    while True:
        active = [e for e in episodes if not e.finished]
        if not active:
            return list(episodes)
        budgets = [_turn_budget(e, limits) for e in active]
        sampled = generate([[*e.prompt_ids, *e.ids] for e in active], max(budgets))
        if len(sampled) != len(active):
            raise ValueError(f"generate returned {len(sampled)} turns for {len(active)} prompts")
        for episode, turn, budget in zip(active, sampled, budgets, strict=True):
            add_model_turn(episode, template, cut_turn(turn, budget, template.stop_token_ids))
        outcomes = on_turn(active)
        if len(outcomes) != len(active):
            raise ValueError(f"on_turn returned {len(outcomes)} outcomes for {len(active)} episodes")
        for episode, outcome in zip(active, outcomes, strict=True):
            apply_outcome(episode, template, outcome, limits)


def last_model_turn(episode: Episode) -> str:
    """The text of the episode's last model turn (its final answer; "" before any turn)."""
    for message in reversed(episode.messages):
        if message.get("role") == "assistant":
            return str(message.get("content", ""))
    return ""


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Per-episode means over a batch: `turns` (model turns), `env_tokens` (tokens out of the loss after the
    prompt), `truncated_episodes` (the fraction whose last model turn was cut mid-generation),
    `turn_limited_episodes` (the fraction ended by max_turns, max_episode_tokens or the context),
    `context_limited` (the fraction ended because the model's context was full), `rerendered_turns`, and each of
    the hooks' counters (`tool_calls`, `tool_errors`, `truncated_observations`, ...); {} for no episodes."""
    if not episodes:
        return {}
    n = len(episodes)
    metrics = {
        "turns": sum(e.n_turns for e in episodes) / n,
        "env_tokens": sum(e.env_tokens for e in episodes) / n,
        "truncated_episodes": sum(e.truncated for e in episodes) / n,
        "turn_limited_episodes": sum(e.turn_limited for e in episodes) / n,
        "rerendered_turns": sum(e.rerendered_turns for e in episodes) / n,
        "context_limited": sum(e.stop_reason == "context" for e in episodes) / n,
    }
    for name in sorted({name for e in episodes for name in e.counts}):
        metrics[name] = sum(e.counts.get(name, 0) for e in episodes) / n
    return metrics


def environment_hook(runner: EnvironmentRunner) -> TurnHook:
    """The hook that steps each episode's environment session (its `context`, from `EnvironmentRunner.reset`) on
    the conversation so far; the steps of different workers run in parallel."""

    def hook(episodes: Sequence[Episode]) -> list[TurnOutcome]:
        steps = runner.step([e.context for e in episodes], [e.messages for e in episodes])
        return [TurnOutcome(s.messages, s.reward, s.done, s.error) for s in steps]

    return hook


def tools_hook(runner: ToolRunner, prompt: ToolPrompt) -> TurnHook:
    """The hook that runs the tool calls of each episode's last turn (parsed in the prompt's format; every call of
    the batch started before any result is read, so they run concurrently) and appends one `tool` message per
    call; a turn without a call ends its episode. Counts `tool_calls` and `tool_errors` (the model's malformed
    calls, a tool's error or time-out: text the model reads, not the episode's error)."""

    def hook(episodes: Sequence[Episode]) -> list[TurnOutcome]:
        texts = [str(e.messages[-1]["content"]) for e in episodes]
        for episode, text in zip(episodes, texts, strict=True):
            shown = prompt.assistant_message(text)
            if shown != episode.messages[-1]:  # the template keeps rendering the text as sampled
                episode.parsed[len(episode.messages) - 1] = shown
        calls = [prompt.parse(text) for text in texts]
        results = runner.run(calls)
        return [
            TurnOutcome(
                [r.message() for r in turn],
                None,
                False,
                counts={"tool_calls": len(turn), "tool_errors": sum(r.error for r in turn)},
            )
            if turn
            else TurnOutcome(None, None, True)
            for turn in results
        ]

    return hook
