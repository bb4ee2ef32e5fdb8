"""Multi-turn episodes on a rollout engine: the engine binding and the batch of episodes the learner trains on.

`episodes.run_episodes` drives a batch turn by turn through a `Generate` callable; `EngineTurns` binds one to any
`RolloutEngine` (rollout=hf, rollout=vllm). Random streams: a single-turn completion draws from the stream of
(step seed, prompt index, completion index) (`engines.sampling`); an episode's turn t draws from the stream of
(`turn_seed(step seed, t)`, episode index, 0), the episode index being its place in the step's whole list of
episodes (prompt index * G + completion index). So a turn's samples depend on its episode and its turn only: not on
which other episodes are still running in the round, how the batch is chunked, or how the step is split across
data-parallel ranks (each rank passes its share's first episode index, as single-turn rollouts pass their first
prompt's).

`episode_batch` turns finished episodes into what the learner scores (`runs.Samples`): per episode the prompt
ids, the ids after them as the completion (model and tool/environment tokens, as built), a per-token mask with holes
(model tokens 1, tool/environment tokens 0), the sampler's log-probs aligned with the completion, and `truncated`.
`EpisodeRun` is a multi-turn task's `runs.RolloutRun`: the worker and evaluation run it as they run a single-turn
task's one-turn episodes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from grpo_cli.engines.base import RolloutEngine, SamplingSettings
from grpo_cli.engines.sampling import turn_seed
from grpo_cli.episodes.turns import (
    ENV_VERSION,
    ChatTemplate,
    Episode,
    EpisodeLimits,
    SampledTurn,
    TurnHook,
    episode_metrics,
    last_model_turn,
    run_episodes,
)
from grpo_cli.errors import UserFacingError
from grpo_cli.rollout.rewards import Scores
from grpo_cli.rollout.runs import Samples, sampling_version

if TYPE_CHECKING:
    from grpo_cli.tasks.base import Example
    from grpo_cli.tasks.trainer_state import TrainerState


class EngineTurns:
    """A `Generate` for `run_episodes` over `episodes` (in the order given), sampling with `engine`.

    Each call samples the unfinished episodes' next turn, one completion each (`settings.n` is ignored), with at
    most `max_tokens` tokens (the driver's largest budget; `settings.max_tokens` is not read), and returns the
    sampled ids, the engine's sampler log-probs (None where it gives none) and whether each turn stopped (EOS or
    a stop string) rather than being cut. `first_episode_index` is the index of `episodes[0]` in the step's whole
    list of episodes (module docstring)."""

    def __init__(
        self,
        engine: RolloutEngine,
        settings: SamplingSettings,
        episodes: Sequence[Episode],
        first_episode_index: int = 0,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.episodes = list(episodes)
        self.first_episode_index = first_episode_index
        self.calls = 0

    def __call__(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[SampledTurn]:
        # run_episodes passes the unfinished episodes, in order, each as its prompt and ids so far.
        active = [i for i, e in enumerate(self.episodes) if not e.finished]
        if len(active) != len(prompts) or any(
            len(prompt) != len(self.episodes[i].prompt_ids) + len(self.episodes[i].ids)
            for i, prompt in zip(active, prompts, strict=True)
        ):
            raise ValueError("EngineTurns was called with prompts that are not its unfinished episodes, in order")
        turns = {self.episodes[i].n_turns for i in active}
        if len(turns) != 1:
            raise ValueError(f"the unfinished episodes of a round are at different turns: {sorted(turns)}")
        settings = replace(
            self.settings,
            n=1,
            max_tokens=max_tokens,
            min_tokens=min(self.settings.min_tokens, max_tokens),
            seed=turn_seed(self.settings.seed, turns.pop()),
            first_prompt_index=0,
            prompt_indices=tuple(self.first_episode_index + i for i in active),
        )
        batch = self.engine.generate([list(p) for p in prompts], settings)
        self.calls += 1
        log_probs = batch.sampler_log_probs
        version = sampling_version(self.engine)
        return [
            SampledTurn(list(ids), None if log_probs is None else list(log_probs[row]), not cut, version)
            for row, (ids, cut) in enumerate(zip(batch.completion_ids, batch.truncated, strict=True))
        ]


def run_on_engine(
    engine: RolloutEngine,
    settings: SamplingSettings,
    episodes: Sequence[Episode],
    template: ChatTemplate,
    on_turn: TurnHook,
    limits: EpisodeLimits,
    first_episode_index: int = 0,
) -> list[Episode]:
    """Run opened `episodes` (`episodes.start_episode`) to their end on `engine`, turn by turn in batches."""
    return run_episodes(
        episodes, template, EngineTurns(engine, settings, episodes, first_episode_index), on_turn, limits
    )


def episode_batch(episodes: Sequence[Episode], ground_truths: Sequence[Any] | None = None) -> Samples:
    """What the learner scores of finished `episodes` (module docstring), as `Samples`; `ground_truths`: each
    episode's example's (default None)."""
    log_probs = [list(e.sampler_logprobs) for e in episodes]
    # None only when no turn has them (an engine that gives none); a turn without them keeps its NaN, which the
    # learner refuses where the correction or sync=async needs them (batch.rollout_data.missing_behaviour), rather than
    # the whole batch losing its log-probs and training uncorrected.
    given = any(not math.isnan(lp) for row in log_probs for lp in row)
    return Samples(
        prompt_ids=[list(e.prompt_ids) for e in episodes],
        completion_ids=[list(e.ids) for e in episodes],
        responses=[last_model_turn(e) for e in episodes],
        ground_truths=list(ground_truths) if ground_truths is not None else [None] * len(episodes),
        truncated=[e.truncated for e in episodes],
        model_tokens=[e.model_tokens for e in episodes],
        context_limited=[e.stop_reason == "context" for e in episodes],
        sampler_log_probs=log_probs if given else None,
        token_masks=[list(e.loss_mask) for e in episodes],
        token_versions=episode_versions(episodes),
        episodes=list(episodes),
    )


def episode_versions(episodes: Sequence[Episode]) -> list[list[int]] | None:
    """Each episode's token versions (sync=async); None when no token's was recorded (an engine that records none).
    Raises UserFacingError when only some turns recorded one: the others' behaviour policy is unknown, and labelling
    them with another version would mislabel them."""
    model = [v for e in episodes for v in e.versions if v != ENV_VERSION]  # environment tokens: never sampled
    missing = sum(v is None for v in model)
    if missing == len(model):
        return None
    if missing:
        raise UserFacingError(
            f"{missing} sampled tokens of this batch's episodes carry no policy version while the others do: the "
            "engine of some turns (an agent's calls?) did not record the version that sampled them, which "
            "sync=async needs: use sync=one_behind"
        )
    return [[v for v in e.versions if v is not None] for e in episodes]


def episode_train_metrics(episodes: Sequence[Episode], prefix: str = "train") -> dict[str, float]:
    """`<prefix>/turns`, `<prefix>/tool_calls`, `<prefix>/tool_errors`, `<prefix>/env_tokens`,
    `<prefix>/truncated_episodes` (last turn cut mid-generation), `<prefix>/turn_limited_episodes` (ended by
    max_turns, max_episode_tokens or the context), `<prefix>/context_limited` (ended because the model's context was
    full), `<prefix>/skipped_episodes` (the environment failed on them under task.on_reward_error=skip: no reward,
    out of the loss), `<prefix>/truncated_observations`, `<prefix>/rerendered_turns`: per-episode means over the
    batch (`episodes.episode_metrics`); tool_calls, tool_errors and truncated_observations are 0 where no episode
    had one."""
    metrics = {"tool_calls": 0.0, "tool_errors": 0.0, "truncated_observations": 0.0, **episode_metrics(episodes)}
    if episodes:
        metrics["skipped_episodes"] = sum(e.skipped for e in episodes) / len(episodes)
    return {f"{prefix}/{name}": float(value) for name, value in metrics.items()}


# The keys a transcript adds to an eval record (besides its rewards and truncated, which the record has already).
TRANSCRIPT_COLUMNS = (
    "messages",
    "turns",
    "model_tokens",
    "env_tokens",
    "turn_limited",
    "stop_reason",
    "error",
    "counts",
)


def transcript(episode: Episode, rewards: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One episode as a transcript record (a line of the per-step episodes file, an eval generations record):
    its messages, reward components, turns, token counts, truncated (its last turn cut mid-generation),
    turn_limited (ended by a limit) and why it stopped."""
    return {
        "messages": [dict(m) for m in episode.public_messages],
        "rewards": dict(rewards or {}),
        "turns": episode.n_turns,
        "model_tokens": episode.model_tokens,
        "env_tokens": episode.env_tokens,
        "truncated": episode.truncated,
        "turn_limited": episode.turn_limited,
        "stop_reason": episode.stop_reason,
        "error": episode.error,
        **({"counts": dict(episode.counts)} if episode.counts else {}),
    }


