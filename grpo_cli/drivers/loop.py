"""The training loop, written once for every sync strategy (docs/architecture.md, "Sync strategies"):

    evaluate at step 0
    for each step: executor.step (sample prompts -> generate -> score -> advantages -> update -> sync weights)
                   log it; evaluate when due; at the safe point after the step: checkpoint when due, stop on a
                   signal or on divergence

Where generation and learning run is the executor's business (drivers/executor.py): in this process, or as
Ray actors. The loop owns what a run owns everywhere: the prompt sampler, the metrics, the evaluation schedule,
checkpoints, signals and resuming.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from rich.console import Console

from grpo_cli.config import DISAGGREGATED, BatchShape
from grpo_cli.config.batch_shape import ratio_loss_types
from grpo_cli.distributed import parallel
from grpo_cli.drivers.executor import Executor
from grpo_cli.drivers.prompts import PromptSampler
from grpo_cli.errors import (
    EXIT_DIVERGED,
    EXIT_USER_ERROR,
    EXIT_WEIGHT_SYNC_FAILED,
    EnvironmentFailed,
    RewardFunctionError,
    RunStopped,
    UserFacingError,
    exit_code_for_signal,
)
from grpo_cli.learner.accounting import empty_step_note, update_was_empty
from grpo_cli.models.runtime import timed
from grpo_cli.rollout import WeightSyncError
from grpo_cli.rollout.evaluation import prefixed, truncation_warning
from grpo_cli.tasks import load_eval_sets, load_examples
from grpo_cli.tracking import FanOutSink, baseline_eval_reward, build_metrics_sink, read_metrics, truncate_metrics
from grpo_cli.tracking.console import (
    RunClock,
    StepProgress,
    evaluation_steps,
    format_eval_line,
    format_step_line,
    generation_progress,
    long_run_hint,
    run_size_line,
    step_time_table,
)
from grpo_cli.usercode import reward_workers

if TYPE_CHECKING:
    from grpo_cli.config.schemas import GRPOConfig
    from grpo_cli.tracking.sinks import MetricsSink

# What signal.signal returns and takes: a function, SIG_DFL / SIG_IGN, or None (a handler not set from Python).
SignalHandler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


def build_executor(cfg: GRPOConfig, output_dir: Path, sampler: PromptSampler) -> Executor:
    """The executor for cfg.sync.strategy: in-process, or generator and learner as Ray actors."""
    if cfg.sync.strategy == "async":
        from grpo_cli.drivers.async_executor import AsyncExecutor  # Ray is an optional extra

        return AsyncExecutor(cfg, output_dir, sampler)
    if cfg.sync.strategy in DISAGGREGATED:
        from grpo_cli.drivers.ray_executor import RayExecutor  # Ray is an optional extra

        return RayExecutor(cfg, output_dir, sampler)
    from grpo_cli.drivers.local import InProcessExecutor

    return InProcessExecutor(cfg, output_dir, sampler)


class TrainingLoop:
    """One run: builds the executor, resumes if asked, runs the steps, evaluates, checkpoints, logs, stops
    cleanly. `run()` returns the summary (the last step's metrics, the last evaluation, the step-0 reward)."""

    def __init__(self, cfg: GRPOConfig, output_dir: Path, console: Console) -> None:
        self.cfg = cfg
        self.output_dir = output_dir
        self.console = console
        self.train_examples = load_examples(cfg.task, "train")
        self.eval_examples = load_examples(cfg.task, "eval")[: cfg.train.eval_examples or None]
        # task.eval_sets: evaluated after the task's own set, each logged under eval/<name>/...
        self.eval_sets = {
            name: examples[: cfg.train.eval_examples or None] for name, examples in load_eval_sets(cfg.task).items()
        }
        self.sampler = PromptSampler(self.train_examples, seed=cfg.seed)
        self.nonfinite_streak = 0  # as the learner counts it, after the last step
        self.empty_streak = 0  # steps in a row whose update had nothing to train (train.max_empty_steps)
        self.stop_signal: str | None = None
        self.warned_truncation = False
        self.last_saved_step = -1  # the newest checkpoint this process wrote
        self.world = parallel.world()
        self.executor = build_executor(cfg, output_dir, self.sampler)
        self.sink_closed = False
        try:
            # A resumed run restores weights, optimizer, RNG and data position, and forgets the metrics logged
            # after its checkpoint (they are logged again, identically) before the metrics sink opens the file.
            self.start_step = self._resume() if cfg.resume else 0
            synced = self.executor.start(self.start_step)
            if self.start_step and "sync/logprob_max_diff" in synced:
                console.print(
                    f"rollout engine now samples from step {self.start_step}'s weights "
                    f"(probe: max |log-prob difference| {synced['sync/logprob_max_diff']:.2e})",
                    highlight=False,
                )
            # metrics.jsonl always, plus W&B with logger=wandb; closed in run()'s `finally`. Rank 0 logs for all
            # (the metrics are already combined over ranks).
            self.metrics_sink: MetricsSink = (
                build_metrics_sink(cfg, output_dir, console) if self.world.is_main else FanOutSink([])
            )
        except BaseException:
            self.executor.close()
            raise

    def close(self) -> None:
        """Close the metrics sink (once) and the executor; safe after any error, and more than once."""
        if not self.sink_closed:
            self.metrics_sink.close()
            self.sink_closed = True
        self.executor.close()

    def _resume(self) -> int:
        """Load the newest usable checkpoint of this run directory; returns its step."""
        step, state, messages = self.executor.resume()
        for message in messages:
            self.console.print(message, highlight=False)
        self.sampler.load_state(state["sampler"])
        if self.world.is_main:
            repaired = truncate_metrics(self.output_dir / "metrics.jsonl", step)
            if repaired is not None:
                self.console.print(repaired, highlight=False, markup=False)
        parallel.barrier()
        return step

    def _final_eval_logged(self) -> dict[str, float] | None:
        """The eval/* metrics metrics.jsonl holds for the last step (train.steps), None when it holds none."""
        rows = [r for r in read_metrics(self.output_dir / "metrics.jsonl") if r.get("step") == self.cfg.train.steps]
        found = {k: v for row in rows for k, v in row.items() if k.startswith("eval/")}
        return found or None

    def _checkpoint_due(self, step: int) -> bool:
        every = self.cfg.train.checkpoint_every
        return step == self.cfg.train.steps or (every > 0 and step % every == 0)

    # --- the loop ------------------------------------------------------------------------------------------
    def run(self) -> dict[str, float]:
        cfg = self.cfg
        self.console.print(
            f"policy {cfg.model.name} loaded in {self.executor.load_s:.1f}s on {self.executor.device_text}; "
            f"{len(self.train_examples)} train / {len(self.eval_examples)} eval examples; run dir {self.output_dir}",
            highlight=False,
        )
        eval_at = evaluation_steps(cfg.train.steps, cfg.train.eval_every, self.start_step)
        eval_rows = len(self.eval_examples) + sum(map(len, self.eval_sets.values()))
        shape = BatchShape.from_config(cfg)
        # A resumed run that had already trained its steps: no size line of work it will not do, its final
        # evaluation read back (run again only where it is missing), and the same `done` line as any run.
        finished = self.start_step >= cfg.train.steps
        final_eval = self._final_eval_logged() if finished else None
        if finished:
            eval_at = [] if final_eval else [cfg.train.steps]
            evaluated = "its final evaluation is in metrics.jsonl" if final_eval else "running its final evaluation"
            self.console.print(
                f"resumed at step {self.start_step}, the run's last (train.steps={cfg.train.steps}): nothing left to "
                f"train; {evaluated} (to train on: grpo-run resume={self.output_dir} train.steps=<more>)",
                highlight=False,
                markup=False,
            )
        else:  # the cost is said before it is paid: what the run generates, then (after a step) the time left
            self.console.print(
                run_size_line(
                    steps=cfg.train.steps - self.start_step,
                    prompts_per_step=shape.prompts_per_rollout_batch,
                    completions_per_step=shape.completions_per_rollout_batch,
                    max_new_tokens=shape.max_new_tokens,
                    eval_rows=eval_rows,
                    samples_per_eval_row=cfg.eval.n_samples,
                    eval_at=eval_at,
                ),
                highlight=False,
                markup=False,
            )
        clock = RunClock(cfg.train.steps, eval_at)
        cost_said = False  # the long-run line: said once, as soon as the time left is known
        zero_loss_said = False
        summary: dict[str, float] = {}
        previous_handlers = self._install_signal_handlers()
        step = self.start_step
        try:
            if self.start_step == 0:
                summary.update(self._timed_eval(clock, step=0))
            if final_eval is not None:
                summary.update(final_eval)
            elif finished:
                summary.update(self._timed_eval(clock, step))
            summary["baseline/eval_reward"] = baseline_eval_reward(self.output_dir / "metrics.jsonl")
            with StepProgress(cfg.train.steps, self.console, enabled=cfg.verbose) as progress:
                progress.advance(self.start_step)
                for step in range(self.start_step + 1, cfg.train.steps + 1):
                    started = time.monotonic()
                    metrics = self._step(step)
                    clock.step_done(time.monotonic() - started)
                    self.metrics_sink.log(metrics, step)
                    if self.executor.last_transcripts:  # a multi-turn task: episodes/step_<step>.jsonl, W&B table
                        self.metrics_sink.log_episodes(self.executor.last_transcripts, step)
                    progress.print(f"{format_step_line(step, metrics)}  {clock.eta_text(step)}".rstrip())
                    if note := empty_step_note(step, metrics):  # a step with nothing to train: said, each time
                        progress.print(note)
                    self.empty_streak = self.empty_streak + 1 if update_was_empty(metrics) else 0
                    if not zero_loss_said and (note := zero_loss_note(cfg, shape, metrics)):
                        zero_loss_said = True
                        progress.print(note)
                    if not cost_said and clock.remaining_s(step) is not None:
                        cost_said = True
                        hint = long_run_hint(
                            clock,
                            step,
                            eval_rows=eval_rows,
                            max_new_tokens=shape.max_new_tokens,
                            on_cpu=self.executor.device_text.startswith("cpu"),
                            gpu_experiment=gpu_experiment_for(cfg.task.name),
                            task=cfg.task.name,
                        )
                        if hint is not None:
                            progress.print(hint)
                    if step in eval_at:  # the schedule the size line and the eta count
                        summary.update(self._timed_eval(clock, step, progress))
                    progress.advance()
                    summary.update(metrics)
                    self._stop_if_asked(step)
        except (RewardFunctionError, EnvironmentFailed) as error:
            # task.on_reward_error=stop: a reward function or an environment failed on a row; the same stop
            raise self._stopped_by_reward(error) from None
        except reward_workers.RewardsAbandoned as error:
            # A reward without a time limit still ran STOP_GRACE_S after the signal: the step is dropped.
            raise RunStopped(
                f"stopped by {self.stop_signal} during step {step}: reward {error}, so the step is abandoned; "
                f"the checkpoints in {self.output_dir / 'checkpoints'} are kept; continue with: "
                f"grpo-run resume={self.output_dir}",
                # A stop was asked for: RewardsAbandoned comes only after request_stop set stop_signal.
                exit_code=exit_code_for_signal(self.stop_signal or "SIGTERM"),
            ) from None
        finally:
            reward_workers.clear_stop_notice()
            _restore_signal_handlers(previous_handlers)
            self.close()
        if cfg.verbose:
            rows = [r for r in read_metrics(self.output_dir / "metrics.jsonl") if "time/step_s" in r]
            title = f"time per step, mean over {len(rows)} steps ({cfg.sync.strategy})"
            self.console.print(step_time_table(rows, title=title))
        return summary

    def _timed_eval(self, clock: RunClock, step: int, progress: StepProgress | None = None) -> dict[str, float]:
        started = time.monotonic()
        metrics = self.run_eval(step, progress)
        clock.eval_done(time.monotonic() - started)
        return metrics

    def _step(self, step: int) -> dict[str, float]:
        try:
            metrics, self.nonfinite_streak = self.executor.step(step)
        except WeightSyncError as error:
            # The learner's last update succeeded: keep it, then stop rather than sample from stale weights.
            version = self.executor.learner_version
            path = self.executor.save_checkpoint(version)
            raise RunStopped(
                f"{error}; step {version}'s update is saved in {path}; after fixing it continue with: "
                f"grpo-run resume={self.output_dir}",
                exit_code=EXIT_WEIGHT_SYNC_FAILED,
            ) from None
        return metrics

    def _stopped_by_reward(self, error: RewardFunctionError | EnvironmentFailed) -> Exception:
        """task.on_reward_error=stop: the user's reward or environment failed. The last update is kept (saved now
        unless a checkpoint of it exists; with several ranks the others are gone, so the completed checkpoints
        stand)."""
        version = self.executor.learner_version
        if version == 0 or version == self.last_saved_step or self.world.distributed:
            kept = (
                f"; the checkpoints in {self.output_dir / 'checkpoints'} are kept; after fixing it continue with: "
                f"grpo-run resume={self.output_dir}"
                if self.last_saved_step > 0
                else ""
            )
            return UserFacingError(f"{error}{kept}")
        path = self.executor.save_checkpoint(version)
        return RunStopped(
            f"{error}; step {version}'s update is saved in {path}; after fixing it continue with: "
            f"grpo-run resume={self.output_dir}",
            exit_code=EXIT_USER_ERROR,
        )

    # --- safe points: checkpoints, signals, non-finite numbers ---------------------------------------------
    def _stop_if_asked(self, step: int) -> None:
        """After a whole step (the safe point): checkpoint when due, and stop on a signal or on divergence."""
        limit = self.cfg.train.max_nonfinite_steps
        # A signal may reach the ranks at different moments: they agree here, at the same step, or the next
        # collective would wait forever for a rank that left.
        if parallel.any_rank(self.stop_signal is not None) and self.stop_signal is None:
            self.stop_signal = "SIGTERM"
        empty_limit = self.cfg.train.max_empty_steps
        stopping = self.stop_signal is not None or self.nonfinite_streak >= limit or self.empty_streak >= empty_limit
        if stopping or self._checkpoint_due(step):
            path = self.executor.save_checkpoint(step)
            self.last_saved_step = step
        if self.stop_signal is not None:
            raise RunStopped(
                f"stopped by {self.stop_signal} after step {step}; checkpoint {path}; "
                f"continue with: grpo-run resume={self.output_dir}",
                exit_code=exit_code_for_signal(self.stop_signal),
            )
        if self.empty_streak >= empty_limit:
            raise RunStopped(
                f"nothing to train in {empty_limit} consecutive steps (last: step {step}; train.max_empty_steps): "
                "every episode was skipped (task.on_reward_error=skip) or left out of the loss, so the weights have "
                "not changed since; fix what fails (the agent, environment or reward; or raise rollout.max_tokens "
                f"where train.mask_truncated leaves every completion out), then continue with: grpo-run "
                f"resume={self.output_dir}",
                exit_code=EXIT_USER_ERROR,
            )
        if self.nonfinite_streak >= limit:
            raise RunStopped(
                f"loss or gradients were not finite in {limit} consecutive steps (last: step {step}); those "
                f"updates were skipped and the weights in {path} are the last good ones: lower optim.lr or check "
                "the reward function, then continue with: grpo-run resume=" + str(self.output_dir),
                exit_code=EXIT_DIVERGED,
            )

    def _install_signal_handlers(self) -> dict[signal.Signals, SignalHandler]:
        """SIGINT/SIGTERM finish the current step, checkpoint and exit; a second SIGINT interrupts at once."""
        if threading.current_thread() is not threading.main_thread():
            return {}

        def request_stop(signum: int, _frame: FrameType | None) -> None:
            if self.stop_signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.stop_signal = signal.Signals(signum).name
            reward_workers.notice_stop()  # a reward call without a time limit now gets a short grace
            self.console.print(
                f"{self.stop_signal} received: finishing this step, then writing a checkpoint "
                "(press Ctrl-C again to stop at once, without one)",
                highlight=False,
            )

        return {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}

    # --- evaluation ---------------------------------------------------------------------------------------
    def run_eval(self, step: int, progress: StepProgress | None = None) -> dict[str, float]:
        """Rank 0 evaluates (with every rank's weights the same, one evaluation is the evaluation); the other
        ranks wait for it at the barrier."""
        if not self.world.is_main:
            parallel.barrier()
            return {}
        try:
            return self._evaluate(step, progress)
        finally:
            parallel.barrier()

    def _evaluate(self, step: int, progress: StepProgress | None) -> dict[str, float]:
        timings: dict[str, float] = {}
        with timed(timings, "time/eval_s"):
            description = f"eval @ {step}"
            total = len(self.eval_examples) + sum(map(len, self.eval_sets.values()))
            with generation_progress(self.console, total, description, within=progress) as advance:
                metrics, records = self.executor.evaluate(self.eval_examples, on_generated=advance)
                for name, examples in self.eval_sets.items():
                    set_metrics, set_records = self.executor.evaluate(examples, on_generated=advance)
                    metrics.update(prefixed(set_metrics, name))
                    records += [{"eval_set": name, **record} for record in set_records]
        metrics.update(timings)
        self.metrics_sink.log_samples(records, step)  # eval/step_<step>.jsonl, and a W&B table
        self.metrics_sink.log(metrics, step)
        line = format_eval_line(step, metrics)
        if progress is not None:
            progress.print(line)
        else:
            self.console.print(line, highlight=False)
        warning = truncation_warning(metrics, self.cfg.rollout.max_tokens, records, self.cfg.task)
        if warning is not None and not self.warned_truncation:
            self.warned_truncation = True  # once a run: the eval line shows the fraction every time
            if progress is not None and progress.enabled:
                progress.print(f"warning: {warning}")
            else:
                self.console.print(f"warning: {warning}", highlight=False, markup=False)
        return metrics


def zero_loss_note(cfg: GRPOConfig, shape: BatchShape, metrics: dict[str, float]) -> str | None:
    """The console's one explanation of `loss +0.0000` from a ratio loss on-policy (else None): the value is 0 while
    the gradient is not, which reads as a broken run to someone who has not met it."""
    loss, grad_norm = metrics.get("train/loss"), metrics.get("train/grad_norm", 0.0)
    if cfg.loss.type not in ratio_loss_types() or shape.off_policy or loss is None or abs(loss) >= 5e-5:
        return None
    if not grad_norm > 0:  # no gradient either: every group was flat (no signal), which `flat` already shows
        return None
    return (
        f"note: loss {loss:+.4f} is expected with loss={cfg.loss.type} on-policy: each batch gets one update from the "
        "policy that sampled it, so the importance ratio is exactly 1 and the loss value is minus the mean "
        "advantage, 0 since a group's advantages sum to zero; its gradient is not 0 (gnorm): read reward and "
        "gnorm, not loss (docs/tracking.md#metrics)"
    )


def gpu_experiment_for(task: str) -> str | None:
    """The experiment preset (conf/experiment/) that sizes `task` for a GPU, if one does."""
    from importlib.resources import files

    for preset in sorted(files("grpo_cli.conf").joinpath("experiment").iterdir(), key=lambda p: p.name):
        if preset.name.endswith(".yaml") and re.search(
            rf"override /task: {re.escape(task)}\s*$", preset.read_text(encoding="utf-8"), re.MULTILINE
        ):
            return preset.name.removesuffix(".yaml")
    return None


def _restore_signal_handlers(previous: dict[signal.Signals, SignalHandler]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
