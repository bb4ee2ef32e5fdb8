"""Bounded context (issue #39 part 4): no engine samples past the model's context, an episode's budget is what its
prompt leaves of the context (or task.max_episode_tokens if less), and each observation is cut at
task.max_observation_tokens with a line the model reads. A tiny random Llama with a 64-token context, the real
SmolLM2 tokenizer."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch
import transformers

from grpo_cli.engines.base import first_prompt_past_context
from grpo_cli.episodes.turns import (
    ChatTemplate,
    Episode,
    EpisodeLimits,
    SampledTurn,
    TurnOutcome,
    episode_metrics,
    run_episodes,
    start_episode,
)
from grpo_cli.errors import UserFacingError
from grpo_cli.models import embedded_model_dir
from grpo_cli.rollout import HFRolloutEngine, SamplingSettings, render_prompts
from grpo_cli.rollout.episode_rollout import EpisodeRun
from grpo_cli.rollout.multiturn import EpisodeSetup, episode_setup
from grpo_cli.tasks.base import Example
from grpo_cli.tasks.schema import TaskConfig

CONTEXT = 64
QUESTION = [{"role": "user", "content": "What is 6 times 7?"}]


@pytest.fixture(scope="module")
def tokenizer() -> transformers.PreTrainedTokenizerBase:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        return transformers.AutoTokenizer.from_pretrained(embedded_model_dir())


@pytest.fixture(scope="module")
def short_context_model(tokenizer: transformers.PreTrainedTokenizerBase) -> Iterator[torch.nn.Module]:
    """A 1-layer Llama over SmolLM2's vocabulary whose context is 64 positions (rotary: nothing fails past it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=CONTEXT,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    yield transformers.LlamaForCausalLM(config).eval()
    torch.set_num_threads(threads)


def prompt_of(length: int, start: int = 1000) -> list[int]:
    return list(range(start, start + length))


def test_the_hf_engine_never_samples_past_the_models_context(
    tokenizer: transformers.PreTrainedTokenizerBase, short_context_model: torch.nn.Module
) -> None:
    engine = HFRolloutEngine(short_context_model, tokenizer, decoder="generate")
    assert engine.context_length == CONTEXT
    prompts = [prompt_of(10), prompt_of(50, 2000), prompt_of(80, 3000)]  # room 30, 14 and none
    settings = SamplingSettings(n=2, temperature=1.0, max_tokens=30, seed=7)
    batch = engine.generate(prompts, settings)

    lengths = [len(ids) for ids in batch.completion_ids]
    assert lengths[:4] == [30, 30, 14, 14]  # a random model over 49k tokens samples no EOS here
    assert all(len(p) + n <= CONTEXT for p, n in zip(batch.prompt_ids[:4], lengths[:4], strict=True))
    assert lengths[4:] == [0, 0] and batch.truncated[4:] == [True, True]
    assert batch.context_limited == [False, False] + [n == 14 for n in lengths[2:4]] + [True, True]
    assert batch.sampler_log_probs is not None and [len(lp) for lp in batch.sampler_log_probs] == lengths
    # Each prompt's rows are what it samples alone, with what the context leaves it (the same random streams).
    alone = engine.generate([prompts[1]], SamplingSettings(n=2, temperature=1.0, max_tokens=14, seed=7)).completion_ids
    first = SamplingSettings(n=2, temperature=1.0, max_tokens=30, seed=7, prompt_indices=(0,))
    assert batch.completion_ids[:2] == engine.generate([prompts[0]], first).completion_ids
    assert (
        batch.completion_ids[2:4]
        == engine.generate(
            [prompts[1]], SamplingSettings(n=2, temperature=1.0, max_tokens=14, seed=7, prompt_indices=(1,))
        ).completion_ids
    )
    assert len(alone[0]) <= 14


