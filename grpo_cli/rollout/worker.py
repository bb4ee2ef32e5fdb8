"""Phase 1 of a GRPO step: produce one scored rollout batch.

    prompts -> generate G completions each -> score -> group-relative advantages (-> behaviour log-probs)

In-process (on_policy, multi_epoch) the worker samples from the learner's own model; as a Ray actor
(one_behind, replay_buffer) it loads its own copy of the policy and receives new weights through `load_weights`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch

from grpo_cli.batch.forward import ScoringSettings, per_completion_log_probs
from grpo_cli.batch.rollout_data import RolloutData
from grpo_cli.batch.settings import scoring_settings
from grpo_cli.config import BatchShape
from grpo_cli.config.schemas import GRPOConfig
from grpo_cli.core import compute_advantages
from grpo_cli.core.advantages import fraction_of_zero_std_groups
from grpo_cli.engines.base import RolloutEngine, SamplingSettings
from grpo_cli.engines.build import build_rollout_engine
from grpo_cli.errors import UserFacingError
from grpo_cli.models import build_policy
from grpo_cli.models.runtime import autocast_factory, limit_threads, resolve_device, seed_everything, timed
from grpo_cli.rollout.evaluation import evaluate, voting_for
from grpo_cli.rollout.rewards import reward_metrics, with_logged_metrics
from grpo_cli.rollout.runs import RolloutRun, Samples
from grpo_cli.rollout.task_run import run_for
from grpo_cli.tasks import Example, make_reward_fn, stop_strings, task_for
from grpo_cli.tasks.trainer_state import TrainerState

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def sampling_settings(cfg: GRPOConfig, n: int, seed: int, for_eval: bool = False) -> SamplingSettings:
    """How to sample, from the rollout.* sampling keys: `rollout.temperature` for training batches,
    `rollout.eval_temperature` (greedy by default) for evaluation. Both engines read only this."""
    r = cfg.rollout
    return SamplingSettings(
        n=n,
        temperature=r.eval_temperature if for_eval else r.temperature,
        top_p=r.top_p,
        min_tokens=r.min_tokens,
        max_tokens=r.max_tokens,
        stop=stop_strings(r.stop, cfg.task.prompt),
        seed=seed,
    )


def rows_of(samples: Samples, start: int, stop: int) -> Samples:
    """Rows [start, stop) of a batch of samples (every per-sample field cut alike)."""
    cut = {name: value[start:stop] if isinstance(value, list) else value for name, value in vars(samples).items()}
    return Samples(**cut)


def rollout_seed(seed: int, batch_number: int) -> int:
    """The sampling seed of the batch_number-th rollout batch of a run with this seed."""
    return seed * 1_000_003 + batch_number


class RolloutWorker:
    """Samples, scores and computes advantages; evaluates the weights it holds."""

    def __init__(
        self,
        cfg: GRPOConfig,
        model: torch.nn.Module | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        threads: int = 0,
        run: RolloutRun | None = None,
    ) -> None:
        """`run`: how the task's episodes are sampled and scored (None: the task's own, `run_for`)."""
        limit_threads(threads)
        self.cfg = cfg
        self.shape = BatchShape.from_config(cfg)
        self.device = resolve_device(cfg.model.device)
        if model is None:
            seed_everything(cfg.seed)
            model, tokenizer = build_policy(cfg.model, self.device)
        if tokenizer is None:
            raise ValueError("RolloutWorker: a given model needs its tokenizer")
        self.model, self.tokenizer = model, tokenizer
        if cfg.task.prompt == "chat" and not getattr(tokenizer, "chat_template", None):
            raise UserFacingError(
                f"model.name_or_path={cfg.model.name_or_path} has no chat template, and task.prompt=chat renders "
                "every prompt (and every multi-turn episode) with it: use task.prompt=question_only with a base "
                "model, or a chat model (an -Instruct checkpoint)"
            )
        # A reward model (task=custom) runs on the policy's device.
        self.reward_fn = make_reward_fn(cfg.task, cfg.rollout.max_tokens, device=str(self.device))
        self.autocast = autocast_factory(self.device, cfg.model.mixed_precision)
        self.engine: RolloutEngine = build_rollout_engine(cfg, self.model, self.tokenizer)
        self.version = 0  # the policy version the engine samples from (its copy's; in-process: the learner's)
        self.load_s = 0.0  # weight loads since the last batch: reported with the next batch
        # The task's episodes: one-turn completions, or a multi-turn task's turns with its tools / environment.
        self.run = run if run is not None else run_for(cfg, self.tokenizer, self.reward_fn)

    @cached_property
    def scoring(self) -> ScoringSettings:
        """How the behaviour log-probs (produce(with_old_log_probs=True), as a Ray actor) are scored: exactly as the
        learner scores its own, by the same function (this copy is never sharded). Built at the first use: an
        in-process worker never scores."""
        return scoring_settings(self.cfg, self.model, self.tokenizer.pad_token_id, sharded=False)

    def describe(self) -> str:
        return f"{self.device} ({next(self.model.parameters()).dtype})"

    def trainer_state(self, epoch: float) -> TrainerState:
        """What a reward function gets as trainer_state=: the updates behind the weights this worker samples from
        (TRL's global_step while it scores), train.steps, and `epoch` (passes over the training prompts drawn)."""
        return TrainerState(global_step=self.version, max_steps=self.cfg.train.steps, epoch=epoch)

    def produce(
        self,
        examples: list[Example],
        batch_number: int,
        with_old_log_probs: bool = False,
        first_prompt_index: int = 0,
        epoch: float = 0.0,
    ) -> RolloutData:
        """Generate, score and compute advantages for one rollout batch; its metrics hold rollout statistics and
        the time of each phase. batch_number fixes the sampling seed (the step number for one batch per step);
        first_prompt_index places `examples` in the step's whole prompt list (a data-parallel rank's share);
        epoch (passes over the training prompts before these) is what reward functions read in trainer_state."""
        cfg, shape = self.cfg, self.shape
        timings: dict[str, float] = {}
        busy_start = time.perf_counter()
        with timed(timings, "time/generation_s"), self.autocast():
            sampling = replace(
                sampling_settings(cfg, shape.group_size, seed=rollout_seed(cfg.seed, batch_number)),
                first_prompt_index=first_prompt_index,
            )
            samples = self.run.sample(self.engine, sampling, examples)
        return self.scored(samples, timings, busy_start, with_old_log_probs, epoch)

    def scored(
        self,
        samples: Samples,
        timings: dict[str, float],
        busy_start: float,
        with_old_log_probs: bool = False,
        epoch: float = 0.0,
    ) -> RolloutData:
        """Sampled groups (whole groups of group_size, prompt-major) scored, with advantages and the batch's
        metrics: the second half of `produce`, also what the asynchronous generator does with each finished group.
        `timings` holds the sampling's time/generation_s; `busy_start` is when the work on them began."""
        cfg, shape = self.cfg, self.shape
        with timed(timings, "time/scoring_s"):
            scores = self.run.score(samples, self.trainer_state(epoch))
            raw_rewards = torch.tensor([r["reward"] for r in scores.rewards], dtype=torch.float32)
            # An episode skipped under task.on_reward_error=skip has no reward: out of its group's statistics.
            # batch_std's scale here is these rows'; where they are a piece of the trained batch (a rank's share,
            # an async group) the executor takes it again over the whole (rollout/batch_statistics.py).
            scored = torch.ones(len(raw_rewards), dtype=torch.bool)
            scored[scores.skipped] = False
            advantages = compute_advantages(
                raw_rewards,
                shape.group_size,
                cfg.normalization.advantage,
                cfg.normalization.advantage_eps,
                keep=scored if scores.skipped else None,
            )
        data = RolloutData(samples.prompt_ids, samples.completion_ids, raw_rewards, advantages)
        if scores.skipped:
            data.scored = scored
        data.policy_version = self.version
        if samples.token_versions is not None:  # sync=async: each token's own (rollout/async_generation.py)
            data.token_versions = samples.token_versions
            sampled = [v for row in samples.token_versions for v in row if v >= 0]
            data.policy_version = min(sampled, default=self.version)
        if samples.sampler_log_probs is not None:
            data.sampler_log_probs = [torch.tensor(lp, dtype=torch.float32) for lp in samples.sampler_log_probs]
        if cfg.train.mask_truncated:
            # DAPO's overlong filtering: a cut-off completion's reward says little about its tokens, so it stays
            # in its group's advantage statistics but leaves the loss (an episode: its last turn cut mid-generation;
            # one that ran out of turns ended, and its environment scored it).
            data.loss_mask = torch.tensor([0.0 if cut else 1.0 for cut in samples.truncated])
        if scores.skipped:  # no reward: out of the loss too
            data.loss_mask = (data.loss_mask if data.loss_mask is not None else torch.ones(len(raw_rewards))) * scored
        if samples.token_masks is not None:
            # An episode's tool/environment tokens are scored as context but are holes in the loss.
            data.token_masks = [torch.tensor(m, dtype=torch.float32) for m in samples.token_masks]

        # The behaviour policy's log-probs, by the exact weights that sampled (the learner may have moved on).
        with timed(timings, "time/old_log_probs_s"):
            if with_old_log_probs:
                with self.autocast():
                    data.old_log_probs = per_completion_log_probs(self.model, data, self.device, self.scoring)

        # Response lengths and generated tokens count the model's tokens (an episode's tool/environment ones aside).
        lengths = samples.model_tokens
        kept_rewards = raw_rewards[scored]
        data.metrics = {
            **reward_metrics(scores, "train"),
            "train/reward_std": kept_rewards.std().item() if len(kept_rewards) > 1 else 0.0,
            "train/frac_zero_std_groups": fraction_of_zero_std_groups(
                raw_rewards, shape.group_size, scored if scores.skipped else None
            ),
            "train/response_length_mean": sum(lengths) / len(lengths),
            "train/response_length_max": max(lengths),
            "train/truncated_frac": sum(samples.truncated) / len(lengths),
            # Samples cut or ended because the model's context was full (the engine's context_length).
            "train/context_limited": sum(samples.context_limited) / len(lengths),
            # Completions left out of the loss (train.mask_truncated, skipped episodes), as a fraction of the batch.
            "train/masked_frac": (
                float((data.loss_mask == 0).sum()) / len(lengths) if data.loss_mask is not None else 0.0
            ),
            **timings,
            "time/weight_load_s": self.load_s,
            "time/produce_s": time.perf_counter() - busy_start + self.load_s,
            # Generated tokens: throughput/* are computed from it once the step's rounds and ranks are summed
            # (drivers/executor.py add_throughput).
            "n_tokens": float(sum(lengths)),
        }
        # A reward function's log_metric values become train/<name>; its log_extra columns are shown with the
        # evaluation samples only (a training batch has no samples table).
        data.metrics = with_logged_metrics(data.metrics, scores, "train")
        # The run's own statistics (an episode's train/turns, tool_calls, env_tokens, ...; none for one turn) and
        # its transcripts for the run's logs.
        data.metrics.update(self.run.metrics(samples, "train"))
        data.transcripts = self.run.transcripts(samples, scores.rewards)
        self.load_s = 0.0
        return data

    def scored_groups(
        self, samples: Samples, timings: dict[str, float], busy_start: float, with_old_log_probs: bool, epoch: float
    ) -> list[RolloutData]:
        """`scored` one group at a time: each group's rewards, advantages and metrics its own, as the asynchronous
        generator ships groups (a step may train groups of several batches, and combines its groups' metrics as
        one batch's: drivers/dynamic_sampling.combine_rollout_metrics). `timings` (the sampling's) go with the
        first group."""
        g, n = self.shape.group_size, len(samples.completion_ids)
        return [
            self.scored(
                rows_of(samples, k, k + g), dict(timings) if k == 0 else {}, busy_start, with_old_log_probs, epoch
            )
            for k in range(0, n, g)
        ]

    def check_prompts_fit(self, examples: list[Example], what: str = "training example") -> None:
        """Stop the run (one line naming the example, `what` it is and where it was read: Example.source) when a
        prompt leaves no room in the model's context for one sampled token: the engine would sample nothing after
        it (an eval example would be scored on an empty completion, counted wrong without a word). A multi-turn
        task's openings are checked as its episodes open (episodes.turns)."""
        context = self.engine.context_length
        found = None if context is None else self.run.first_prompt_past_context(examples, context)
        if found is None:
            return
        index, length = found
        prompt = examples[index].prompt
        text = prompt if isinstance(prompt, str) else " ".join(str(m.get("content", "")) for m in prompt)
        shown = " ".join(text.split())
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        where = "rollout.max_model_len" if self.cfg.rollout.engine == "vllm" else "the model's max_position_embeddings"
        source = f" of {examples[index].source}" if examples[index].source else ""
        raise UserFacingError(
            f"{what} {index}{source} ({shown!r}) is a {length}-token prompt and the model's context is {context} "
            f"tokens ({where}): drop or shorten the long examples of the data, or use a model with a longer context"
        )

    def sync_weights(self, version: int) -> dict[str, float]:
        """In-process: the engine picks up the learner's updated weights (nothing to copy for rollout=hf)."""
        self.version = version
        return self.engine.sync_weights(version=version)

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> float:
        """As a Ray actor: load the learner's trainable weights into this copy, then into the engine.
        Returns the seconds it took (also reported with the next batch)."""
        t0 = time.perf_counter()
        self.copy_weights(tensors)
        self.engine.sync_weights(version=version)
        self.version = version
        seconds = time.perf_counter() - t0
        self.load_s += seconds
        return seconds

    def copy_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy the learner's trainable weights into this policy copy, in place (the engine not told: load_weights,
        or the asynchronous generator's stream between two decode steps)."""
        own = dict(self.model.named_parameters())
        unknown = sorted(set(tensors) - set(own))
        if unknown:
            raise RuntimeError(f"the generator's policy copy has no parameters named {unknown[:3]}")
        with torch.no_grad():
            for name, value in tensors.items():
                own[name].copy_(value)

    def evaluate(
        self, examples: list[Example], on_generated: Callable[[int], None] | None = None, epoch: float = 0.0
    ) -> tuple[dict[str, float], list[dict[str, Any]], int]:  # records: JSON rows of any value
        """Held-out evaluation of the weights this worker holds: (metrics, records, policy version); `epoch` as
        in `produce`."""
        # Every job that evaluates comes here (training's evaluations, job=baseline_eval, job=eval; in-process, as a
        # Ray actor, on the async stream): an example past the context is refused, never scored as an empty answer.
        self.check_prompts_fit(examples, "eval example")
        sampling = sampling_settings(self.cfg, self.cfg.eval.n_samples, seed=self.cfg.seed, for_eval=True)
        with self.autocast():
            metrics, records = evaluate(
                self.run,
                self.engine,
                examples,
                sampling,
                on_generated=on_generated,
                voting=voting_for(task_for(self.cfg.task), self.cfg.task.prompt),
                pass_ks=self.cfg.eval.pass_k,
                trainer_state=self.trainer_state(epoch),
            )
        return metrics, records, self.version

    def close(self) -> None:
        self.engine.close()
        self.run.close()  # the tools' and the environment's worker processes
        close_reward = getattr(self.reward_fn, "close", None)  # task=custom: its reward worker processes
        if close_reward is not None:
            close_reward()
