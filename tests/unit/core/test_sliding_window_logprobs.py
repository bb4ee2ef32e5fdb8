"""Sliding-window models score the same log-probs and gradients through the trainer's forward passes (the
shared-prompt one and the plain one) as one unpadded forward per sequence, and the HF rollout engine samples from
that distribution.

A sliding window measures distance in cache columns, so padding between a prompt and its completion would count
as distance (and a sliding cache would keep padding instead of the prompt). Each architecture below gets a tiny
random config whose window (4) is shorter than every prompt and completion, with at least one sliding layer
(checked: the window changes the log-probs).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from grpo_cli.core import response_log_probs, tokenize_prompt_and_output_ids
from grpo_cli.core.prompt_sharing import worth_sharing
from tests.conftest import TINY_LM_CONFIG, build_tiny_lm

WINDOW = 4
TINY = dict(TINY_LM_CONFIG, pad_token_id=0)
# Two layers, the first sliding, for the configs that take a per-layer list.
MIXED_LAYERS = ["sliding_attention", "full_attention"]
MOE = dict(num_local_experts=4, num_experts_per_tok=2)

# (transformers model class, config class, config keys beyond TINY), by architecture.
ARCHITECTURES = {
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=WINDOW)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(sliding_window=WINDOW, **MOE)),
    # Qwen2-family configs ignore `sliding_window` unless `use_sliding_window`; layers from max_window_layers on
    # slide, so layer 0 is full and layer 1 sliding.
    "qwen2": (
        "Qwen2ForCausalLM",
        "Qwen2Config",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        ),
    ),
    "qwen3": (
        "Qwen3ForCausalLM",
        "Qwen3Config",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    "gemma2": (
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(sliding_window=WINDOW, layer_types=MIXED_LAYERS, query_pre_attn_scalar=16),
    ),
    "gemma3_text": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(sliding_window=WINDOW, layer_types=MIXED_LAYERS, query_pre_attn_scalar=16),
    ),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(sliding_window=WINDOW)),
    "starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config", dict(sliding_window=WINDOW)),
    "cohere2": ("Cohere2ForCausalLM", "Cohere2Config", dict(sliding_window=WINDOW, layer_types=MIXED_LAYERS)),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", dict(sliding_window=WINDOW, layer_types=MIXED_LAYERS, **MOE)),
}


@pytest.fixture(autouse=True)
def _one_thread():
    """Models this small gain nothing from a second thread, and lose a lot on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(architecture: str, **overrides) -> torch.nn.Module:
    model_name, config_name, extra = ARCHITECTURES[architecture]
    return build_tiny(model_name, config_name, {**TINY, **extra, **overrides})


def build_tiny(model_name: str, config_name: str, config_keys: dict) -> torch.nn.Module:
    """transformers' `model_name` on `config_name(**config_keys)` by the tests' one builder (random weights, fp32,
    train mode), skipped where the installed transformers has no such model."""
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    # Seeded before the model is built (its own init draws first): the tolerances below were set on these weights.
    torch.manual_seed(0)
    return build_tiny_lm(model_name, config_name, seed=None, **config_keys)