def test_an_observation_is_cut_at_max_observation_tokens_with_a_marker(
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    """A tool answering with ~20k tokens adds at most max_observation_tokens of them (plus the marker and the
    template's turn markers), and the model reads that it was cut."""
    template = ChatTemplate(tokenizer)
    huge = " ".join(str(i) for i in range(10_000))
    total = len(template.encode(huge))
    assert total > 15_000
    episode = start_episode(template, QUESTION)

    def generate(prompts: Sequence[Sequence[int]], max_tokens: int) -> list[SampledTurn]:
        return [SampledTurn(template.encode("Let me look.")) for _ in prompts]

    def hook(episodes: Sequence[Episode]) -> list[TurnOutcome]:
        return [TurnOutcome([{"role": "user", "content": huge}]) for _ in episodes]

    limits = EpisodeLimits(max_turns=2, max_tokens_per_turn=8, max_observation_tokens=100)
    run_episodes([episode], template, generate, hook, limits)
    env_span = next(s for s in episode.spans if s.kind == "env")
    shown = episode.messages[2]["content"]
    assert shown.startswith(tokenizer.decode(template.encode(huge)[:100]))
    assert shown.endswith(f"[... observation cut: its first 100 of {total} tokens shown]")
    assert env_span.end - env_span.start < 100 + 40
    assert episode.counts == {"truncated_observations": 2}  # the last answer is cut too (rewards see it so)
    assert episode_metrics([episode])["truncated_observations"] == 2.0


def test_observations_are_bounded_by_default(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    task = TaskConfig(name="custom", environment="grpo_cli.tasks.guess_number:GuessNumber")
    setup = episode_setup(task, tokenizer, 16)
    assert setup is not None and setup.limits.max_observation_tokens == 1024


def test_an_episode_ends_when_the_context_is_full(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    template = ChatTemplate(tokenizer)
    episode = start_episode(template, QUESTION)
    context = len(episode.prompt_ids) + 40
    budgets: list[int] = []

    def generate(prompts: Sequence[Sequence[int]], max_tokens: int) -> list[SampledTurn]:
        budgets.append(max_tokens)
        return [SampledTurn(template.encode("one two three four five six seven eight nine ten")) for _ in prompts]

    def hook(episodes: Sequence[Episode]) -> list[TurnOutcome]:
        return [TurnOutcome([{"role": "user", "content": "Go on."}]) for _ in episodes]

    limits = EpisodeLimits(max_turns=20, max_tokens_per_turn=12, max_episode_tokens=1000, context_length=context)
    run_episodes([episode], template, generate, hook, limits)
    assert (episode.stop_reason, episode.truncated) == ("context", True)
    assert len(episode.prompt_ids) + len(episode.ids) <= context
    assert budgets[0] == 12 and all(b <= 12 for b in budgets)
    assert episode_metrics([episode])["context_limited"] == 1.0
    # max_episode_tokens binds first when it is the smaller: its name is the stop reason.
    second = start_episode(template, QUESTION)
    run_episodes([second], template, generate, hook, EpisodeLimits(20, 12, 30, context_length=context))
    assert second.stop_reason == "max_episode_tokens"


def test_an_opening_longer_than_the_context_stops_in_one_line(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    template = ChatTemplate(tokenizer)
    episode = start_episode(template, [{"role": "user", "content": "word " * 100}])
    with pytest.raises(
        UserFacingError, match=r"opening \('word word .*\.\.\.'\) is \d+ tokens and the model's context is 64"
    ):
        run_episodes([episode], template, lambda p, m: [], lambda e: [], EpisodeLimits(2, 8, context_length=CONTEXT))


def test_episodes_on_an_engine_take_its_context(
    tokenizer: transformers.PreTrainedTokenizerBase, short_context_model: torch.nn.Module
) -> None:
    """An environment that never ends the game and a 64-token model: every episode stops at the context, within it."""
    never_done = lambda episodes: [TurnOutcome([{"role": "user", "content": "Higher."}]) for _ in episodes]  # noqa: E731
    setup = EpisodeSetup(ChatTemplate(tokenizer), EpisodeLimits(50, 16), 1.0, "stop", _hook=never_done)
    engine = HFRolloutEngine(short_context_model, tokenizer, decoder="generate")
    run = EpisodeRun(setup, lambda episodes, state: None)  # type: ignore[arg-type, return-value]
    examples = [Example(prompt=[{"role": "user", "content": "Guess."}], ground_truth="1")]
    episodes = run.generate(engine, SamplingSettings(n=2, temperature=1.0, max_tokens=16, seed=1), examples, 0)
    assert [e.stop_reason for e in episodes] == ["context", "context"]
    assert all(len(e.prompt_ids) + len(e.ids) <= CONTEXT for e in episodes)


def test_prompt_past_context_is_found_by_its_token_count(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    prompts: list = [
        "short",
        [{"role": "user", "content": "hi " * 30}],
        "tok " * 200,
        [{"role": "user", "content": "x"}],
    ]
    lengths = [len(ids) for ids in render_prompts(prompts, tokenizer)]
    assert first_prompt_past_context(prompts, tokenizer, max(lengths) + 1) is None
    context = lengths[1]  # the chat prompt fills it exactly: no room for a sampled token
    first = next(i for i, n in enumerate(lengths) if n >= context)
    assert first_prompt_past_context(prompts, tokenizer, context) == (first, lengths[first])


def test_a_training_prompt_longer_than_the_context_stops_the_run_before_training(tmp_path) -> None:  # noqa: ANN001
    from grpo_cli.rollout.worker import RolloutWorker
    from tests.conftest import compose_config

    cfg = compose_config(["debug=smoke", "model.mixed_precision=no"], output_dir=str(tmp_path))
    worker = RolloutWorker(cfg)
    try:
        context = worker.engine.context_length
        assert context == worker.model.config.max_position_embeddings
        fits = [Example("What is 2 + 2?", 4)] * 3
        worker.check_prompts_fit(fits)
        long = Example([{"role": "user", "content": "Count: " + "one " * context}], 0)
        with pytest.raises(UserFacingError) as error:
            worker.check_prompts_fit([*fits, long])
        assert str(error.value).startswith(
            f"training example 3 ('Count: {'one ' * 12}on...') is a "
            f"{len(render_prompts([long.prompt], worker.tokenizer)[0])}-token prompt and the model's context is "
            f"{context} tokens (the model's max_position_embeddings)"
        )
    finally:
        worker.close()
