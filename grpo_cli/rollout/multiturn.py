"""A task's multi-turn episodes, set up in one place: what the rollout calls to run and score them.

    setup = episode_setup(cfg.task, tokenizer, cfg.rollout.max_tokens)   # None: a single-turn task
    if setup is not None:
        episodes = setup.run(examples, generate)     # opened, run turn by turn (episodes/turns.py), finished
        scores = score_episodes(reward_fn, episodes, setup.env_weight, trainer_state)
        ...
        setup.close()                                 # the tool and environment worker processes stopped

`EpisodeSetup` holds, built from task.* (tasks/multiturn.py reads the keys, episodes/config.py checks them):
    template    the ChatTemplate episodes render with (ChatTemplate.for_tools when the task has tools: the tools in
                the template's own way or the default tool prompt)
    limits      EpisodeLimits(task.max_turns, rollout.max_tokens per turn, task.max_episode_tokens,
                task.max_observation_tokens); the engine's context_length is added where the episodes run
    on_turn     the TurnHook answering each model turn: tools_hook (task.tools, run in task.reward_workers worker
                processes, each call limited to task.tool_timeout_s) or the environment's (task.environment, one
                instance per episode, each call limited to task.reward_timeout_s)
    env_weight  task.reward_weights.env, the weight of the environment's summed step rewards
    on_error    task.on_reward_error, applied to an environment that fails on an episode by `finish`
and does:
    open(examples)            one Episode per example (its `context` an EpisodeContext: the example, its row and its
                              environment session): the environment's reset(row) gives the opening messages, else
                              the example's prompt (chat messages; text as one user message)
    run(examples, generate)   open, episodes.turns.run_episodes, finish: the finished episodes in order
    finish(episodes)          the environment sessions closed; an episode the environment failed on (reset, step,
                              a time-out) stops the run with one line under on_reward_error=stop (EnvironmentFailed);
                              under skip the episode is skipped (Episode.skipped: no reward, out of the loss)
    close()                   stop the worker processes (a later call starts new ones)

`score_episodes(reward_fn, episodes, env_weight, trainer_state)` scores finished episodes with the task's reward
(make_reward_fn's): a built-in task's reward grades the episode's last model turn (its final answer), as it grades a
single completion (a turn-limited episode has none: an empty answer is graded); task=custom's functions get the
whole episode: completions= the episode's messages after the prompt (always messages), prompts= its opening messages
(what the environment's reset gave the model), completion_ids= the model's sampled ids per turn (a list of lists per
episode), and under per_sample the messages as the response. The environment's summed step rewards
(Episode.step_reward) are the component `env`: "reward/env" (logged as train/reward/env and eval/reward/env like the
others) and env_weight * it added to "reward" (task=custom: one of its components, which task.answer_from may name).
A skipped episode gets no reward at all (Scores.skipped). The overlong term reads the last model turn's token count
(the turn that rollout.max_tokens cuts). Returns rollout.rewards.Scores, as score_responses does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from grpo_cli.episodes.adapters.trl import ENVIRONMENT_FACTORY_KEY, EnvironmentResult, load_environments
from grpo_cli.episodes.config import environment_spec, tool_specs
from grpo_cli.episodes.environments import (
    EnvironmentRunner,
    EnvSession,
    EnvStep,
    check_error,
    default_opening,
    with_run_limits,
)
from grpo_cli.episodes.tools import ToolPrompt, ToolRunner, load_tools, tool_prompt
from grpo_cli.episodes.turns import (
    ChatTemplate,
    Episode,
    EpisodeLimits,
    Generate,
    Message,
    TurnHook,
    TurnOutcome,
    last_model_turn,
    run_episodes,
    start_episode,
    tools_hook,
)
from grpo_cli.rollout.rewards import Scores, score_responses, scores_of_batch
from grpo_cli.tasks.base import Example, GroundTruth, RewardFn
from grpo_cli.tasks.multiturn import (
    ENV_COMPONENT,
    ENVIRONMENT_KEY,
    base_dir_of_task,
    env_weight,
    environment_factory_value,
)
from grpo_cli.tasks.rewards import uses_n_tokens
from grpo_cli.tasks.schema import TaskConfig
from grpo_cli.tasks.trainer_state import TrainerState


@dataclass
class EpisodeContext:
    """An episode's own data (Episode.context): the example it was opened from, the row its environment was reset
    with, and its environment session (None: the task has tools, not an environment)."""

    example: Example
    row: dict[str, Any]
    session: EnvSession | None = None
    # What the environment gave when its instance was released (task.environment_factory: EnvironmentResult).
    result: Any = None


def episode_row(example: Example) -> dict[str, Any]:
    """The row an environment is reset with: the example's columns (a dict ground truth, as task=custom's and
    guess_number's are) or {"ground_truth": ...}, and its prompt as "prompt"."""
    truth = example.ground_truth
    columns = dict(truth) if isinstance(truth, dict) else {"ground_truth": truth}
    return {**columns, "prompt": example.prompt}


