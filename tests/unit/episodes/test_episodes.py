"""Multi-turn episodes, tokens in and tokens out (grpo_cli/episodes/turns.py): the ids are the sampled ones plus
the template's, the environment's tokens are out of the loss, and a teacher-forced pass over the whole episode gives
the log-probs the sampler had turn by turn. The real SmolLM2 tokenizer, two chat templates written for the tests."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
import transformers

from grpo_cli.episodes.environments import EnvironmentRunner
from grpo_cli.episodes.tools import ToolRunner, load_tools, tool_prompt
from grpo_cli.episodes.turns import (
    ChatTemplate,
    Episode,
    EpisodeLimits,
    SampledTurn,
    TurnOutcome,
    environment_hook,
    episode_metrics,
    run_episodes,
    start_episode,
    tools_hook,
)
from grpo_cli.models import embedded_model_dir
from grpo_cli.tasks.guess_number import guess_number_rows

TEMPLATES = Path(__file__).parents[2] / "fixtures" / "chat_templates"
QUESTION = [{"role": "user", "content": "What is 6 times 7? Use the calculator."}]
TOOL_RESULT = {"role": "tool", "content": "42"}


@pytest.fixture(scope="module")
def tokenizer() -> transformers.PreTrainedTokenizerBase:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        return transformers.AutoTokenizer.from_pretrained(embedded_model_dir())


def chat_template(tokenizer: transformers.PreTrainedTokenizerBase, name: str) -> ChatTemplate:
    return ChatTemplate(tokenizer, chat_template=(TEMPLATES / f"{name}.jinja").read_text())


class Scripted:
    """A generate callable that 'samples' the given texts in order (one list per episode), recording its calls."""

    def __init__(self, template: ChatTemplate, episodes: list[Episode], turns: list[list[str]], end: bool) -> None:
        im_end = template.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.episodes = episodes
        self.turns = [[template.encode(t) + ([im_end] if end else []) for t in episode] for episode in turns]
        self.calls: list[tuple[list[list[int]], int]] = []

    def __call__(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[SampledTurn]:
        self.calls.append(([list(p) for p in prompts], max_tokens))
        # The driver passes the unfinished episodes' ids so far, in order.
        active = [i for i, e in enumerate(self.episodes) if not e.finished]
        assert [list(p) for p in prompts] == [self.episodes[i].prompt_ids + self.episodes[i].ids for i in active]
        return [SampledTurn(self.turns[i].pop(0)) for i in active]


def scripted(template: ChatTemplate, episodes: list[Episode], turns: list[list[str]], end: bool = True) -> Scripted:
    return Scripted(template, episodes, turns, end)


def tool_then_done(episodes: Sequence[Episode]) -> list[TurnOutcome]:
    """A calculator: answers the first turn with a tool result, ends the episode after the second."""
    return [
        TurnOutcome([TOOL_RESULT], None, False) if e.n_turns == 1 else TurnOutcome(None, 1.0, True) for e in episodes
    ]


def spans_of(episode: Episode, kind: str) -> list[list[int]]:
    return [episode.ids[s.start : s.end] for s in episode.spans if s.kind == kind]


def test_ids_are_the_sampled_ones_and_the_templates(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    template = chat_template(tokenizer, "qwen2_5_tools")
    episode = start_episode(template, QUESTION)
    script = scripted(
        template,
        [episode],
        [['<tool_call>\n{"name": "mul", "arguments": {"a": 6, "b": 7}}\n</tool_call>', "It is 42."]],
    )
    sampled = [list(t) for t in script.turns[0]]
    run_episodes([episode], template, script, tool_then_done, EpisodeLimits(max_turns=4, max_tokens_per_turn=64))

    assert episode.prompt_ids == template.encode(template.render(QUESTION, add_generation_prompt=True))
    assert spans_of(episode, "model") == sampled == episode.model_turns
    # The model ended its turn with <|im_end|> (sampled, in the loss); the template adds the rest, out of the loss.
    (env,) = spans_of(episode, "env")
    assert template.decode(env) == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert episode.loss_mask == [1] * len(sampled[0]) + [0] * len(env) + [1] * len(sampled[1])
    assert episode.sampler_logprobs[len(sampled[0]) : len(sampled[0]) + len(env)] == [0.0] * len(env)
    # The whole episode decodes to the template's rendering of the conversation (less the newline after the end).
    assert template.decode(episode.prompt_ids + episode.ids) + "\n" == template.render(episode.messages, False)
    assert episode.messages[-2:] == [TOOL_RESULT, {"role": "assistant", "content": "It is 42."}]
    assert (episode.finished, episode.truncated, episode.stop_reason, episode.step_reward) == (True, False, "done", 1.0)
    assert (episode.rerendered_turns, episode.env_tokens, episode.model_tokens) == (0, len(env), sum(map(len, sampled)))


def test_a_turn_cut_by_its_token_limit_gets_the_templates_end_of_turn_out_of_the_loss(
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    template = chat_template(tokenizer, "qwen2_5_tools")
    episode = start_episode(template, QUESTION)
    script = scripted(
        template, [episode], [["one two three four five six seven eight", "nine ten eleven twelve"]], end=False
    )
    run_episodes([episode], template, script, tool_then_done, EpisodeLimits(max_turns=4, max_tokens_per_turn=3))

    first, second = episode.model_turns
    assert len(first) == len(second) == 3 and episode.turn_cut == [True, True]
    (env,) = spans_of(episode, "env")
    assert template.decode(env).startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n42")
    assert template.decode(episode.prompt_ids + episode.ids) + "<|im_end|>\n" == template.render(
        episode.messages, False
    )
    # Its last turn was cut: truncated, as a single-turn completion cut at max_tokens is.
    assert (episode.stop_reason, episode.truncated) == ("done", True)


def test_a_template_that_alters_earlier_turns_keeps_the_sampled_ids(
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    template = chat_template(tokenizer, "qwen3_style_no_thinking")
    episode = start_episode(template, QUESTION)
    assert template.decode(episode.prompt_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    first_text = "<think>\nsix sevens\n</think>\n\n<tool_call>mul(6, 7)</tool_call>"
    script = scripted(template, [episode], [[first_text, "42"]])
    sampled = [list(t) for t in script.turns[0]]
    run_episodes([episode], template, script, tool_then_done, EpisodeLimits(max_turns=4, max_tokens_per_turn=64))

    # Rendered again, the conversation loses the first turn's reasoning and its empty think block: not a prefix.
    rendered = template.render(episode.messages, False)
    assert "six sevens" not in rendered and episode.rerendered_turns == 1
    assert episode.model_turns == sampled == spans_of(episode, "model")
    (env,) = spans_of(episode, "env")
    assert template.decode(env) == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    # The ids are what the model saw turn by turn: its own reasoning kept, each generation prompt as sampled from.
    assert template.decode(episode.prompt_ids + episode.ids).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        + first_text
        + "<|im_end|>"
        + template.decode(env)
        + "42<|im_end|>"
    )


def test_max_turns_ends_an_episode_turn_limited_with_the_last_answer_in_the_transcript_only(
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    template = chat_template(tokenizer, "qwen2_5_tools")
    episode = start_episode(template, QUESTION)
    script = scripted(template, [episode], [["a", "b"]])
    never_done = lambda episodes: [TurnOutcome([TOOL_RESULT], 0.25, False) for _ in episodes]  # noqa: E731
    run_episodes([episode], template, script, never_done, EpisodeLimits(max_turns=2, max_tokens_per_turn=8))

    # Out of turns, not cut: turn-limited (an ended game), not truncated (its turns ended on their stop token).
    assert (episode.n_turns, episode.stop_reason, episode.turn_limited, episode.truncated) == (
        2,
        "max_turns",
        True,
        False,
    )
    assert [s.kind for s in episode.spans] == ["model", "env", "model"]
    assert episode.messages[-1] == TOOL_RESULT and episode.step_rewards == [0.25, 0.25] and episode.step_reward == 0.5


def test_max_episode_tokens_bounds_model_and_environment_tokens(
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    template = chat_template(tokenizer, "qwen2_5_tools")
    never_done = lambda episodes: [TurnOutcome([TOOL_RESULT], None, False) for _ in episodes]  # noqa: E731
    for budget in (5, 20, 40):
        episode = start_episode(template, QUESTION)
        script = scripted(template, [episode], [["one two three four five six seven eight nine ten"] * 9], end=False)
        limits = EpisodeLimits(max_turns=9, max_tokens_per_turn=8, max_episode_tokens=budget)
        run_episodes([episode], template, script, never_done, limits)
        assert len(episode.ids) <= budget
        # Each turn was cut at its 8 tokens (no stop token): truncated too.
        assert (episode.stop_reason, episode.turn_limited, episode.truncated) == ("max_episode_tokens", True, True)
        # A turn gets what is left of the episode's tokens, never more than the per-turn limit.
        assert all(len(t) <= 8 for t in episode.model_turns)


def test_an_error_ends_the_episode_and_is_kept_for_on_reward_error(
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    template = chat_template(tokenizer, "qwen2_5_tools")
    episode = start_episode(template, QUESTION)
    script = scripted(template, [episode], [["a"]])
    failing = lambda episodes: [TurnOutcome(None, None, False, error="took longer than 1s") for _ in episodes]  # noqa: E731
    run_episodes([episode], template, script, failing, EpisodeLimits(max_turns=3, max_tokens_per_turn=8))
    assert (episode.stop_reason, episode.error, episode.finished, episode.n_turns) == (
        "error",
        "took longer than 1s",
        True,
        1,
    )


def test_the_unfinished_episodes_of_a_batch_generate_together(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    template = chat_template(tokenizer, "qwen2_5_tools")
    episodes = [start_episode(template, [{"role": "user", "content": f"Question {i}"}]) for i in range(3)]
    script = scripted(template, episodes, [["a", "b", "c"], ["a"], ["a", "b"]])

    def done_after(episodes: Sequence[Episode]) -> list[TurnOutcome]:
        lengths = {"Question 0": 3, "Question 1": 1, "Question 2": 2}
        return [
            TurnOutcome(None, float(e.n_turns), True)
            if e.n_turns == lengths[e.prompt_messages[0]["content"]]
            else TurnOutcome([TOOL_RESULT], None, False, counts={"tool_calls": 1})
            for e in episodes
        ]

    run_episodes(episodes, template, script, done_after, EpisodeLimits(max_turns=5, max_tokens_per_turn=8))
    assert [len(prompts) for prompts, _ in script.calls] == [3, 2, 1]
    assert [e.n_turns for e in episodes] == [3, 1, 2]
    assert [e.counts.get("tool_calls", 0) for e in episodes] == [2, 0, 1]
    # The last call's prompt is the episode's ids up to its last turn, exactly (Scripted checks every call).
    assert script.calls[-1][0] == [episodes[0].prompt_ids + episodes[0].ids[: episodes[0].spans[-1].start]]


# ------------------------------------------------------------------- sampled log-probs equal the teacher-forced ones


def tiny_lm(vocab_size: int, im_end: int) -> transformers.LlamaForCausalLM:
    """A tiny random Llama over the real vocabulary, its LM head biased toward <|im_end|> so that some turns end
    by the stop token and others at their token limit."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=1024,
    )
    model = transformers.LlamaForCausalLM(config).float().eval()
    head = torch.nn.Linear(16, vocab_size, bias=True)
    with torch.no_grad():
        head.weight.normal_(0, 0.1)
        head.bias.zero_()
        head.bias[im_end] = 10.0
    model.lm_head = head
    return model


