"""OpenRLHF's agent class (`openrlhf.utils.agent.AgentInstanceBase`: async `reset(states)` and `step(states)` on
text) as a task.environment, the way episodes/environments.py's SkyRLGymEnvironment runs a SkyRL-gym environment:

    task:
      environment:
        _target_: grpo_cli.episodes.adapters.openrlhf.OpenRLHFAgent
        agent: agent_func.py:AgentInstance       # the AgentInstanceBase subclass, unchanged

What OpenRLHF's MultiTurnAgentExecutor (openrlhf/utils/agent.py) does with it, reproduced per episode:
- one instance per episode, constructed with no arguments;
- `reset({"observation": prompt, "label": label})`, awaited; its "observation" is the opening (the row's prompt as
  text: a string as it is, chat messages as their last message's content), one user message here;
- after each model turn, `step({"observation_text": ..., "action_text": <the turn>, "label": ...,
  "sampling_params": None})`, awaited; `observation_text` grows as OpenRLHF grows it (observation + action +
  feedback); "rewards" (a tensor or a number, summed over the episode as OpenRLHF's total_reward) is the step's
  reward (the `env` component), "environment_feedback" the next user message, "done" ends the episode;
  "scores", "extra_logs" and "sampling_params" are dropped.

The difference, said once: OpenRLHF appends the feedback text to the token stream as it is; here it is a user
message the chat template renders (the episode's tokens are built as for every environment: docs/multi-turn.md).
The `label` is the row's `label` column (None without one). No torch (a tensor reward is read with `.item()`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpo_cli.episodes.environments import BadEnvironmentReturn, Message, default_opening
from grpo_cli.usercode.awaiting import resolved
from grpo_cli.usercode.user_code import load_callable


def _number(value: Any) -> float:
    """A step's "rewards" as OpenRLHF reads it (`.item()` of a tensor), or a plain number as it is."""
    if callable(getattr(value, "item", None)):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadEnvironmentReturn(f"step's rewards must be a number or a one-element tensor, not {value!r:.60}")
    return float(value)


class OpenRLHFAgent:
    """An OpenRLHF AgentInstanceBase subclass as task.environment's protocol (module docstring)."""

    def __init__(self, agent: str, base_dir: str | None = None) -> None:
        self.agent = agent
        self.base_dir = Path(base_dir) if base_dir else Path.cwd()
        self._instance: Any = None
        self._label: Any = None
        self._observation = ""

    def reset(self, row: dict[str, Any]) -> list[Message]:
        cls = load_callable("task.environment.agent", self.agent, self.base_dir, what="class")
        self._instance = cls()
        opening = default_opening(row)
        prompt = row["prompt"] if isinstance(row.get("prompt"), str) else str(opening[-1]["content"])
        self._label = row.get("label")
        result = resolved(self._instance.reset({"observation": prompt, "label": self._label}))
        if not isinstance(result, dict) or not isinstance(result.get("observation"), str):
            raise BadEnvironmentReturn(f"reset must return {{'observation': str, ...}}, not {result!r:.80}")
        self._observation = result["observation"]
        return [{"role": "user", "content": self._observation}]

    def step(self, messages: list[Message]) -> tuple[list[Message] | None, float, bool]:
        action = str(messages[-1]["content"])
        states = {"observation_text": self._observation, "action_text": action, "label": self._label}
        out = resolved(self._instance.step({**states, "sampling_params": None}))
        if not isinstance(out, dict) or not {"rewards", "environment_feedback", "done"} <= out.keys():
            raise BadEnvironmentReturn(
                f"step must return a dict with rewards, environment_feedback and done, not {out!r:.80}"
            )
        feedback = str(out["environment_feedback"])
        self._observation = self._observation + action + feedback
        done = bool(out["done"].item() if callable(getattr(out["done"], "item", None)) else out["done"])
        return [{"role": "user", "content": feedback}], _number(out["rewards"]), done
