"""`job=check_reward`: score a task's hand-made good and bad responses before spending compute on a model.

Every task ships sanity cases (a ground truth, a response, the reward a careful reader expects, and why). This
job scores them with the reward the run would use for `task.prompt` and prints one table row per case; any
disagreement is an error (exit code 2). No model and no data set is loaded; task=custom's cases are tokenized with
the model's tokenizer (the completion_ids its reward functions get), unless each case gives its own.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from grpo_cli.engines.base import RolloutBatch, SamplingSettings
from grpo_cli.episodes.turns import ChatTemplate, Episode, Generate, SampledTurn, run_episodes
from grpo_cli.errors import UserFacingError
from grpo_cli.rollout.multiturn import EpisodeSetup, episode_setup, score_episodes
from grpo_cli.rollout.rewards import Scores
from grpo_cli.tasks import SanityCase, is_multiturn, make_reward_fn, reward_weights, task_for
from grpo_cli.tasks.base import Example
from grpo_cli.tasks.multiturn import agent_value
from grpo_cli.tasks.rewards import (
    DEFAULT_WEIGHTS,
    SHAPING_CASE_BUFFER,
    SHAPING_CASE_MAX_TOKENS,
    SHAPING_CASE_NGRAM,
    SHAPING_CASES,
    SHAPING_COMPONENTS,
    Shaping,
    TimeLimitedReward,
    shaping_case_value,
    uses_n_tokens,
)
from grpo_cli.tasks.trainer_state import TrainerState

if TYPE_CHECKING:
    from grpo_cli.config.schemas import GRPOConfig


def _show(value: object) -> str:
    # Escaped: "[1,2)" in a ground truth or a response is math, not rich markup.
    return escape(value if isinstance(value, str) else json.dumps(value))


def _columns(truth: object) -> object:
    """task=custom's ground truth without the prompt it carries (the table shows the row's own columns)."""
    return {k: v for k, v in truth.items() if k != "prompt"} if isinstance(truth, dict) else truth


def score_case(
    reward_fn: Callable[..., dict[str, float]],
    case: SanityCase,
    completion_ids: list[int] | None = None,
    trainer_state: TrainerState | None = None,
) -> tuple[float | None, str, dict[str, float]]:
    """(reward, note, {component: value}): the reward of the case's response, or None and the error a crash raised.
    A reward with the overlong term scores the case as a short completion (0 tokens: no overlong penalty).
    task=custom's reward also gets the case's `completion_ids` and a `trainer_state`."""
    try:
        kwargs: dict[str, Any] = {"n_tokens": 0} if uses_n_tokens(reward_fn) else {}
        if hasattr(reward_fn, "score_batch"):
            kwargs.update(completion_ids=completion_ids, trainer_state=trainer_state)
        result = reward_fn(case.response, case.ground_truth, **kwargs)
    except Exception as e:  # noqa: BLE001 - a crashing reward is exactly what this job is here to show
        return None, f"{type(e).__name__}: {e}", {}
    parts = {key.removeprefix("reward/"): float(v) for key, v in result.items() if key.startswith("reward/")}
    return float(result["reward"]), "", parts


def case_completion_ids(cfg: GRPOConfig, cases: tuple[SanityCase, ...]) -> tuple[list[list[int] | None], str]:
    """Each case's completion_ids (what task=custom's reward functions get as completion_ids=) and a line saying
    where they came from: the case's own, else its response tokenized by the model's tokenizer with the EOS token
    appended (a finished completion's sampled ids end with it). A tokenizer that does not load leaves them None
    (a reward that reads them then fails on its row), and the line says why."""
    given = [list(case.completion_ids) if case.completion_ids is not None else None for case in cases]
    if all(ids is not None for ids in given):
        return given, "completion_ids: each case's own"
    from grpo_cli.models import load_tokenizer  # transformers, only for a task=custom job

    name = cfg.model.name_or_path
    try:
        tokenizer = load_tokenizer(name)
    except UserFacingError as e:
        return given, f"completion_ids: none for cases without their own (the tokenizer of {name} did not load: {e})"
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    tokenized = [tokenizer(case.response, add_special_tokens=False)["input_ids"] + eos for case in cases]
    return (
        [own if own is not None else ids for own, ids in zip(given, tokenized, strict=True)],
        f"completion_ids: each response tokenized by {name}'s tokenizer, then its EOS token (a case may give its "
        'own "completion_ids")',
    )


def agrees(case: SanityCase, got: float | None, parts: dict[str, float]) -> bool:
    """Whether a case's reward is what it expects: the weighted total, or each reward it names (None: that reward
    gave no value)."""
    if got is None:
        return False
    if case.expected_each is not None:
        return all(_same(parts.get(name), value) for name, value in case.expected_each.items())
    return case.expected_reward is not None and abs(got - case.expected_reward) < 1e-9


def _same(got: float | None, expected: float | None) -> bool:
    if got is None or expected is None:
        return got is None and expected is None
    return abs(got - expected) < 1e-9


def _expected_text(case: SanityCase) -> str:
    if case.expected_each is not None:
        return " ".join(f"{name}={'none' if v is None else f'{v:g}'}" for name, v in case.expected_each.items())
    return f"{case.expected_reward:g}"


def check_case_columns(reward_fn: object, cases: Sequence[SanityCase], cases_path: str) -> None:
    """task=custom: each reward's signature against every case's columns, as training checks it against the data's
    (tasks/custom/data.py build_examples): a required parameter no column fills is one line naming it, not a crash
    in every row of the table."""
    for reward in getattr(reward_fn, "rewards", ()):
        for line, case in enumerate(cases, start=1):
            if isinstance(case.ground_truth, dict):
                reward.check_columns(case.ground_truth, f"task.cases_path={cases_path} (line {line})")


def run(cfg: GRPOConfig, output_dir: Path, console: Console) -> dict[str, Any]:
    """Print the sanity-case table of `cfg.task`; raise UserFacingError when any case disagrees."""
    task = task_for(cfg.task)
    cases = task.cases_for(cfg.task.prompt)
    if not cases and task.from_config is not None:
        raise UserFacingError(
            f'task={task.name} checks your own cases: give task.cases_path=cases.jsonl, one {{"response": ..., '
            '"expected": ..., <the columns your template reads>} per line'
        )
    if not cases:
        raise UserFacingError(f"task={task.name} ships no sanity cases for prompt={cfg.task.prompt}")
    if is_multiturn(cfg.task):
        return run_episode_cases(cfg, cases, console)
    # The cases pin down the task's own rule (the correctness component); a custom weighting is shown beside it.
    # task=custom's cases are of its whole weighted reward, each named reward shown beside it.
    if task.from_config is not None:
        own_reward, weighted = make_reward_fn(cfg.task, cfg.rollout.max_tokens), None
        check_case_columns(own_reward, cases, str(cfg.task.cases_path))
    else:
        own_reward = TimeLimitedReward(task.reward_for(cfg.task.prompt), cfg.task.reward_timeout_s or None)
        weighted = (
            make_reward_fn(cfg.task, cfg.rollout.max_tokens) if reward_weights(cfg.task) != DEFAULT_WEIGHTS else None
        )

    table = Table(title=f"reward sanity cases: task={task.name} prompt={cfg.task.prompt}", title_justify="left")
    for name in ("#", "ground truth", "response", "expected", "got", "", "why"):
        table.add_column(name, overflow="fold")
    if weighted is not None:
        table.add_column("weighted total", justify="right")
    show_parts = task.from_config is not None
    if show_parts:
        table.add_column("each reward", overflow="fold")
        ids, ids_line = case_completion_ids(cfg, cases)
        state = TrainerState(global_step=0, max_steps=cfg.train.steps, epoch=0.0)
    disagreements = []
    for index, case in enumerate(cases, start=1):
        if show_parts:
            got, error, parts = score_case(own_reward, case, ids[index - 1], state)
        else:
            got, error, parts = score_case(own_reward, case)
        ok = agrees(case, got, parts)
        if not ok:
            disagreements.append(index)
        row = [
            str(index),
            _show(_columns(case.ground_truth) if show_parts else case.ground_truth),
            escape(repr(case.response)),
            _expected_text(case),
            "error" if got is None else f"{got:g}",
            "[green]ok[/]" if ok else "[bold red]DIFFERS[/]",
            escape(case.why + (f" ({error})" if error else "")),
        ]
        if weighted is not None:
            total, _, _ = score_case(weighted, case)
            row.append("error" if total is None else f"{total:.3g}")
        if show_parts:
            row.append(escape(" ".join(f"{name}={value:.3g}" for name, value in parts.items())))
        table.add_row(*row)
    console.print(table)
    if show_parts:
        console.print(
            f'{ids_line}; "expected": a number is the weighted total, {{"<reward>": value}} each named reward',
            highlight=False,
            markup=False,
        )
    shaping_disagree = check_shaping_terms(cfg, console)
    if disagreements:
        raise UserFacingError(
            f"{len(disagreements)} of {len(cases)} reward sanity cases of task={task.name} disagree "
            f"(rows {', '.join(map(str, disagreements))}): the reward does not do what the task's cases expect"
        )
    if shaping_disagree:
        raise UserFacingError(
            f"{len(shaping_disagree)} shaping-term sanity cases disagree (rows {', '.join(map(str, shaping_disagree))})"
        )
    console.print(f"all {len(cases)} cases agree with task={task.name}'s reward rule", highlight=False)
    return {"n": len(cases), "n_disagree": 0}


def check_shaping_terms(cfg: GRPOConfig, console: Console) -> list[int]:
    """The sanity cases of the shaping terms the run weights (task.reward_weights.overlong / repetition), in a
    second table, then what this run's settings make of them. Returns the rows that disagree."""
    weighted = [term for term in SHAPING_COMPONENTS if reward_weights(cfg.task).get(term)]
    if not weighted:
        return []
    table = Table(
        title=f"shaping-term sanity cases (max_tokens {SHAPING_CASE_MAX_TOKENS}, overlong buffer "
        f"{SHAPING_CASE_BUFFER}, {SHAPING_CASE_NGRAM}-grams)",
        title_justify="left",
    )
    for name in ("#", "term", "response", "expected", "got", "", "why"):
        table.add_column(name, overflow="fold")
    disagreements = []
    cases = [case for case in SHAPING_CASES if case.term in weighted]
    for index, case in enumerate(cases, start=1):
        got = shaping_case_value(case)
        ok = abs(got - case.expected) < 1e-9
        if not ok:
            disagreements.append(index)
        row = [str(index), case.term, escape(repr(case.response)), f"{case.expected:.3g}", f"{got:.3g}"]
        table.add_row(*row, "[green]ok[/]" if ok else "[bold red]DIFFERS[/]", escape(case.why))
    console.print(table)
    settings = Shaping(cfg.rollout.max_tokens, cfg.task.overlong_buffer, cfg.task.repetition_ngram)
    if "overlong" in weighted:
        start = cfg.rollout.max_tokens - settings.buffer()
        console.print(
            f"this run: overlong is 0 up to {start} tokens, then falls to -1 at rollout.max_tokens="
            f"{cfg.rollout.max_tokens} (x weight {reward_weights(cfg.task)['overlong']:g})",
            highlight=False,
        )
    if "repetition" in weighted:
        console.print(
            f"this run: repetition counts {settings.repetition_ngram}-grams "
            f"(x weight {reward_weights(cfg.task)['repetition']:g})",
            highlight=False,
        )
    return disagreements