class TorchSampler:
    """Plain torch sampling, one token at a time, recording each sampled token's log-prob."""

    def __init__(self, model: transformers.LlamaForCausalLM, stops: frozenset[int]) -> None:
        self.model, self.stops = model, stops
        self.generator = torch.Generator().manual_seed(1)

    @torch.no_grad()
    def __call__(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[SampledTurn]:
        out = []
        for prompt in prompts:
            sequence, ids, logprobs = list(prompt), [], []
            for _ in range(max_tokens):
                logits = self.model(torch.tensor([sequence]), logits_to_keep=1).logits[0, -1]
                logp = torch.log_softmax(logits.float(), dim=-1)
                token = int(torch.multinomial(logp.exp(), 1, generator=self.generator))
                ids.append(token)
                logprobs.append(float(logp[token]))
                sequence.append(token)
                if token in self.stops:
                    break
            out.append(SampledTurn(ids, logprobs))
        return out


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread: a 16-wide model gains nothing from two, and on a busy 2-core machine loses 10x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_sampled_logprobs_equal_one_teacher_forced_pass_over_the_episode(
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    template = chat_template(tokenizer, "qwen2_5_tools")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = tiny_lm(len(tokenizer), im_end)
    episodes = [start_episode(template, [{"role": "user", "content": f"Compute {i} + {i}."}]) for i in range(4)]

    def calculator(episodes: Sequence[Episode]) -> list[TurnOutcome]:
        return [
            TurnOutcome([{"role": "tool", "content": f"result {e.n_turns}"}], None, False)
            if e.n_turns < 3
            else TurnOutcome(None, 1.0, True)
            for e in episodes
        ]

    limits = EpisodeLimits(max_turns=3, max_tokens_per_turn=4)
    run_episodes(episodes, template, TorchSampler(model, template.stop_token_ids), calculator, limits)

    cut = [c for e in episodes for c in e.turn_cut]
    assert True in cut and False in cut, "the test needs turns ended by <|im_end|> and turns cut at their limit"
    for episode in episodes:
        assert episode.n_turns == 3 and [s.kind for s in episode.spans] == ["model", "env"] * 2 + ["model"]
        full = torch.tensor([episode.prompt_ids + episode.ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(full).logits[0].float(), dim=-1)
        n_prompt = len(episode.prompt_ids)
        # The log-prob of the token at position p comes from the logits at p - 1.
        scored = logp[n_prompt - 1 : -1].gather(1, torch.tensor(episode.ids)[:, None])[:, 0]
        mask = torch.tensor(episode.loss_mask, dtype=torch.bool)
        sampled = torch.tensor(episode.sampler_logprobs)
        torch.testing.assert_close(scored[mask], sampled[mask], rtol=0, atol=1e-5)
        for span in episode.spans:
            assert set(episode.loss_mask[span.start : span.end]) == ({1} if span.kind == "model" else {0})
        # The environment's tokens are the template's rendering of the tool results, tokenized once.
        for span in (s for s in episode.spans if s.kind == "env"):
            text = template.decode(episode.ids[span.start : span.end])
            assert "<|im_start|>user\n<tool_response>\nresult " in text and text.endswith("<|im_start|>assistant\n")


def test_guess_number_episodes_run_against_their_environment_in_a_worker(
    tokenizer: transformers.PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    template = chat_template(tokenizer, "qwen2_5_tools")
    runner = EnvironmentRunner("task.environment", "grpo_cli.tasks.guess_number:GuessNumber", tmp_path, 1, 30.0)
    try:
        rows = guess_number_rows(2, seed=0, low=10, high=20)
        sessions = runner.reset(rows)
        episodes = [start_episode(template, s.opening, context=s) for s in sessions]
        finds = rows[0]["target"]
        script = scripted(template, episodes, [[f"{finds - 1}", f"{finds + 1}", f"It is {finds}"], ["5", "30", "7"]])
        run_episodes(episodes, template, script, environment_hook(runner), EpisodeLimits(3, 8))
        runner.close(sessions)
    finally:
        runner.shutdown()
    found, lost = episodes
    assert (found.stop_reason, found.truncated, found.step_rewards) == ("done", False, [0.0, 0.0, 1.0])
    assert [m["content"] for m in found.completion_messages if m["role"] == "user"] == ["Higher.", "Lower."]
    assert (lost.stop_reason, lost.turn_limited, lost.truncated, lost.step_reward) == ("max_turns", True, False, 0.0)
    assert not found.turn_limited
    for episode in episodes:
        env_text = [template.decode(episode.ids[s.start : s.end]) for s in episode.spans if s.kind == "env"]
        assert all(t.startswith("\n<|im_start|>user\n") and t.endswith("<|im_start|>assistant\n") for t in env_text)
        assert template.decode(episode.prompt_ids).count("between 10 and 20") == 1


def test_a_turn_ended_by_a_stop_string_is_not_cut_and_the_template_closes_it(
    tokenizer: transformers.PreTrainedTokenizerBase,
) -> None:
    template = chat_template(tokenizer, "qwen2_5_tools")
    episode = start_episode(template, QUESTION)
    call = '<tool_call>\n{"name": "mul", "arguments": {"a": 6, "b": 7}}\n</tool_call>'

    def stops_on_string(prompts: Sequence[Sequence[int]], max_tokens: int) -> list[SampledTurn]:
        # vLLM's finish_reason "stop" for a stop string: no stop token, yet the turn ended on its own.
        return [SampledTurn(template.encode(call if episode.n_turns == 0 else "42"), None, True) for _ in prompts]

    run_episodes([episode], template, stops_on_string, tool_then_done, EpisodeLimits(3, 64))
    assert episode.turn_cut == [False, False] and not episode.truncated
    assert episode.messages[1] == {"role": "assistant", "content": call}
    (env,) = spans_of(episode, "env")
    assert template.decode(env).startswith("<|im_end|>\n<|im_start|>user\n<tool_response>")


def test_episode_metrics_are_per_episode_means(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    template = chat_template(tokenizer, "qwen2_5_tools")
    episodes = [start_episode(template, [{"role": "user", "content": f"Question {i}"}]) for i in range(2)]
    script = scripted(template, episodes, [["a", "b"], ["a"]])

    def hook(episodes: Sequence[Episode]) -> list[TurnOutcome]:
        return [
            TurnOutcome([TOOL_RESULT], None, False, counts={"tool_calls": 2, "tool_errors": 1})
            if e.prompt_messages[0]["content"] == "Question 0" and e.n_turns == 1
            else TurnOutcome(None, None, True)
            for e in episodes
        ]

    run_episodes(episodes, template, script, hook, EpisodeLimits(3, 8))
    metrics = episode_metrics(episodes)
    assert metrics == {
        "turns": 1.5,
        "env_tokens": episodes[0].env_tokens / 2,
        "truncated_episodes": 0.0,
        "turn_limited_episodes": 0.0,
        "rerendered_turns": 0.0,
        "context_limited": 0.0,
        "tool_calls": 1.0,
        "tool_errors": 0.5,
    }
    assert episodes[0].env_tokens > 0 and episode_metrics([]) == {}


@pytest.mark.parametrize("template_name", [None, "hermes_tools"])
def test_tool_episodes_render_through_the_tools_prompt(
    tokenizer: transformers.PreTrainedTokenizerBase, tmp_path: Path, template_name: str | None
) -> None:
    """SmolLM2's own template (no tools: the default tool prompt) and the tools helper's Hermes fixture (native
    tools and tool messages): the calculator's result is the environment span, the model's turns as sampled."""
    if template_name is not None:
        tokenizer = copy.copy(tokenizer)
        tokenizer.chat_template = (TEMPLATES / f"{template_name}.jinja").read_text()
    tools = load_tools({"calculator": "grpo_cli.episodes.builtin_tools:calculator"}, tmp_path)
    prompt = tool_prompt(tokenizer, tools)
    template = ChatTemplate.for_tools(tokenizer, prompt)
    episode = start_episode(template, QUESTION)
    assert "calculator" in template.decode(episode.prompt_ids)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
    script = scripted(template, [episode], [[call, "It is 42."]])
    run_episodes(
        [episode], template, script, tools_hook(ToolRunner(tools, 10.0, workers=0), prompt), EpisodeLimits(3, 64)
    )

    assert episode.messages[-2]["role"] == "tool" and episode.messages[-2]["content"] == "42"
    assert (episode.stop_reason, episode.counts, episode.rerendered_turns) == (
        "done",
        {"tool_calls": 1, "tool_errors": 0},
        0,
    )
    (env,) = spans_of(episode, "env")
    assert "42" in template.decode(env) and set(episode.loss_mask[episode.spans[1].start : episode.spans[1].end]) == {0}
    assert template.decode(episode.prompt_ids + episode.ids) + "\n" == template.render(episode.messages, False)
