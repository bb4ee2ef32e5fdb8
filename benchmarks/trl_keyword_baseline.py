"""TRL's GRPOTrainer at the setting of `grpo-run job=benchmark`, for a same-machine comparison.

Same model (the embedded SmolLM2-135M-Instruct, from grpo-cli's cache), same keyword-inclusion prompts and
reward (grpo-cli's own task code), 4 prompts x 4 completions per step, <= 48 new tokens, temperature 1.0,
lr 1e-5, no KL, fp32 on the CPU, one optimizer step per rollout batch. TRL's other defaults are left as they
are (notably gradient checkpointing on). Prints seconds per step (median, min) and writes them as JSON.

    pip install -r benchmarks/requirements.txt        # TRL 1.16, beside grpo-cli
    python benchmarks/trl_keyword_baseline.py --steps 6 --out trl.json
    python benchmarks/compare_trl.py                   # this and grpo-cli back to back, with the ratio
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from datasets import Dataset
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from grpo_cli.config import register_configs
from grpo_cli.models import embedded_model_dir
from grpo_cli.tasks import load_examples, make_reward_fn


class StepTimer(TrainerCallback):
    def __init__(self) -> None:
        self.started = 0.0
        self.seconds: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self.started)
        print(f"TRL step {state.global_step}: {self.seconds[-1]:.2f}s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default="trl_baseline.json")
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="TRL's bf16=True (autocast over fp32 weights), as model.mixed_precision=bf16",
    )
    args = parser.parse_args()

    register_configs()
    with initialize_config_module(config_module="grpo_cli.conf", version_base="1.3"):
        cfg = OmegaConf.to_object(
            compose(config_name="config", overrides=["job=benchmark", "output_dir=/tmp/trl-keyword-baseline"])
        )
    reward_fn = make_reward_fn(cfg.task)
    examples = load_examples(cfg.task, "train")
    dataset = Dataset.from_list([{"prompt": e.prompt, "ground_truth": e.ground_truth} for e in examples])

    def keyword_reward(completions, ground_truth, **_kwargs):
        return [reward_fn(c[0]["content"], t)["reward"] for c, t in zip(completions, ground_truth, strict=True)]

    model_dir = str(embedded_model_dir())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = GRPOConfig(
        output_dir="/tmp/trl-keyword-baseline",
        max_steps=args.warmup + args.steps,
        per_device_train_batch_size=16,  # completions per step = 4 prompts x 4 generations
        num_generations=4,
        gradient_accumulation_steps=1,
        max_completion_length=48,
        temperature=1.0,
        learning_rate=1e-5,
        beta=0.0,
        bf16=args.bf16,
        fp16=False,
        use_cpu=True,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=keyword_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    measured = timer.seconds[args.warmup :]
    result = {
        "step_s_median": statistics.median(measured),
        "step_s_min": min(measured),
        "steps": measured,
        "gradient_checkpointing": config.gradient_checkpointing,
        "bf16": args.bf16,
    }
    print(json.dumps(result))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