# ------------------------------------------------------------------------------------------ multi-turn episodes


def scripted_ids(template: ChatTemplate, turns: Sequence[str]) -> list[list[int]]:
    """Each given model turn as the model would have sampled it: its text tokenized, then the template's
    end-of-turn token (a turn the model ended itself)."""
    stops = sorted(template.stop_token_ids)
    im_end = template.tokenizer.convert_tokens_to_ids("<|im_end|>")
    stop = [im_end] if im_end in template.stop_token_ids else stops[:1]
    return [template.encode(turn) + stop for turn in turns]


def scripted_turns(template: ChatTemplate, turns: Sequence[str]) -> Generate:
    """A `generate` for one episode that "samples" the given model turns in order (`scripted_ids`)."""
    queue = scripted_ids(template, turns)
    stop = bool(template.stop_token_ids)

    def generate(prompts: Sequence[Sequence[int]], max_tokens: int) -> list[SampledTurn]:
        del max_tokens  # the scripted turns are given whole (the case's limits leave room for the longest)
        if len(prompts) != 1 or not queue:
            raise ValueError("a scripted episode is run one at a time, at most one turn per given turn")
        return [SampledTurn(queue.pop(0), stopped=bool(stop))]

    return generate


def run_case_episode(setup: EpisodeSetup, case: SanityCase, max_turns: int) -> Episode:
    """The case's episode: its prompt (or the environment's opening), its turns as the model's, and the task's
    tools or environment run for real between them, up to the task's max_turns (and no more turns than given)."""
    turns = case.turns or (case.response,)
    example = Example(case.prompt if case.prompt is not None else [{"role": "user", "content": ""}], case.ground_truth)
    longest = max(len(setup.template.encode(turn)) for turn in turns) + 1
    limits = dataclasses.replace(setup.limits, max_turns=min(max_turns, len(turns)), max_tokens_per_turn=longest)
    scripted = dataclasses.replace(setup, limits=limits)
    episodes = run_episodes(
        scripted.open([example]), setup.template, scripted_turns(setup.template, turns), setup.on_turn, limits
    )
    setup.finish(episodes)
    return episodes[0]


