"""A chat template without a system role (Gemma-2's: it raises on one) gets the system text in the first user turn,
wherever a system message comes from: the data, task.system_prompt, the default tool prompt (issue #39 part 6).
The real SmolLM2 tokenizer with Gemma-2's template (tests/fixtures/chat_templates/no_system_role.jinja)."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import transformers

from grpo_cli.engines.base import render_prompts
from grpo_cli.episodes.chat_roles import fold_system
from grpo_cli.episodes.tools import load_tools, tool_prompt
from grpo_cli.episodes.turns import ChatTemplate, start_episode
from grpo_cli.models import embedded_model_dir

TEMPLATES = Path(__file__).parents[2] / "fixtures" / "chat_templates"
CONVERSATION = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 6 times 7?"}]


@pytest.fixture(scope="module")
def gemma_like() -> transformers.PreTrainedTokenizerBase:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        tokenizer = transformers.AutoTokenizer.from_pretrained(embedded_model_dir())
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = (TEMPLATES / "no_system_role.jinja").read_text()
    return tokenizer


def test_the_fixture_refuses_a_system_message(gemma_like: transformers.PreTrainedTokenizerBase) -> None:
    with pytest.raises(Exception, match="System role not supported"):
        gemma_like.apply_chat_template(CONVERSATION, tokenize=False)


def test_fold_puts_the_system_text_before_the_first_user_turn() -> None:
    assert fold_system(CONVERSATION) == [{"role": "user", "content": "Answer briefly.\n\nWhat is 6 times 7?"}]
    assert fold_system([{"role": "system", "content": "S"}]) == [{"role": "user", "content": "S"}]
    assert fold_system(CONVERSATION[1:]) == CONVERSATION[1:]


def test_a_system_message_of_the_data_is_folded_into_the_first_user_turn(
    gemma_like: transformers.PreTrainedTokenizerBase, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        (ids,) = render_prompts([CONVERSATION], gemma_like)
    # What the template renders for the folded conversation, computed here by hand.
    expected = gemma_like.apply_chat_template(
        [{"role": "user", "content": "Answer briefly.\n\nWhat is 6 times 7?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert gemma_like.decode(ids) == expected
    assert any("has no system role" in r.getMessage() for r in caplog.records)
    episode = start_episode(ChatTemplate(gemma_like), CONVERSATION)
    assert episode.rendered == expected and episode.prompt_messages == CONVERSATION  # the transcript keeps it


def test_the_default_tool_prompt_is_folded_into_the_first_user_turn(
    gemma_like: transformers.PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    tools = load_tools({"calculator": "grpo_cli.episodes.builtin_tools:calculator"}, tmp_path)
    prompt = tool_prompt(gemma_like, tools)
    text = prompt.render(gemma_like, CONVERSATION[1:], tokenize=False, add_generation_prompt=True)
    assert (
        text.startswith(f"{gemma_like.bos_token}<start_of_turn>user\n# Tools")
        and '"calculator"' in text
        and "What is 6 times 7?" in text
    )
    assert "<start_of_turn>system" not in text


def test_a_model_without_a_chat_template_under_task_prompt_chat_is_one_line(
    gemma_like: transformers.PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    """A base model's tokenizer has no template: one line before the engine is built, not a ValueError from
    transformers at the first prompt."""
    from grpo_cli.errors import UserFacingError
    from grpo_cli.rollout.worker import RolloutWorker
    from tests.conftest import compose_config

    base = copy.copy(gemma_like)
    base.chat_template = None
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=len(base), hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1
        )
    )
    cfg = compose_config(["debug=smoke", "model.mixed_precision=no"], output_dir=str(tmp_path))
    assert cfg.task.prompt == "chat"
    with pytest.raises(
        UserFacingError, match=r"has no chat template, and task.prompt=chat .* task.prompt=question_only"
    ):
        RolloutWorker(cfg, model, base)