def opening_messages(example: Example) -> list[Message]:
    """The example's prompt as messages: chat messages as they are, text as one user message."""
    return default_opening({"prompt": example.prompt})


@dataclass
class EpisodeSetup:
    """How a task's episodes run (module docstring)."""

    template: ChatTemplate
    limits: EpisodeLimits
    env_weight: float
    on_error: str
    tools: ToolRunner | None = None
    tool_prompt: ToolPrompt | None = None
    environment: EnvironmentRunner | None = None
    environment_key: str = ENVIRONMENT_KEY  # the key the environment's failures name (task.environment_factory)
    _hook: TurnHook | None = field(default=None, repr=False)

    @property
    def on_turn(self) -> TurnHook:
        """The hook that answers each model turn (the tools' or the environment's)."""
        if self._hook is None:
            if self.tools is not None and self.tool_prompt is not None:
                self._hook = tools_hook(self.tools, self.tool_prompt)
            else:
                self._hook = self._environment_turn
        return self._hook

    def open(self, examples: Sequence[Example]) -> list[Episode]:
        """One episode per example, at its opening messages (module docstring)."""
        rows = [episode_row(example) for example in examples]
        if self.environment is None:
            return [
                start_episode(self.template, opening_messages(ex), EpisodeContext(ex, row))
                for ex, row in zip(examples, rows, strict=True)
            ]
        sessions = self.environment.reset(rows)
        episodes = []
        for example, row, session in zip(examples, rows, sessions, strict=True):
            if session.error is not None:
                check_error(self.environment_key, self.on_error, f"reset {session.error}", row)
            # A reset that failed under skip: the episode opens with the example's prompt and ends after the
            # model's first turn with that error (no env reward).
            opening = session.opening if session.error is None else opening_messages(example)
            episodes.append(start_episode(self.template, opening, EpisodeContext(example, row, session)))
        return episodes

    def run(self, examples: Sequence[Example], generate: Generate) -> list[Episode]:
        """The examples' episodes, opened, run to their end through `generate` and finished."""
        episodes = run_episodes(self.open(examples), self.template, generate, self.on_turn, self.limits)
        self.finish(episodes)
        return episodes

    def finish(self, episodes: Sequence[Episode]) -> None:
        """The environment sessions closed, and task.on_reward_error applied to an episode it failed on."""
        if self.environment is None:
            return
        held = [e for e in episodes if isinstance(e.context, EpisodeContext) and e.context.session is not None]
        results = self.environment.close([e.context.session for e in held])
        for episode, result in zip(held, results, strict=True):
            episode.context.result = result
            if isinstance(result, EnvironmentResult):  # get_reward: the env component, at the episode's end
                episode.step_rewards.append(result.reward)
                if "get_reward" in result.errors and episode.error is None:
                    episode.error = f"get_reward {result.errors['get_reward']}"
        for episode in episodes:
            if episode.error is not None and isinstance(episode.context, EpisodeContext):
                check_error(self.environment_key, self.on_error, episode.error, episode.context.row)

    def close(self) -> None:
        """Stop the tools' and the environment's worker processes."""
        if self.tools is not None:
            self.tools.close()
        if self.environment is not None:
            self.environment.shutdown()

    def _environment_turn(self, episodes: Sequence[Episode]) -> list[TurnOutcome]:
        """The environment's step on each episode's conversation; an episode whose reset failed ends with it."""
        assert self.environment is not None
        outcomes: list[TurnOutcome | None] = [None] * len(episodes)
        live: list[int] = []
        for index, episode in enumerate(episodes):
            session = episode.context.session if isinstance(episode.context, EpisodeContext) else None
            if session is None:
                raise ValueError("an environment episode without its session: open it with EpisodeSetup.open")
            if session.error is not None:
                outcomes[index] = TurnOutcome(error=f"reset {session.error}")
            else:
                live.append(index)
        steps: list[EnvStep] = self.environment.step(
            [episodes[i].context.session for i in live], [episodes[i].messages for i in live]
        )
        for index, step in zip(live, steps, strict=True):
            outcomes[index] = TurnOutcome(step.messages, step.reward, step.done, step.error)
        return [o for o in outcomes if o is not None]