class ScriptedEngine:
    """A `RolloutEngine` that answers an agent's model calls with the given turns in order (`scripted_ids`), one per
    call: what job=check_reward plays for a task.agent task through the real endpoint."""

    context_length = None

    def __init__(self, template: ChatTemplate, turns: Sequence[str]) -> None:
        self.queue = scripted_ids(template, turns)

    def generate(self, prompt_ids: list[list[int]], settings: SamplingSettings) -> RolloutBatch:
        if len(prompt_ids) * settings.n > len(self.queue):
            raise ValueError("the agent made more model calls than the case has turns")
        sampled = [self.queue.pop(0) for _ in range(len(prompt_ids) * settings.n)]
        prompts = [list(p) for p in prompt_ids for _ in range(settings.n)]
        # A scripted token is "sampled" with probability 1: log-prob 0 (an agent's client may require log-probs,
        # as verifiers' trainer client does on /inference/v1/generate).
        certain = [[0.0] * len(ids) for ids in sampled]
        return RolloutBatch(prompts, sampled, [""] * len(sampled), [False] * len(sampled), sampler_log_probs=certain)

    def sync_weights(self, version: int | None = None) -> dict[str, float]:
        return {"time/sync_s": 0.0}

    def close(self) -> None:
        return None


def run_agent_case(cfg: GRPOConfig, tokenizer: Any, reward_fn: Any, case: SanityCase) -> tuple[Episode, Scores]:
    """The case's episode as the task's agent plays it through the endpoint, its model calls answered with the
    case's turns in order (a call past the last one is refused: task.max_turns is the turns' count), scored as
    training scores it (the agent's reward as the env component beside task.rewards)."""
    from grpo_cli.rollout.agent_run import AgentRun, agent_settings

    turns = case.turns or (case.response,)
    settings = agent_settings(cfg)
    run = AgentRun(settings, tokenizer, reward_fn)
    longest = max(len(run.template.encode(turn)) for turn in turns) + 1
    limits = dataclasses.replace(settings.limits, max_turns=len(turns), max_tokens_per_turn=longest)
    run.settings = dataclasses.replace(settings, limits=limits)
    example = Example(case.prompt if case.prompt is not None else [{"role": "user", "content": ""}], case.ground_truth)
    try:
        samples = run.sample(ScriptedEngine(run.template, turns), SamplingSettings(n=1), [example])
        state = TrainerState(global_step=0, max_steps=cfg.train.steps, epoch=0.0)
        return samples.episodes[0], run.score(samples, state)
    finally:
        run.close()