def group_batch():
    # Two prompts longer than the window and of different lengths (so one is padded), G = 3 completions each,
    # of lengths 1 to 7 (some longer than the window too).
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [14, 15, 16, 17, 18, 19]]
    completions = [[20, 21, 22, 40, 41, 42], [23], [24, 25, 26, 27, 28], [30, 31], [32, 33, 34, 35, 36, 37, 38], [39]]
    prompt_ids = [prompts[i // 3] for i in range(6)]
    return prompt_ids, completions


def one_row_log_probs(model: torch.nn.Module, prompt_ids, completions) -> torch.Tensor:
    """Response log-probs from one unpadded forward of each sequence through the model's own forward (its own
    head and logit soft-capping / scaling), concatenated in row order."""
    scores = []
    for prompt, completion in zip(prompt_ids, completions, strict=True):
        logits = model(torch.tensor([prompt + completion])).logits[0].float()  # (T, V)
        log_probs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # positions predicting the completion
        scores.append(log_probs.gather(-1, torch.tensor(completion)[:, None])[:, 0])
    return torch.cat(scores)


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_the_window_is_active_in_the_tiny_config(architecture):
    """Guard against a config key a transformers version ignores: with the window as long as the model's context,
    the same weights score the same sequences differently, so the test below tests a window."""
    prompt_ids, completions = group_batch()
    windowed = build(architecture)
    unwindowed = build(architecture, sliding_window=TINY["max_position_embeddings"])
    unwindowed.load_state_dict(windowed.state_dict())
    with torch.no_grad():
        difference = one_row_log_probs(windowed, prompt_ids, completions) - one_row_log_probs(
            unwindowed, prompt_ids, completions
        )
    assert difference.abs().max() > 1e-2


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
@pytest.mark.parametrize("share_prompts", [True, False], ids=["shared_prompt", "plain"])
def test_response_log_probs_equal_one_unpadded_forward_per_sequence(architecture, share_prompts):
    assert_scored_like_one_unpadded_forward_per_sequence(build(architecture), share_prompts)


def assert_scored_like_one_unpadded_forward_per_sequence(
    model: torch.nn.Module, share_prompts: bool, pack_sequences: bool = False, prompt_tree: bool = False
) -> None:
    """The trainer's scoring of `group_batch` (response log-probs, and the gradients of a non-uniform loss of
    them) equals one unpadded forward per sequence; `pack_sequences`: through packed rows (core/packing.py);
    `prompt_tree`: the shared prompt as a prompt tree (core/prompt_tree.py)."""
    prompt_ids, completions = group_batch()
    batch = tokenize_prompt_and_output_ids(prompt_ids, completions, pad_token_id=0)
    mask = batch["response_mask"].bool()
    assert worth_sharing(batch["input_ids"], mask)  # so share_prompts=True asks for the shared path
    weights = torch.linspace(-1, 1, int(mask.sum()))  # any non-uniform loss

    def gradients(score: torch.Tensor) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        (score * weights).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    # The trainer's call (grpo_cli/learner/learner.py): response-masked, chunked head, prompts shared when they repeat.
    trained = response_log_probs(
        model,
        batch["input_ids"],
        batch["labels"],
        mask,
        share_prompts=share_prompts,
        pack_sequences=pack_sequences,
        prompt_tree=prompt_tree,
    )
    scored = trained["log_probs"][mask]  # row-major order == the rows' completions concatenated
    scored_grads = gradients(scored)
    expected = one_row_log_probs(model, prompt_ids, completions)
    expected_grads = gradients(expected)

    torch.testing.assert_close(scored, expected, atol=1e-5, rtol=1e-5)
    assert set(scored_grads) == set(expected_grads)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(scored_grads[name], grad, atol=1e-4, rtol=1e-4, msg=name)


class _Tokenizer:
    """What the HF rollout engine reads of a tokenizer: EOS and pad ids, and decode (for stop strings)."""

    eos_token_id, pad_token_id = 96, 0

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(65 + i % 26) for i in ids)


# transformers 4.x's Qwen2-MoE builds its sliding-window mask over the whole sequence while its cache holds the
# last window only, so generate() samples from the wrong distribution (6.6 nats off on 4.57.1); fixed in 5.
_QWEN2_MOE_GENERATE_BUG = pytest.mark.xfail(
    int(transformers.__version__.split(".")[0]) < 5,
    reason="transformers 4.x Qwen2-MoE: generate() with a sliding window masks the wrong cache columns",
    strict=True,
)


@pytest.mark.parametrize(
    "architecture",
    [pytest.param(a, marks=_QWEN2_MOE_GENERATE_BUG) if a == "qwen2_moe" else a for a in ARCHITECTURES],
)
def test_the_rollouts_sampler_log_probs_equal_one_unpadded_forward_per_sequence(architecture):
    """The other batched, padded pass over these models: the HF rollout engine samples prompts of different
    lengths together (left-padded; sliding windows go to transformers' generate())."""
    from grpo_cli.rollout import HFRolloutEngine, SamplingSettings

    model = build(architecture, eos_token_id=_Tokenizer.eos_token_id).eval()
    prompts = group_batch()[0][::3]
    settings = SamplingSettings(n=2, temperature=1.0, max_tokens=8, min_tokens=8, seed=3)
    batch = HFRolloutEngine(model, _Tokenizer()).generate(prompts, settings)
    assert min(len(ids) for ids in batch.completion_ids) > WINDOW
    sampled = torch.tensor([value for row in batch.sampler_log_probs for value in row])
    with torch.no_grad():
        expected = one_row_log_probs(model, batch.prompt_ids, batch.completion_ids)
    torch.testing.assert_close(sampled, expected, atol=1e-5, rtol=1e-5)
