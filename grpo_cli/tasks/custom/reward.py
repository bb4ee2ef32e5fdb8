"""task=custom's reward: every named reward on a batch (the user's functions, in worker processes or here, and a
reward model), their failures handled per task.on_reward_error, combined with the weights and shaping terms."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpo_cli.errors import RewardFunctionError
from grpo_cli.tasks.base import GroundTruth
from grpo_cli.tasks.custom.data import is_conversation
from grpo_cli.tasks.custom.trl_convention import NamedReward, RewardLog, value_problem
from grpo_cli.tasks.multiturn import ENV_COMPONENT
from grpo_cli.tasks.rewards import SHAPING_COMPONENTS, Shaping, overlong_penalty, repetition_penalty
from grpo_cli.tasks.trainer_state import TrainerState
from grpo_cli.usercode.reward_workers import InProcessCall, PendingCall, RewardWorkers, describe_error
from grpo_cli.usercode.timelimit import RewardTimeout


def _row_text(truth: GroundTruth, limit: int = 160) -> str:
    columns = {k: v for k, v in truth.items() if k != "prompt"} if isinstance(truth, dict) else truth
    text = json.dumps(columns, default=repr, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class BatchScores:
    rewards: list[dict[str, float]]
    n_errors: int
    n_timeouts: int
    # log_extra's columns (one value per sample, None where none was logged) and log_metric's values.
    extra: dict[str, list[Any]] = field(default_factory=dict)
    metrics: dict[str, list[float]] = field(default_factory=dict)
    # The samples whose correctness cannot be derived (task.answer_from's reward gave None), with the reason.
    no_correctness: dict[int, str] = field(default_factory=dict)


logger = logging.getLogger(__name__)
_WARNED_NONE: set[str] = set()  # the functions warned about (once each per process)


def warn_if_no_reward(key: str, values: Sequence[float | None]) -> None:
    """One warning line, once per function, when it returned None for every completion of a batch: no sample got a
    reward from it (TRL's convention for rows it does not apply to, and TRL warns too; a function that forgot its
    `return` reads the same)."""
    if values and all(v is None for v in values) and key not in _WARNED_NONE:
        _WARNED_NONE.add(key)
        logger.warning(
            "reward %s returned None for all %d completions of a batch, so none got a reward from it (None: the "
            "function does not apply to that row): if it should score them, check that it returns a number",
            key,
            len(values),
        )


@dataclass
class CustomReward:
    """The reward of a custom task: every named reward on a batch, combined with the weights (None: no reward from
    that function for that sample). The scorer calls `score_batch` (rollout/rewards.py); calling it on one
    response (check_reward) scores a batch of one."""

    rewards: list[NamedReward]
    weights: dict[str, float]
    time_limit_s: float | None
    on_error: str
    completion_format: str = "auto"
    answer_from: str | None = None
    format_from: str | None = None
    shaping: Shaping = Shaping()
    model_factory: Callable[[str | None], Any] | None = None
    device: str | None = None
    workers: int = 0  # task.reward_workers (0: the functions run in this process)
    # task.reward_weights.env when the task has an environment (its summed step rewards are the component `env`,
    # given to score_batch as env_rewards); None: no environment.
    env_weight: float | None = None
    _model: Any = field(default=None, repr=False)
    _pool: RewardWorkers | None = field(default=None, repr=False)

    @property
    def uses_n_tokens(self) -> bool:
        return self.weights.get("overlong", 0.0) != 0.0

    @property
    def answer_source(self) -> str | None:
        """The reward whose value marks a sample correct (answer_reward, correctness): task.answer_from, else `env`
        when the environment's reward is the only weighted component, else None (the weighted total)."""
        if self.answer_from is not None:
            return self.answer_from
        if self.env_weight and not any(w for name, w in self.weights.items() if name not in SHAPING_COMPONENTS):
            return ENV_COMPONENT
        return None

    def for_run(self, max_tokens: int | None, device: str | None) -> CustomReward:
        """This reward with the run's generation limit (the overlong term) and the device of its reward model."""
        return dataclasses.replace(
            self, shaping=dataclasses.replace(self.shaping, max_tokens=max_tokens), device=device
        )

    def __call__(
        self,
        response: str,
        ground_truth: GroundTruth,
        n_tokens: int | None = None,
        completion_ids: list[int] | None = None,
        trainer_state: TrainerState | None = None,
    ) -> dict[str, float]:
        ids = None if completion_ids is None else [completion_ids]
        return self.score_batch([response], [ground_truth], [n_tokens], ids, trainer_state).rewards[0]

    def close(self) -> None:
        """Stop the worker processes (a later call starts new ones)."""
        if self._pool is not None:
            self._pool.close()

    # --- one batch --------------------------------------------------------------------------------------
    def score_batch(
        self,
        responses: Sequence[str],
        truths: Sequence[GroundTruth],
        n_tokens: Sequence[int | None] | None = None,
        completion_ids: Sequence[list[Any]] | None = None,
        trainer_state: TrainerState | None = None,
        completions: Sequence[Any] | None = None,
        prompts: Sequence[Any] | None = None,
        env_rewards: Sequence[float | None] | None = None,
        computed: dict[str, list[tuple[Any, str | None]]] | None = None,
    ) -> BatchScores:
        """Every reward on the batch. `completion_ids` are the sampled token ids of each completion (what TRL's
        completion_ids= holds; their lengths stand in for `n_tokens` when it is not given). `completions`, when
        given, is what the functions get as the completions instead of the responses (a multi-turn episode's
        messages after the prompt, rollout/multiturn.py: trl's completions= and per_sample's response; its
        completion_ids are then the model's sampled ids per turn, and `responses` its last turn's text, which the
        repetition term reads). `prompts`, when given, is trl's prompts= instead of the rows' prompts (an episode's
        opening messages, what its environment's reset gave the model). `env_rewards` (a task with an environment:
        each episode's summed step rewards, None where it gave none) are the component `env`, weighted by
        `env_weight`. `computed`: the rewards computed elsewhere, by name, (value, how it failed or None) per sample
        (those taking environments=, run beside the environment instances: episodes/adapters/trl.py); they are
        checked and weighted as the others.

        Each sample's answer_reward and correctness are `answer_source`'s value (the weighted total, env included,
        when it is None); a sample where that reward gave None has no correctness, said in `no_correctness`."""
        n = len(responses)
        ids = [list(c) for c in completion_ids] if completion_ids is not None else None
        if n_tokens is not None:
            lengths = list(n_tokens)
        else:
            lengths = [len(c) for c in ids] if ids is not None else [None] * n
        given = list(completions) if completions is not None else None
        batch = _Batch(list(responses), list(truths), ids, trainer_state or TrainerState(), RewardLog(n), given)
        batch.prompts = list(prompts) if prompts is not None else None
        counts = {"errors": 0, "timeouts": 0}
        values: dict[str, list[float | None]] = {}
        # Every function's calls first, then their results: with workers, the calls run in parallel.
        computed = computed or {}
        calls = {
            reward.name: self._start_batch(reward, batch) for reward in self.rewards if reward.name not in computed
        }
        for reward in self.rewards:
            failed = counts["errors"] + counts["timeouts"]
            if reward.name in computed:
                values[reward.name] = [
                    self._computed(reward, value, error, truth, counts)
                    for (value, error), truth in zip(computed[reward.name], batch.truths, strict=True)
                ]
                continue
            values[reward.name] = self._values(reward, batch, counts, calls[reward.name])
            if n > 1 and counts["errors"] + counts["timeouts"] == failed:
                warn_if_no_reward(reward.key, values[reward.name])
        if self.weights.get("overlong"):
            known = [length for length in lengths if length is not None]
            if self.shaping.max_tokens is None or len(known) != len(lengths):
                raise ValueError("the overlong reward term needs rollout.max_tokens and each completion's token count")
            window = self.shaping.overlong_window()
            values["overlong"] = [overlong_penalty(k, *window) for k in known]
        if self.weights.get("repetition"):
            values["repetition"] = [repetition_penalty(r, self.shaping.repetition_ngram) for r in responses]
        weights = dict(self.weights)
        if self.env_weight is not None and env_rewards is not None:
            values[ENV_COMPONENT] = list(env_rewards)
            weights[ENV_COMPONENT] = self.env_weight
        source, out, no_correctness = self.answer_source, [], {}
        for i in range(n):
            sample = {name: column[i] for name, column in values.items()}
            total = sum(weights.get(name, 0.0) * v for name, v in sample.items() if v is not None)
            answer = total if source is None else sample.get(source)
            fmt = total if self.format_from is None else (sample.get(self.format_from) or 0.0)
            result = {"reward": total, "format_reward": fmt, "answer_reward": answer or 0.0}
            if answer is None:  # never a silent 0: this sample's correctness is unknown
                no_correctness[i] = _no_answer(source)
            else:
                result["correctness"] = answer
            result.update({f"reward/{name}": v for name, v in sample.items() if v is not None})
            out.append(result)
        return BatchScores(
            out, counts["errors"], counts["timeouts"], batch.log.extra, batch.log.metrics, no_correctness
        )

    def completions_of(self, responses: list[str], prompts: list[Any]) -> list[Any]:
        """completions= of a TRL-convention call: TRL's rule under task.completion_format=auto (messages exactly
        when the prompts are conversations: GRPOTrainer checks the batch's first prompt), or the forced format."""
        as_messages = self.completion_format == "messages" or (
            self.completion_format == "auto" and bool(prompts) and is_conversation(prompts[0])
        )
        return [[{"role": "assistant", "content": r}] for r in responses] if as_messages else list(responses)

    def _start_batch(self, reward: NamedReward, batch: _Batch) -> Any:
        """The calls of one function on the batch, started: one per row (per_sample) or one (trl)."""
        rows = list(range(len(batch.responses)))
        if reward.convention == "model":
            return None
        if reward.convention == "per_sample":
            return [self._start(reward, self._per_sample_payload(reward, batch, i), batch, [i]) for i in rows]
        return self._start(reward, self._trl_payload(reward, batch, rows), batch, rows)

    def _values(self, reward: NamedReward, batch: _Batch, counts: dict[str, int], calls: Any) -> list[float | None]:
        if reward.convention == "model":
            return self._model_values(reward, batch.responses, batch.truths)
        if reward.convention == "per_sample":
            return [self._one(reward, batch, i, counts, c) for i, c in enumerate(calls)]
        return self._trl_batch(reward, batch, list(range(len(batch.responses))), counts, calls)

    def _fail(self, reward: NamedReward, what: str, truth: GroundTruth, where: str = "on row") -> None:
        """Stop: one line naming the function, the row and what it did."""
        raise RewardFunctionError(
            f"reward {reward.key} {what} {where} {_row_text(truth)}: fix it, or set task.on_reward_error=skip to "
            "give such samples no reward from it"
        )

    def _start(self, reward: NamedReward, payload: Any, batch: _Batch, rows: list[int]) -> _StartedCall:
        """One call of a user's function on the batch's samples `rows`, started: in a worker process, or
        (task.reward_workers=0) in this one when its result is read. Its log_extra and log_metric log into a
        RewardLog of its own: a worker's recorded calls are replayed into it when the result is read."""
        call_log = RewardLog(batch.log.n)
        args, kwargs = reward.call_arguments(payload, call_log.loggers(rows))
        if not self.workers or reward.loader is None:
            call: PendingCall | InProcessCall = InProcessCall(reward.fn, args, kwargs, self.time_limit_s)
        else:
            if self._pool is None:
                self._pool = RewardWorkers(self.workers, self.time_limit_s)
            callbacks = reward.logging_callbacks(args, kwargs)
            call = self._pool.submit(reward.loader, args, kwargs, callbacks, label=reward.key)
        return _StartedCall(call, call_log)

    def _result(self, reward: NamedReward, started: _StartedCall, batch: _Batch, rows: list[int]) -> Any:
        """A started call's return value; what it logged is kept only when it returns."""
        out = started.call.result()
        if started.log.problems:
            raise RewardFunctionError(
                f"reward {reward.key} {started.log.problems[0]} on row {_row_text(batch.truths[rows[0]])}: fix it"
            )
        batch.log.merge(started.log)
        return out

    def _per_sample_payload(self, reward: NamedReward, batch: _Batch, i: int) -> tuple[Any, dict[str, Any]]:
        ids = batch.completion_ids[i] if batch.completion_ids is not None else None
        response = batch.completions[i] if batch.completions is not None else batch.responses[i]
        return response, reward.per_sample_row(batch.truths[i], ids, batch.trainer_state)

    def _trl_payload(self, reward: NamedReward, batch: _Batch, rows: list[int]) -> dict[str, Any]:
        responses = [batch.responses[i] for i in rows]
        truths = [batch.truths[i] for i in rows]
        if batch.prompts is not None:  # an episode's opening messages
            prompts = [batch.prompts[i] for i in rows]
        else:
            prompts = [t.get("prompt") if isinstance(t, dict) else None for t in truths]
        ids = [batch.completion_ids[i] for i in rows] if batch.completion_ids is not None else None
        if batch.completions is not None:  # an episode's messages: always messages
            completions = [batch.completions[i] for i in rows]
        else:
            completions = self.completions_of(responses, prompts)
        return reward.trl_kwargs(prompts, completions, ids, batch.trainer_state, truths)

    def _one(
        self, reward: NamedReward, batch: _Batch, i: int, counts: dict[str, int], started: _StartedCall | None = None
    ) -> float | None:
        """per_sample: fn(response, row)."""
        truth = batch.truths[i]
        try:
            started = started or self._start(reward, self._per_sample_payload(reward, batch, i), batch, [i])
            value = self._result(reward, started, batch, [i])
        except RewardTimeout:
            if self.on_error == "stop":
                self._fail(reward, f"ran past task.reward_timeout_s={self.time_limit_s:g}s", truth)
            counts["timeouts"] += 1
            return None
        except RewardFunctionError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's code: stop with one line, or skip the sample
            if self.on_error == "stop":
                self._fail(reward, describe_error(e), truth)
            counts["errors"] += 1
            return None
        return self._checked(reward, value, truth, counts)

    def _computed(
        self, reward: NamedReward, value: Any, error: str | None, truth: GroundTruth, counts: dict[str, int]
    ) -> float | None:
        """A value computed elsewhere (score_batch's `computed`), or its failure under task.on_reward_error."""
        if error is None:
            return self._checked(reward, value, truth, counts)
        if self.on_error == "stop":
            self._fail(reward, error, truth)
        counts["errors"] += 1
        return None

    def _checked(self, reward: NamedReward, value: Any, truth: GroundTruth, counts: dict[str, int]) -> float | None:
        if hasattr(value, "item") and not isinstance(value, str):  # a 0-d tensor or numpy scalar
            # An array of several values keeps its type, and value_problem names it.
            with contextlib.suppress(TypeError, ValueError):
                value = value.item()
        problem = value_problem(value)
        if problem is None:
            return None if value is None else float(value)
        if self.on_error == "stop":
            self._fail(reward, problem, truth)
        counts["errors"] += 1
        return None

    def _trl_batch(
        self,
        reward: NamedReward,
        batch: _Batch,
        rows: list[int],
        counts: dict[str, int],
        started: _StartedCall | None = None,
    ) -> list[float | None]:
        truths = [batch.truths[i] for i in rows]
        n = len(rows)
        try:
            started = started or self._start(reward, self._trl_payload(reward, batch, rows), batch, rows)
            out = self._result(reward, started, batch, rows)
        except RewardTimeout:
            if self.on_error == "stop":
                self._fail(
                    reward, f"ran past task.reward_timeout_s={self.time_limit_s:g}s on a batch of {n}", truths[0]
                )
            counts["timeouts"] += n
            return [None] * n
        except RewardFunctionError:
            raise
        except Exception as e:  # noqa: BLE001 - find the row(s) it fails on, one sample at a time
            error = describe_error(e)
            if n == 1:
                if self.on_error == "stop":
                    self._fail(reward, error, truths[0])
                counts["errors"] += 1
                return [None]
            # Alone, each row either scores (skip keeps it) or fails (stop names that row; skip drops it).
            singles = [self._trl_batch(reward, batch, [i], counts)[0] for i in rows]
            if self.on_error == "stop":  # every row scored alone: the batch itself is what fails
                self._fail(reward, error, truths[0], where=f"on a batch of {n} rows, though each alone scores; first")
            return singles
        if hasattr(out, "tolist") and not isinstance(out, list):  # a tensor or numpy array
            out = out.tolist()
        if not isinstance(out, list | tuple) or len(out) != n:
            got = f"{len(out)} values" if isinstance(out, list | tuple) else f"{type(out).__name__} {out!r:.60}"
            if self.on_error == "stop":
                self._fail(reward, f"returned {got} for {n} completions (one float or None each)", truths[0])
            counts["errors"] += n
            return [None] * n
        return [self._checked(reward, v, t, counts) for v, t in zip(out, truths, strict=True)]

    def _model_values(self, reward: NamedReward, responses: list[str], truths: list[GroundTruth]) -> list[float | None]:
        if self._model is None:
            self._model = reward.fn(self.device)  # the scorer, loaded on first use on this run's device
        return [float(v) for v in self._model(responses, truths)]


def _no_answer(source: str | None) -> str:
    """Why a sample has no correctness: the reward that decides it (`CustomReward.answer_source`) gave none."""
    if source == ENV_COMPONENT:
        return "the environment gave no reward in the episode (task.answer_from=env: its summed step rewards)"
    return f"task.answer_from={source} gave no value (None) for the sample"


@dataclass
class _StartedCall:
    """One call of a user's function, started, and the log its log_extra and log_metric write to."""

    call: PendingCall | InProcessCall
    log: RewardLog


@dataclass
class _Batch:
    """One scored batch: what every reward reads, and what they log."""

    responses: list[str]
    truths: list[GroundTruth]
    completion_ids: list[list[Any]] | None
    trainer_state: TrainerState
    log: RewardLog
    completions: list[Any] | None = None  # given instead of the responses (episodes' messages)
    prompts: list[Any] | None = None  # given instead of the rows' prompts (episodes' opening messages)
