"""The TRL script this folder converts (TRL 1.16; not run by grpo-cli, kept for the side-by-side in README.md).

TRL's GRPO quickstart (GRPOTrainer on trl-lib/DeepMath-103K with trl.rewards.accuracy_reward), with the
settings a user typically adds: a format reward, DAPO's soft overlong punishment, a reward of one's own that logs
a metric, and a GRPOConfig sized for a small model.
"""

from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer
from trl.rewards import accuracy_reward, get_soft_overlong_punishment, think_format_reward

dataset = load_dataset("trl-lib/DeepMath-103K", split="train")


def one_boxed_answer(completions, log_metric, **kwargs):
    """1 when the answer is boxed exactly once; logs the fraction that box anything."""
    counts = [c[0]["content"].count("\\boxed{") for c in completions]
    log_metric("boxed_frac", sum(n > 0 for n in counts) / len(counts))
    return [1.0 if n == 1 else 0.0 for n in counts]


args = GRPOConfig(
    output_dir="Qwen2.5-0.5B-GRPO",
    num_generations=4,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    max_completion_length=64,
    learning_rate=1e-5,
    beta=0.0,
    epsilon=0.2,
    epsilon_high=0.28,
    loss_type="dapo",
    scale_rewards="group",
    mask_truncated_completions=True,
    max_steps=30,
    reward_weights=[1.0, 0.5, 1.0, 0.5],
)
trainer = GRPOTrainer(
    model="Qwen/Qwen2.5-0.5B-Instruct",
    reward_funcs=[
        accuracy_reward,
        think_format_reward,
        get_soft_overlong_punishment(max_completion_len=64, soft_punish_cache=16),
        one_boxed_answer,
    ],
    args=args,
    train_dataset=dataset,
)
trainer.train()