def transcript(episode: Episode, width: int = 160) -> list[str]:
    """One line per message after the opening ones: "role: text" (folded onto one line, cut at `width`)."""
    lines = []
    for message in episode.completion_messages:
        text = " ".join(str(message.get("content", "")).split())
        for call in message.get("tool_calls") or ():  # TRL 1.16's shape: the calls are not in the content
            function = call.get("function", {})
            text += f" [tool_call {function.get('name')}({json.dumps(function.get('arguments'))})]"
        text = text.strip()
        text = text if len(text) <= width else text[: width - 3] + "..."
        lines.append(f"{message.get('role')}: {text}")
    return lines


def episode_tokenizer(name: str, console: Console) -> tuple[Any, str]:
    """(the tokenizer the episodes are built with, its model's name): the model's, or where it does not load (a
    GPU preset's model not downloaded on this machine) the embedded default model's, said in one line: the tools,
    the environment and the rewards run the same; the chat template and the token ids are the default model's."""
    from grpo_cli.models import EMBEDDED_SMOLLM2, load_tokenizer  # transformers

    try:
        return load_tokenizer(name), name
    except UserFacingError as e:
        console.print(
            f"the tokenizer of {name} did not load ({e}): the episodes are built with {EMBEDDED_SMOLLM2}'s chat "
            "template and tokenizer instead",
            highlight=False,
            markup=False,
        )
        return load_tokenizer(EMBEDDED_SMOLLM2), EMBEDDED_SMOLLM2


