"""`from grpo_cli.tasks import X` keeps working for every public name the package offered before issue 59 split
its __init__ by job (registry.py, data.py, reward_fn.py, validation.py): users' code imports them from there."""

from __future__ import annotations

import importlib

import pytest

# Every public, non-stdlib name of grpo_cli.tasks at 5bc2545, the commit before the split (vars() of the module).
NAMES_BEFORE_THE_SPLIT = """
ADDITION_TASK CUSTOM_TASK CustomReward CustomTaskConfig DEFAULT_WEIGHTS ENV_COMPONENT Example GSM8K_TASK
GSM8K_TOOLS_TASK GUESS_NUMBER_TASK HubTaskConfig JSON_TASK KEYWORD_TASK LIPOGRAM_TASK MATH_TASK MEDCALC_TASK
NumericCloseOptions OPTIONAL_REWARD_KEYS PROMPT_STYLES PYTHON_MATH_TASK Prompt REGEX_SUM_TASK RESERVED_EVAL_SET_NAMES
REWARD_KEYS RewardComponent RewardFn RewardTimeout RewardWeightsConfig RowError RowParser SanityCase Shaping
TASKS TASK_SCHEMAS TaskConfig TaskDataError TaskSpec absolutize_multiturn_paths absolutize_paths
absolutize_task_paths addition_reward_fn build_reward_fn call_with_time_limit check_episodes check_weights
component_weights env_weight eval_set_config format_prompt get_task is_multiturn iter_jsonl_objects
json_reward_fn keyword_inclusion_reward_fn lipogram_reward_fn load_eval_sets load_examples load_jsonl_examples
make_reward_fn medcalc_reward_fn parse_question_row prompt_stop_strings question_only_reward_fn r1_zero_reward_fn
regex_sum_reward_fn register_tasks reward_weights stop_strings task_for validate_task_config with_source
""".split()


@pytest.mark.parametrize("name", NAMES_BEFORE_THE_SPLIT)
def test_a_name_importable_from_grpo_cli_tasks_before_the_split_still_is(name: str) -> None:
    assert hasattr(importlib.import_module("grpo_cli.tasks"), name)
