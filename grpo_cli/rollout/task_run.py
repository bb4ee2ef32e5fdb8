"""Which `runs.RolloutRun` a task's config makes: the one place the rollout worker asks (rollout/worker.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from grpo_cli.episodes.turns import Episode
from grpo_cli.rollout.agent_run import AgentRun, agent_settings
from grpo_cli.rollout.episode_rollout import EpisodeRun
from grpo_cli.rollout.multiturn import episode_setup, score_episodes
from grpo_cli.rollout.rewards import Scores
from grpo_cli.rollout.runs import OneTurnRun, RolloutRun
from grpo_cli.tasks.multiturn import agent_value

if TYPE_CHECKING:
    from grpo_cli.config.schemas import GRPOConfig
    from grpo_cli.tasks.base import RewardFn
    from grpo_cli.tasks.trainer_state import TrainerState


def run_for(cfg: GRPOConfig, tokenizer: Any, reward_fn: RewardFn) -> RolloutRun:
    """How `cfg`'s task runs and scores its episodes, `reward_fn` the task's reward: an agent's through
    rollout/agent_run.py, a multi-turn task's through rollout/multiturn.py's setup and scorer, a single-turn task's
    as episodes of one turn (`runs.OneTurnRun`). `tokenizer`: a transformers tokenizer (library boundary)."""
    if agent_value(cfg.task) is not None:  # the user's agent drives each episode (task.agent)
        return AgentRun(agent_settings(cfg), tokenizer, reward_fn)
    setup = episode_setup(cfg.task, tokenizer, cfg.rollout.max_tokens, cfg.model.name)
    if setup is None:  # no task.tools, no task.environment
        return OneTurnRun(tokenizer, reward_fn)

    def score(episodes: Sequence[Episode], trainer_state: TrainerState | None) -> Scores:
        return score_episodes(reward_fn, episodes, setup.env_weight, trainer_state)

    return EpisodeRun(setup, score)