def run_episode_cases(cfg: GRPOConfig, cases: tuple[SanityCase, ...], console: Console) -> dict[str, Any]:
    """job=check_reward of a multi-turn task: each case's turns played as the model's, the tools or the environment
    run for real between them, the finished episode scored with the run's reward (score_episodes: the task's own
    reward on the last turn, task=custom's functions on the whole episode, and the env component); a table row and
    the transcript per case. A built-in task's case expects its own rule ("correctness"), the weighted total shown
    beside it; task=custom's expects the weighted total (or each named reward, `env` included)."""
    task = task_for(cfg.task)
    custom = task.from_config is not None
    tokenizer, model_name = episode_tokenizer(cfg.model.name_or_path, console)
    agent = agent_value(cfg.task) is not None
    setup = None if agent else episode_setup(cfg.task, tokenizer, cfg.rollout.max_tokens, model_name)
    reward_fn = make_reward_fn(cfg.task, cfg.rollout.max_tokens)
    state = TrainerState(global_step=0, max_steps=cfg.train.steps, epoch=0.0)
    table = Table(title=f"multi-turn reward sanity cases: task={task.name}", title_justify="left")
    for name in ("#", "ground truth", "turns", "expected", "got", "", "why", "weighted total", "each reward"):
        table.add_column(name, overflow="fold")
    disagreements, transcripts = [], []
    try:
        for index, case in enumerate(cases, start=1):
            try:
                if setup is None:  # task.agent: its agent plays the case's turns through the endpoint
                    episode, scores = run_agent_case(cfg, tokenizer, reward_fn, case)
                else:
                    episode = run_case_episode(setup, case, cfg.task.max_turns)
                    scores = score_episodes(reward_fn, [episode], setup.env_weight, state)
                result, error = scores.rewards[0], ""
                if scores.skipped:  # task.on_reward_error=skip: the environment failed on it, no reward
                    error = f"{'the agent' if agent else 'the environment'} {episode.error}"
                elif scores.n_errors or scores.n_timeouts:
                    error = "the reward raised or timed out"
            except UserFacingError as e:
                episode, result, error = None, {}, str(e)
            parts = {k.removeprefix("reward/"): v for k, v in result.items() if k.startswith("reward/")}
            got = None if error else result.get("reward" if custom else "correctness", result.get("reward"))
            ok = agrees(case, got, parts)
            if not ok:
                disagreements.append(index)
            n_turns = f"{episode.n_turns} of {len(case.turns or ())}" if episode is not None else "-"
            table.add_row(
                str(index),
                _show(_columns(case.ground_truth)),
                n_turns,
                _expected_text(case),
                "error" if got is None else f"{got:g}",
                "[green]ok[/]" if ok else "[bold red]DIFFERS[/]",
                escape(case.why + (f" ({error})" if error else "")),
                "error" if error else f"{result['reward']:.3g}",
                escape(" ".join(f"{name}={value:.3g}" for name, value in parts.items())),
            )
            if episode is not None:
                flags = [
                    f for f, on in (("turn-limited", episode.turn_limited), ("truncated", episode.truncated)) if on
                ]
                ended = f"ended: {episode.stop_reason}" + (f" ({', '.join(flags)})" if flags else "")
                transcripts.append((index, [*transcript(episode), ended]))
    finally:
        if setup is not None:
            setup.close()
    console.print(table)
    for index, lines in transcripts:
        console.print(f"case {index}:", highlight=False)
        for line in lines:
            console.print(f"  {line}", highlight=False, markup=False)
    if disagreements:
        raise UserFacingError(
            f"{len(disagreements)} of {len(cases)} reward sanity cases of task={task.name} disagree "
            f"(rows {', '.join(map(str, disagreements))}): the reward does not do what the task's cases expect"
        )
    console.print(f"all {len(cases)} cases agree with task={task.name}'s reward rule", highlight=False)
    return {"n": len(cases), "n_disagree": 0}