def episode_transcripts(
    episodes: Sequence[Episode], rewards: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """Each episode's transcript record with its rewards (none given: empty ones)."""
    given: Sequence[Mapping[str, Any] | None] = rewards if rewards is not None else [None] * len(episodes)
    return [transcript(e, r) for e, r in zip(episodes, given, strict=True)]


class EpisodeRunner(Protocol):
    """What runs a task's episodes (the task side's `EpisodeSetup`): the template they render with, their limits,
    the hook answering each model turn, `open` (one episode per example, at its opening messages) and `finish`
    (environment sessions closed, task.on_reward_error applied), `close` (its worker processes stopped)."""

    template: ChatTemplate
    limits: EpisodeLimits

    @property
    def on_turn(self) -> TurnHook: ...

    def open(self, examples: Sequence[Example]) -> list[Episode]: ...

    def finish(self, episodes: Sequence[Episode]) -> None: ...

    def close(self) -> None: ...


# Scores finished episodes with the task's reward (their `env` component included), for trainer_state.
EpisodeScorer = Callable[[Sequence[Episode], "TrainerState | None"], "Scores"]


@dataclass(frozen=True)
class EpisodeRun:
    """A multi-turn task as the rollout worker runs it (a `runs.RolloutRun`): its episodes' runner and their
    scorer."""

    setup: EpisodeRunner
    scorer: EpisodeScorer

    def generate(
        self, engine: RolloutEngine, settings: SamplingSettings, examples: Sequence[Example], first_prompt_index: int
    ) -> list[Episode]:
        """settings.n episodes per example (prompt-major: example 0's n, then example 1's, ...), run to their end
        on `engine` and finished; `first_prompt_index` places `examples` in the step's prompt list (a data-parallel
        rank's share), so episode j of prompt p is episode p * n + j of the step (its random streams')."""
        n = settings.n
        episodes = self.setup.open([example for example in examples for _ in range(n)])
        # Each episode's budget: task.max_episode_tokens or what the model's context leaves after its prompt.
        limits = replace(self.setup.limits, context_length=engine.context_length)
        run_on_engine(
            engine, settings, episodes, self.setup.template, self.setup.on_turn, limits, first_prompt_index * n
        )
        self.setup.finish(episodes)
        return episodes

    def sample(self, engine: RolloutEngine, settings: SamplingSettings, examples: Sequence[Example]) -> Samples:
        episodes = self.generate(engine, settings, examples, settings.first_prompt_index)
        return episode_batch(episodes, [e.ground_truth for e in examples for _ in range(settings.n)])

    def score(self, samples: Samples, trainer_state: TrainerState | None) -> Scores:
        """The episodes' rewards, scored whole (their reward components, `env` included)."""
        return self.scorer(samples.episodes, trainer_state)

    def metrics(self, samples: Samples, prefix: str) -> dict[str, float]:
        return episode_train_metrics(samples.episodes, prefix)

    def transcripts(self, samples: Samples, rewards: Sequence[dict[str, float]] | None) -> list[dict[str, Any]] | None:
        return episode_transcripts(samples.episodes, rewards)

    def prompt_text(self, prompt_ids: Sequence[int]) -> str:
        return self.setup.template.decode(prompt_ids)

    def first_prompt_past_context(self, examples: Sequence[Example], context_length: int) -> tuple[int, int] | None:
        """None: an episode's opening is checked as it opens (episodes.run_episodes), after its environment's reset
        gave it."""
        return None

    def close(self) -> None:
        self.setup.close()