def episode_setup(
    task_cfg: TaskConfig, tokenizer: Any, max_tokens_per_turn: int, model_name: str = "the model"
) -> EpisodeSetup | None:
    """How `task_cfg`'s episodes run with this tokenizer, or None for a single-turn task (no task.tools, no
    task.environment). `tokenizer` is a transformers tokenizer (untyped library boundary); `max_tokens_per_turn`
    is rollout.max_tokens; `model_name` names the model in the log line about a template that cannot render tools.
    Tools are loaded and the environment's worker processes prepared here (the workers start on first use)."""
    specs = tool_specs(task_cfg)
    environment = environment_spec(task_cfg)
    if not specs and environment is None:
        return None
    limits = EpisodeLimits(
        task_cfg.max_turns,
        max_tokens_per_turn,
        task_cfg.max_episode_tokens,
        max_observation_tokens=task_cfg.max_observation_tokens,
    )
    base_dir = base_dir_of_task(task_cfg)
    weight, on_error = env_weight(task_cfg), task_cfg.on_reward_error
    if specs:
        tools = load_tools(specs, base_dir)
        prompt = tool_prompt(tokenizer, tools, task_cfg.tool_call_format, model_name)
        runner = ToolRunner(tools, task_cfg.tool_timeout_s or None, workers=task_cfg.reward_workers)
        template = ChatTemplate.for_tools(tokenizer, prompt)
        return EpisodeSetup(template, limits, weight, on_error, tools=runner, tool_prompt=prompt)
    assert environment is not None
    # An environment class declaring max_turns gets task.max_turns (the SkyRL adapter: SkyRL's extras["max_turns"]).
    environment = with_run_limits(ENVIRONMENT_KEY, environment, base_dir, task_cfg.max_turns)
    template, key = ChatTemplate(tokenizer), ENVIRONMENT_KEY
    factory = environment_factory_value(task_cfg)
    if factory is not None:  # TRL's environment class: its methods are the tools the template shows
        loaded = load_environments(factory, base_dir)
        prompt = tool_prompt(tokenizer, loaded.tools, task_cfg.tool_call_format, model_name)
        assert isinstance(environment, dict)
        environment = {**environment, "tool_call_format": prompt.fmt.name}
        template, key = ChatTemplate.for_tools(tokenizer, prompt), ENVIRONMENT_FACTORY_KEY
    env_runner = EnvironmentRunner(
        key, environment, base_dir, task_cfg.reward_workers, task_cfg.reward_timeout_s or None
    )
    return EpisodeSetup(template, limits, weight, on_error, environment=env_runner, environment_key=key)


