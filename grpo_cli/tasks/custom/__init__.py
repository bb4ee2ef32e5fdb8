"""task=custom: a task made of config and the user's own code, with no change to the package (docs/custom-tasks.md).

    data      task.train_path / task.eval_path (.jsonl, .csv, .parquet, a dataset directory), task.dataset with
              task.split / task.eval_split (a `datasets` hub id or directory), or task.generator
              (`file.py:function` called with (n, seed)); any column names (task.rename_columns renames them)
    prompt    conversational data (TRL's format: a `prompt` column holding [{"role", "content"}, ...]) is the
              conversation itself, rendered with the model's chat template; text data goes through
              task.template over the row's columns ("Rewrite this review to be negative: {review}"),
              task.system_prompt, and the prompt styles of every task (task.prompt: chat, question_only, r1_zero)
    rewards   task.rewards.<name>=path/to/file.py:function or package.module:function, or a node
              {_target_: factory, <arguments>} (user_code.load_reward_spec), and/or a sequence-classification
              model (task.reward_model.*), summed with task.reward_weights (a name without a weight counts 1)
              and each logged as train/reward/<name> and eval/reward/<name>

How a reward function is called (task.reward_convention):
    trl         TRL 1.16's convention, the default, so a function written for TRL's GRPOTrainer runs unchanged:
                fn(prompts=, completions=, completion_ids=, trainer_state=, log_extra=, log_metric=,
                <each other column>=) -> one float or None per sample, once per batch. prompts are the
                conversations of conversational data and the prompt texts otherwise; completions follow TRL's
                rule (task.completion_format=auto): [{"role": "assistant", "content": text}] each when the data
                is conversational, the text otherwise. completion_ids are the sampled token ids. A function
                without **kwargs gets only the arguments it names.
    per_sample  fn(response, row) -> float or None, once per sample; row holds every column, "prompt" and the
                same extras (completion_ids: this sample's, trainer_state, log_extra(column, value),
                log_metric(name, value)).
None means "no reward from this function for this sample": the sample's reward is the weighted sum of the others
(TRL's nansum), and the function's logged mean leaves it out.

A reward that raises, returns the wrong number of values, NaN, a string, or runs past task.reward_timeout_s is
one line naming the function, the row and what it returned. The functions run in task.reward_workers worker
processes (usercode/reward_workers.py), so one blocked in C is killed at the limit and an exit or a crash is that
function's error; 0 calls them in this process, unprotected. task.on_reward_error decides what happens then:
stop (the default: the run stops with its checkpoints kept, and a save of the last update) or skip (that function
gives that sample no reward, counted in train/reward_errors and train/reward_timeouts).

The TaskSpec of a custom task is built from its config (`TaskSpec.from_config`), so the loop, evaluation,
pass@k / maj@n and check_reward treat it like a built-in task. No torch here (the reward model's module imports
it when one is configured).

Where each part lives (this package):

    schema.py          CustomTaskConfig and RewardModelConfig (task.* keys), the values their choices allow
    data.py            a split's rows read, renamed and checked; text rows rendered through task.template
    trl_convention.py  TRL's calling convention: a function loaded and bound, its arguments, RewardLog
    reward.py          CustomReward: every reward on a batch, errors per task.on_reward_error, the weighted sum
    cases.py           job=check_reward's cases (task.cases_path)
    files.py           the user's paths made absolute, and the code's hashes for run_info.json
    task.py            build_custom_task (TaskSpec.from_config) and CUSTOM_TASK
"""

from __future__ import annotations

from grpo_cli.errors import RewardFunctionError
from grpo_cli.tasks.custom.cases import read_cases
from grpo_cli.tasks.custom.files import absolutize_paths, code_hashes
from grpo_cli.tasks.custom.reward import BatchScores, CustomReward
from grpo_cli.tasks.custom.schema import CustomTaskConfig, RewardModelConfig
from grpo_cli.tasks.custom.task import CUSTOM_TASK, build_custom_task
from grpo_cli.tasks.trainer_state import TrainerState

__all__ = [
    "CUSTOM_TASK",
    "BatchScores",
    "CustomReward",
    "CustomTaskConfig",
    "RewardFunctionError",
    "RewardModelConfig",
    "TrainerState",
    "absolutize_paths",
    "build_custom_task",
    "code_hashes",
    "read_cases",
]
