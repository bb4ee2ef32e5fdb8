"""One rollout path: every task's samples are episodes, run by the task's `RolloutRun`, and the worker and the
evaluation hold no single- or multi-turn branch.

A single-turn completion is an episode of one turn with no tools and no environment (`OneTurnRun`): its batched
generation is one `engine.generate` call over the whole batch (the transformers decode loop, vLLM's batched
calls), its reward grades the completion's text. A multi-turn task's episodes take turns with its tools or
environment (`episode_rollout.EpisodeRun`). Both hand back the same `Samples`, so producing a training batch
(rollout/worker.py) and evaluating (rollout/evaluation.py) are written once, and whatever drives an episode next (an
asynchronous generator, an agent through an OpenAI-compatible endpoint) is one more `RolloutRun` on the same code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from grpo_cli.engines.base import RolloutEngine, SamplingSettings, first_prompt_past_context, render_prompts
from grpo_cli.rollout.rewards import Scores, score_responses

if TYPE_CHECKING:
    from grpo_cli.episodes.turns import Episode
    from grpo_cli.tasks.base import Example, RewardFn
    from grpo_cli.tasks.custom import TrainerState


@dataclass
class Samples:
    """A batch of sampled episodes, prompt-major (the n of example 0, then the n of example 1, ...), whichever run
    made them: what the learner trains on, the reward grades and an evaluation records."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]  # every id after the prompt: the model's and, in an episode, the tools'
    responses: list[str]  # what the reward grades and a record shows: the completion, an episode's last model turn
    ground_truths: list[Any]  # each sample's example's (whatever the task's examples hold)
    truncated: list[bool]  # its last model turn cut at its token limit mid-generation (train.mask_truncated's)
    model_tokens: list[int]  # the model's sampled tokens (the response length; tool/environment tokens aside)
    context_limited: list[bool]  # ended because the model's context was full
    # Per completion id, the sampler's log-prob (0.0 at tool/environment tokens); None when the engine gives none.
    sampler_log_probs: list[list[float]] | None = None
    # Per completion id: 1 a model token (in the loss), 0 a tool/environment token; None: every one is the model's.
    token_masks: list[list[int]] | None = None
    episodes: list[Episode] = field(default_factory=list)  # a multi-turn run's episodes (their transcripts)
    # sync=async: per completion id, the policy version that sampled it (-1 at tool/environment tokens); None: not
    # recorded (every other strategy: the batch's one version).
    token_versions: list[list[int]] | None = None

    @property
    def n_generated_tokens(self) -> int:
        return sum(self.model_tokens)


def join_samples(parts: Sequence[Samples]) -> Samples:
    """One batch of several, in order (the chunks of an evaluation)."""

    def rows(name: str) -> list[Any]:
        return [row for part in parts for row in getattr(part, name)]

    def rows_if_all(name: str) -> list[Any] | None:
        return None if any(getattr(part, name) is None for part in parts) else rows(name)

    return Samples(
        prompt_ids=rows("prompt_ids"),
        completion_ids=rows("completion_ids"),
        responses=rows("responses"),
        ground_truths=rows("ground_truths"),
        truncated=rows("truncated"),
        model_tokens=rows("model_tokens"),
        context_limited=rows("context_limited"),
        sampler_log_probs=rows_if_all("sampler_log_probs"),
        token_masks=rows_if_all("token_masks"),
        episodes=rows("episodes"),
        token_versions=rows_if_all("token_versions"),
    )


def sampling_version(engine: RolloutEngine) -> int | None:
    """The policy version `engine` samples from when it records one (the asynchronous generator's engine,
    rollout/async_generation.py, which takes weight updates between calls); None otherwise."""
    version = getattr(engine, "policy_version", None)
    return version if isinstance(version, int) else None


class RolloutRun(Protocol):
    """How a task's episodes are sampled, scored and described, the one interface the worker and evaluation use."""

    def sample(self, engine: RolloutEngine, settings: SamplingSettings, examples: Sequence[Example]) -> Samples:
        """settings.n episodes per example on `engine`, prompt-major; settings.first_prompt_index places `examples`
        in the step's prompt list (a data-parallel rank's share, an evaluation's chunk): each sample's random
        streams depend on its place there only."""
        ...

    def score(self, samples: Samples, trainer_state: TrainerState | None) -> Scores:
        """The task's rewards of `samples` (a crash or a timeout costs one sample, never the run)."""
        ...

    def metrics(self, samples: Samples, prefix: str) -> dict[str, float]:
        """`<prefix>/...` statistics of the run's own (an episode's turns, tool calls, ...); {} for none."""
        ...

    def transcripts(self, samples: Samples, rewards: Sequence[dict[str, float]] | None) -> list[dict[str, Any]] | None:
        """One transcript record per sample for the run's logs and eval records; None when the samples have none
        beyond their response (a one-turn completion)."""
        ...

    def prompt_text(self, prompt_ids: Sequence[int]) -> str:
        """A prompt's text as the model read it (special tokens kept), for the eval records."""
        ...

    def first_prompt_past_context(self, examples: Sequence[Example], context_length: int) -> tuple[int, int] | None:
        """(index, token count) of the first example whose prompt leaves no room for one sampled token, checked
        before training starts; None when all fit or the run checks its openings as they open (episodes)."""
        ...

    def close(self) -> None:
        """Stop what the run started (tool and environment worker processes)."""
        ...


@dataclass(frozen=True)
class OneTurnRun:
    """A single-turn task: each sample is an episode of one turn, no tools, no environment; the batch's prompts
    are rendered once and generated by one engine.generate call (the engines' batched fast paths), and the reward
    grades each completion's text with the engine's token count (`n_tokens`) and sampled ids."""

    tokenizer: Any  # a transformers PreTrainedTokenizerBase (untyped library boundary)
    reward_fn: RewardFn

    def sample(self, engine: RolloutEngine, settings: SamplingSettings, examples: Sequence[Example]) -> Samples:
        prompt_ids = render_prompts([e.prompt for e in examples], self.tokenizer)
        batch = engine.generate(prompt_ids, settings)
        return Samples(
            prompt_ids=batch.prompt_ids,
            completion_ids=batch.completion_ids,
            responses=batch.texts,
            ground_truths=[e.ground_truth for e in examples for _ in range(settings.n)],
            truncated=batch.truncated,
            model_tokens=[len(ids) for ids in batch.completion_ids],
            # The engines list it only when some completion was cut there: one flag per sample here, joinable.
            context_limited=batch.context_limited or [False] * len(batch.completion_ids),
            sampler_log_probs=batch.sampler_log_probs,
        )

    def score(self, samples: Samples, trainer_state: TrainerState | None) -> Scores:
        return score_responses(
            self.reward_fn,
            samples.responses,
            samples.ground_truths,
            samples.model_tokens,
            samples.completion_ids,
            trainer_state,
        )

    def metrics(self, samples: Samples, prefix: str) -> dict[str, float]:
        return {}

    def transcripts(self, samples: Samples, rewards: Sequence[dict[str, float]] | None) -> list[dict[str, Any]] | None:
        return None

    def prompt_text(self, prompt_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False))

    def first_prompt_past_context(self, examples: Sequence[Example], context_length: int) -> tuple[int, int] | None:
        return first_prompt_past_context([e.prompt for e in examples], self.tokenizer, context_length)

    def close(self) -> None:
        return None
