"""A `_partial_: true` reward node (task.rewards.<name>={_target_: file.py:fn, _partial_: true, <arguments>}) whose
arguments the function does not take is refused when the task is loaded, in one line naming the key, the function
and the argument (Hydra binds them only at the first call, where the error was `partial object
_DeferredTarget(<function ...>, bonus=1) has incorrect arguments`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_cli.usercode.user_code import UserCodeError, load_reward_spec

REWARDS = """
def strict(completions, scale=1.0):
    return [scale * len(c) for c in completions]


def loose(completions, scale=1.0, **kwargs):
    return [scale * len(c) for c in completions]
"""


def test_an_argument_the_function_does_not_take_is_one_line_naming_key_function_and_argument(tmp_path: Path) -> None:
    (tmp_path / "rewards.py").write_text(REWARDS)
    spec = {"_target_": "rewards.py:strict", "_partial_": True, "bonus": 1}
    with pytest.raises(UserCodeError) as info:
        load_reward_spec("task.rewards.strict_bonus", spec, tmp_path)
    said = str(info.value)
    assert said.startswith("task.rewards.strict_bonus=") and "\n" not in said
    assert "strict(completions, scale=1.0) takes no argument bonus=" in said
    assert "has incorrect arguments" not in said


def test_arguments_the_function_takes_are_bound_and_kwargs_takes_any(tmp_path: Path) -> None:
    (tmp_path / "rewards.py").write_text(REWARDS)
    scaled = load_reward_spec(
        "task.rewards.s", {"_target_": "rewards.py:strict", "_partial_": True, "scale": 2}, tmp_path
    )
    assert scaled(["ab", "c"]) == [4.0, 2.0]
    spec = {"_target_": "rewards.py:loose", "_partial_": True, "bonus": 1}  # **kwargs: any name is its own
    assert load_reward_spec("task.rewards.l", spec, tmp_path)(["abc"]) == [3.0]