def score_episodes(
    reward_fn: RewardFn,
    episodes: Sequence[Episode],
    env_weight: float = 1.0,
    trainer_state: TrainerState | None = None,
    truths: Sequence[GroundTruth] | None = None,
) -> Scores:
    """The rewards of finished episodes (module docstring). `truths`: each episode's ground truth (default: its
    EpisodeContext's example's). A skipped episode (`Episode.skipped`: its environment failed, under
    task.on_reward_error=skip) is not scored: no reward of any component, listed in `Scores.skipped` and counted
    in `n_errors`."""
    if truths is None:
        truths = [_truth_of(e) for e in episodes]
    scored = [i for i, e in enumerate(episodes) if not e.skipped]
    if scored:
        part = _score_ended(
            reward_fn, [episodes[i] for i in scored], [truths[i] for i in scored], env_weight, trainer_state
        )
    else:
        part = Scores([], 0)
    if len(scored) == len(episodes):
        return part
    # Spread the scored episodes' results back over the whole batch, a skipped episode's slot empty.
    rewards: list[dict[str, float]] = [dict(SKIPPED_REWARD) for _ in episodes]
    for slot, reward in zip(scored, part.rewards, strict=True):
        rewards[slot] = reward
    extra: dict[str, list[Any]] = {}
    for column, values in part.extra_columns.items():
        extra[column] = [None] * len(episodes)
        for slot, value in zip(scored, values, strict=True):
            extra[column][slot] = value
    skipped = [i for i in range(len(episodes)) if i not in set(scored)]
    return Scores(
        rewards,
        part.n_errors + len(skipped),
        part.n_timeouts,
        extra,
        part.logged_metrics,
        skipped=skipped,
        no_correctness={scored[i]: why for i, why in part.no_correctness.items()}
        | {i: "the environment failed on the episode (task.on_reward_error=skip: no reward)" for i in skipped},
    )


# A skipped episode's reward: placeholders no mean, loss or advantage statistic reads (Scores.skipped).
SKIPPED_REWARD = {"reward": 0.0, "format_reward": 0.0, "answer_reward": 0.0}


def _score_ended(
    reward_fn: RewardFn,
    episodes: Sequence[Episode],
    truths: Sequence[GroundTruth],
    env_weight: float,
    trainer_state: TrainerState | None,
) -> Scores:
    """score_episodes on episodes that ended without an error. A turn-limited episode (`Episode.turn_limited`: it
    ran out of turns or tokens before its tools or environment ended it) has no final answer: a built-in task's
    reward grades an empty answer (0 for its answer components); its `env` component is what its environment gave."""
    responses = [last_model_turn(e) for e in episodes]
    last_lengths = [len(e.model_turns[-1]) if e.model_turns else 0 for e in episodes]
    score_batch = getattr(reward_fn, "score_batch", None)
    if score_batch is not None:  # task=custom: the functions get the whole episode, env among the components
        batch = score_batch(
            responses,
            list(truths),
            last_lengths,
            [[list(turn) for turn in e.model_turns] for e in episodes],
            trainer_state,
            completions=[e.completion_messages for e in episodes],
            prompts=[[dict(m) for m in e.prompt_messages] for e in episodes],
            env_rewards=[e.step_reward for e in episodes],
            **_computed_rewards(episodes),
        )
        return scores_of_batch(batch)
    answers = ["" if e.turn_limited else text for e, text in zip(episodes, responses, strict=True)]
    if uses_n_tokens(reward_fn):
        scores = score_responses(reward_fn, answers, list(truths), last_lengths)
    else:
        scores = score_responses(reward_fn, answers, list(truths))
    for episode, reward in zip(episodes, scores.rewards, strict=True):
        value = episode.step_reward
        if value is None:
            continue
        reward[f"reward/{ENV_COMPONENT}"] = value
        reward["reward"] = reward["reward"] + env_weight * value
    return scores


def _computed_rewards(episodes: Sequence[Episode]) -> dict[str, Any]:
    """score_batch's `computed`: the values (and failures) of the rewards that took environments=, computed where the
    instances live (episodes/adapters/trl.py, TRLEnvironment.close); {} when no episode has any."""
    results = [e.context.result if isinstance(e.context, EpisodeContext) else None for e in episodes]
    names = {n for r in results if isinstance(r, EnvironmentResult) for n in [*r.rewards, *r.errors]}
    names.discard("get_reward")
    if not names:
        return {}
    computed: dict[str, list[tuple[Any, str | None]]] = {}
    for name in sorted(names):
        computed[name] = [
            (r.rewards.get(name), r.errors.get(name)) if isinstance(r, EnvironmentResult) else (None, "no environment")
            for r in results
        ]
    return {"computed": computed}


def _truth_of(episode: Episode) -> GroundTruth:
    if not isinstance(episode.context, EpisodeContext):
        raise ValueError("an episode without its EpisodeContext: give score_episodes the truths")
    return episode.context.example.ground_truth
