"""What "as trained" means for the exported model: how its prompts were rendered and how it was sampled.

The sampling settings (temperature, top_p, the completion length, the EOS and stop strings) go into
generation_config.json, where transformers' `generate` (stop strings given the tokenizer) and vLLM
(`--generation-config auto`, its default) read them. The prompt format (`task.prompt`: chat, r1_zero,
question_only), a multi-turn task's tools and the rest go into the card, with a snippet that renders a prompt with
grpo-cli's own functions, exactly as training did.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from grpo_cli.export.source import saved_value

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from transformers import GenerationConfig, PreTrainedTokenizerBase

    from grpo_cli.export.folder import Layout

PROMPT_FORMATS = {
    "chat": "the question as one user message through the tokenizer's chat template (saved in this folder), with "
    "the assistant turn opened (add_generation_prompt=True)",
    "r1_zero": "the question in the r1_zero text template (below), as plain text (no chat template): the model "
    "continues after `Assistant: <think>`, and its answer ends at `</answer>`",
    "question_only": "the question alone, as plain text (no chat template)",
}


def trained_stop_strings(config: DictConfig) -> list[str]:
    """rollout.stop plus the prompt format's own (r1_zero's `</answer>`), as training stopped its completions."""
    from grpo_cli.tasks import stop_strings

    return list(
        stop_strings(list(saved_value(config, "rollout.stop", []) or []), str(saved_value(config, "task.prompt")))
    )


def generation_config(model: Any, tokenizer: PreTrainedTokenizerBase, config: DictConfig) -> GenerationConfig:
    """The model's generation config with the run's sampling: rollout.temperature (sampling; 0: greedy), top_p,
    max_new_tokens = rollout.max_tokens, min_new_tokens = rollout.min_tokens, the tokenizer's EOS and pad, and the
    stop strings training stopped at."""
    import copy

    from transformers import GenerationConfig

    from grpo_cli.engines.hf_internals import base_model

    existing = getattr(base_model(model), "generation_config", None)
    generation = copy.deepcopy(existing) if existing is not None else GenerationConfig()
    temperature = float(saved_value(config, "rollout.temperature", 1.0))
    generation.do_sample = temperature > 0
    generation.temperature = temperature if temperature > 0 else None
    generation.top_p = float(saved_value(config, "rollout.top_p", 1.0))
    generation.max_new_tokens = int(saved_value(config, "rollout.max_tokens"))
    min_tokens = int(saved_value(config, "rollout.min_tokens", 0) or 0)
    generation.min_new_tokens = min_tokens or None
    generation.pad_token_id = tokenizer.pad_token_id
    if generation.eos_token_id is None:
        generation.eos_token_id = tokenizer.eos_token_id
    stops = trained_stop_strings(config)
    generation.stop_strings = stops or None
    return generation


def _tools_prompt_text(tools: dict[str, Any], call_format: str | None, tokenizer: Any) -> list[str]:
    """The tools' JSON schemas and the snippet that renders a turn with them as the episodes did (markdown lines);
    nothing when the tools do not load here (their code is the user's: the card then names them only)."""
    import pprint
    from pathlib import Path

    from grpo_cli.episodes.tools import load_tools, prompt_for_schemas

    try:
        loaded = load_tools(tools, Path.cwd())
        schemas = [tool.schema for tool in loaded.values()]
        prompt = prompt_for_schemas(tokenizer, schemas, call_format) if tokenizer is not None else None
    except Exception:  # noqa: BLE001 - the user's tool code: the card names the tools instead
        return []
    shown = "native (the chat template renders them)" if prompt is not None and prompt.native else "a system message"
    return [
        "",
        f"The tools as the model saw them (listed in {shown}; calls in the "
        f"{prompt.fmt.name if prompt is not None else call_format} format):",
        "",
        "```python",
        "from grpo_cli.episodes.tools import prompt_for_schemas",
        "",
        f"schemas = {pprint.pformat(schemas, width=110, sort_dicts=False)}",  # a Python literal (JSON's false: False)
        f"tools_prompt = prompt_for_schemas(tokenizer, schemas, {call_format!r})",
        "text = tools_prompt.render(tokenizer, messages, tokenize=False, add_generation_prompt=True)",
        "```",
    ]


def as_trained_text(
    config: DictConfig, layout: Layout, hub_id: str | None, tokenizer: PreTrainedTokenizerBase | None = None
) -> str:
    """The card's section on prompting the model as it was trained (markdown)."""
    from grpo_cli.tasks.base import R1_ZERO_TEMPLATE

    task = str(saved_value(config, "task.name"))
    prompt = str(saved_value(config, "task.prompt", "chat"))
    stops = trained_stop_strings(config)
    lines = [
        f"- Prompt format (`task.prompt={prompt}`): {PROMPT_FORMATS.get(prompt, prompt)}.",
        f"- Sampling in training: temperature {saved_value(config, 'rollout.temperature')}, top_p "
        f"{saved_value(config, 'rollout.top_p')}, at most {saved_value(config, 'rollout.max_tokens')} new tokens; "
        f"evaluation sampled at temperature {saved_value(config, 'rollout.eval_temperature')} "
        f"(0: greedy). generation_config.json holds the training values.",
        f"- Stop strings: {stops if stops else 'none besides the EOS token'}"
        + (" (in generation_config.json: pass the tokenizer to `generate`; vLLM: `stop=`)." if stops else "."),
    ]
    tools = saved_value(config, "task.tools")
    environment = saved_value(config, "task.environment") or saved_value(config, "task.environment_factory")
    if tools or environment:
        names = sorted(tools) if isinstance(tools, dict) else tools or "none"
        call_format = saved_value(config, "task.tool_call_format") or "the template's default"
        lines.append(
            f"- A multi-turn task: tools {names}, tool-call format {call_format}, environment "
            f"{'yes' if environment else 'none'}. Each turn was rendered with the tools prompt of "
            "grpo_cli/episodes/tools.py over the chat template saved here (below, when the tools load here)."
        )
        if isinstance(tools, dict) and tools:
            lines += _tools_prompt_text(tools, saved_value(config, "task.tool_call_format"), tokenizer)
    if prompt == "r1_zero":
        template = "\n".join(f"    {line}" for line in R1_ZERO_TEMPLATE.splitlines())
        lines += ["", "The r1_zero template (`{question}` is replaced by the question):", "", template]
    folder = hub_id or "<this folder>"
    load = (
        f'tokenizer = AutoTokenizer.from_pretrained("{folder}")'
        if layout.kind != "adapter"
        else f'tokenizer = AutoTokenizer.from_pretrained("{folder}")  # the adapter folder keeps the tokenizer'
    )
    lines += [
        "",
        "A prompt rendered exactly as training rendered it (grpo-cli's own functions; `pip install grpo-cli`):",
        "",
        "```python",
        "from transformers import AutoTokenizer",
        "from grpo_cli.engines.base import render_prompts  # the function every rollout renders prompts with",
        "from grpo_cli.tasks import get_task",
        "",
        load,
        f'prompt = get_task("{task}").make_prompt("<your question>", "{prompt}")  # messages, or text',
        "input_ids = render_prompts([prompt], tokenizer)[0]",
        "```",
    ]
    if task == "custom":
        lines.append(
            "(task=custom: the user's own prompt template, if the task had one, is not applied by make_prompt.)"
        )
    return "\n".join(lines)
