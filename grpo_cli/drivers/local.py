"""sync=on_policy and sync=multi_epoch: generation and learning take turns on one model in this process."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_cli.batch.rollout_data import RolloutData
from grpo_cli.distributed import parallel
from grpo_cli.drivers.dynamic_sampling import SignalBatch, extra_round_batch_number
from grpo_cli.drivers.executor import finish_step_metrics, step_metrics
from grpo_cli.drivers.prompts import PromptSampler
from grpo_cli.drivers.versions import lag
from grpo_cli.learner.learner import Learner
from grpo_cli.rollout.batch_statistics import kept_rewards, trained_batch_advantages
from grpo_cli.rollout.worker import RolloutWorker
from grpo_cli.tasks import Example

if TYPE_CHECKING:
    from grpo_cli.config.schemas import GRPOConfig


class InProcessExecutor:
    """The learner and a rollout worker that samples from the learner's own model (no weights to copy)."""

    def __init__(self, cfg: GRPOConfig, output_dir: Path, sampler: PromptSampler) -> None:
        self.cfg = cfg
        self.sampler = sampler
        self.learner = Learner(cfg, output_dir)
        # The worker samples from the learner's weights: the policy itself, or its full copy under FSDP2.
        self.worker = RolloutWorker(cfg, self.learner.inference_model, self.learner.tokenizer)
        try:
            self.worker.check_prompts_fit(sampler.examples)  # before the first step, not at the prompt's turn
        except BaseException:
            self.worker.close()
            raise
        self.prompts_per_step = self.learner.shape.prompts_per_rollout_batch
        self.world = parallel.world()
        self.load_s = self.learner.load_s
        self.device_text = self.learner.describe()
        self.closed = False
        self.last_transcripts: list[dict[str, Any]] = []

    @property
    def learner_version(self) -> int:
        return self.learner.version

    def resume(self) -> tuple[int, dict[str, Any], list[str]]:
        return self.learner.resume()

    def start(self, start_step: int) -> dict[str, float]:
        if start_step == 0:
            return {}
        # The engine was built from the initial weights and the checkpoint was loaded since: without this push a
        # resumed rollout=vllm run would sample its first batch from the step-0 policy (the probe checks it).
        return self.worker.sync_weights(version=start_step)

    def save_checkpoint(self, step: int) -> Path:
        return self.learner.save_checkpoint(step, {"sampler": self.sampler.state()})

    def step(self, step: int) -> tuple[dict[str, float], int]:
        """Produce a scored rollout batch with the current weights, learn from it, let the engine catch up.

        With several ranks every rank draws the same prompts (the same seeded sampler) and takes its equal share
        of whole groups; the metrics are then combined over all ranks (parallel.reduce_metrics)."""
        step_start = time.perf_counter()
        data = self.produce_share(batch_number=step)
        if self.cfg.train.dynamic_sampling:
            data = self.fill_with_signal(data, step)  # its batch's advantages are the trained batch's already
        else:
            # Each rank scored its share: batch_std's scale is the whole batch's, every rank's rows.
            norm = self.cfg.normalization
            data.advantages = trained_batch_advantages(
                data, self.learner.shape.group_size, norm.advantage, norm.advantage_eps
            )
        # The learner sat idle for all of it: waiting == the producer's time, overlap 0.
        waiting_s = time.perf_counter() - step_start
        self.last_transcripts = data.transcripts or []
        learned, nonfinite_streak = self.learner.learn(data, step)
        sync = self.worker.sync_weights(version=step)
        timing = {
            "time/step_s": time.perf_counter() - step_start,
            "time/waiting_s": waiting_s,
            "time/sync_s": sync.pop("time/sync_s", 0.0),
        }
        # Generation and training take turns on the same weights: every batch is trained on at lag 0.
        versions = {"sync/policy_version": data.policy_version, "sync/lag": lag(step - 1, data.policy_version)}
        metrics = step_metrics(data.metrics, learned, timing, {**sync, **versions})
        return finish_step_metrics(metrics, kept_rewards(data)), nonfinite_streak

    def produce_share(self, batch_number: int) -> RolloutData:
        """The next prompts of the step, this rank's share of them, generated and scored."""
        epoch = self.sampler.epoch
        examples = self.sampler.next_batch(self.prompts_per_step)
        share = len(examples) // self.world.size
        first = self.world.rank * share
        return self.worker.produce(
            examples[first : first + share], batch_number=batch_number, first_prompt_index=first, epoch=epoch
        )

    def fill_with_signal(self, data: RolloutData, step: int) -> RolloutData:
        """train.dynamic_sampling: drop groups with all-equal rewards and sample more prompts until the batch is full
        (drivers/dynamic_sampling.py). Every rank takes as many rounds as the rank that needs the most (they draw
        the same prompts), then trains on as many groups as the rank that has the fewest (equal shares keep the
        ranks' collectives in step)."""
        cfg = self.cfg
        signal = SignalBatch(
            self.learner.shape.group_size,
            self.prompts_per_step // self.world.size,
            cfg.normalization.advantage,
            cfg.normalization.advantage_eps,
        )
        signal.add(data)
        extra_round = 0
        while extra_round < cfg.train.dynamic_sampling_max_extra_rounds and parallel.any_rank(not signal.full):
            extra_round += 1
            signal.add(self.produce_share(batch_number=extra_round_batch_number(step, extra_round)))
        return signal.batch(parallel.min_over_ranks(min(signal.kept_groups, signal.target_groups)))

    def evaluate(
        self, examples: list[Example], on_generated: Callable[[int], None] | None
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        metrics, records, _version = self.worker.evaluate(examples, on_generated=on_generated, epoch=self.sampler.epoch)
        return metrics, records

    def close(self) -> None:
        if not self.closed:
            self.worker.close()
            self.closed = True
