"""The prompt tree (grpo_cli/core/prompt_tree.py): each prompt once with all its completions in one packed row
scores every completion like one unpadded forward of it (log-probs and gradients), serves only the models whose
probe passes, and the learner computes no completion padding with it and trains the same parameters."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch

import grpo_cli.core.prompt_tree as prompt_tree
from grpo_cli.batch.forward import uses_prompt_tree
from grpo_cli.batch.rollout_data import RolloutData, make_microbatch
from grpo_cli.core import response_log_probs, tokenize_prompt_and_output_ids
from grpo_cli.core.prompt_tree import prompt_tree_hidden, prompt_tree_refusal, prompt_tree_rows
from tests.conftest import compose_config
from tests.unit.core.test_sliding_window_logprobs import (  # noqa: F401 - _one_thread is an autouse fixture
    ARCHITECTURES,
    TINY,
    _one_thread,
    assert_scored_like_one_unpadded_forward_per_sequence,
    build_tiny,
    group_batch,
)

# Full attention in every layer: what the tree serves (sdpa and eager attention).
SERVED = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}),
    "llama_eager": ("LlamaForCausalLM", "LlamaConfig", {"attn_implementation": "eager"}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"use_sliding_window": False, "head_dim": 8}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {"use_sliding_window": False}),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", {"head_dim": 8}),
    "mistral": ("MistralForCausalLM", "MistralConfig", {"sliding_window": None}),
}


def build(architecture: str) -> torch.nn.Module:
    model_name, config_name, extra = SERVED[architecture]
    return build_tiny(model_name, config_name, {**TINY, **extra})


def probe_passes(model: torch.nn.Module) -> bool:
    return uses_prompt_tree(model, share_prompts=True, temperature=1.0, logits_chunk_tokens=0)


@pytest.mark.parametrize("architecture", list(SERVED))
def test_the_tree_scores_like_one_unpadded_forward_per_sequence_where_the_probe_passes(architecture):
    model = build(architecture)
    assert prompt_tree_refusal(model) is None
    assert probe_passes(model)
    assert_scored_like_one_unpadded_forward_per_sequence(model, share_prompts=True, prompt_tree=True)


def test_the_tree_runs_under_gradient_checkpointing():
    """The two-pass shared forward needs a KV cache, which checkpointing turns off; the tree needs none."""
    from grpo_cli.models.loading import _enable_gradient_checkpointing

    model = build("llama")
    _enable_gradient_checkpointing(model)
    model.train()
    calls = []
    original = prompt_tree.prompt_tree_rows
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prompt_tree, "prompt_tree_rows", lambda *a, **k: calls.append(1) or original(*a, **k))
        assert_scored_like_one_unpadded_forward_per_sequence(model, share_prompts=True, prompt_tree=True)
    assert calls  # the tree ran, not the plain forward


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_a_windowed_model_keeps_the_two_pass_forward_and_says_why(architecture):
    """A sliding window or a chunk is a mask transformers builds itself; a custom mask would replace it."""
    model = build_tiny(*ARCHITECTURES[architecture][:2], {**TINY, **ARCHITECTURES[architecture][2]})
    refusal = prompt_tree_refusal(model)
    assert refusal is not None and refusal.startswith(model.config.model_type)
    assert "sliding" in refusal
    assert not probe_passes(model)


def test_a_kernel_without_a_dense_mask_is_refused():
    model = build("llama")
    model.config._attn_implementation = "flex_attention"
    assert prompt_tree_refusal(model) == "llama runs flex_attention attention, which takes no dense mask"


def test_the_probe_refuses_a_mask_that_lets_siblings_see_each_other(monkeypatch):
    """The probe compares the tree with the plain forward on the model itself: a mask that lets every position
    attend to every earlier one (siblings included) is caught, whatever the config says."""
    model = build("llama")
    assert probe_passes(model)
    monkeypatch.setattr(prompt_tree, "model_mask", lambda attends, implementation, dtype: _causal(attends))
    problem = prompt_tree.prompt_tree_problem(model, _scorer(model))
    assert problem is not None and problem.startswith("llama scores the prompt tree")


def test_the_sibling_leak_test_catches_a_leak_below_any_tolerance():
    """A score that moves a completion by 1e-7 when a sibling's tokens change passes any tolerance of rounding,
    not the bitwise test."""
    model = build("llama")
    score = _scorer(model)

    def leaky(input_ids, labels, mask, layout):
        values = score(input_ids, labels, mask, layout)
        return values + 1e-7 * (labels.sum() % 7) if layout == "tree" else values

    batch = tokenize_prompt_and_output_ids(*group_batch(), pad_token_id=0)
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        firsts = [0, 3]  # group_batch: each prompt's first completion
        assert prompt_tree._sibling_leak(score, batch["input_ids"], batch["labels"], mask, 97, firsts) is None
        leak = prompt_tree._sibling_leak(leaky, batch["input_ids"], batch["labels"], mask, 97, firsts)
    assert leak is not None and leak.startswith("moved completion ") and "when completion 0's tokens" in leak


def _causal(attends: torch.Tensor) -> torch.Tensor:
    width = attends.shape[-1]
    return torch.ones((width, width), dtype=torch.bool).tril().expand_as(attends)


def _scorer(model: torch.nn.Module):
    def score(input_ids, labels, mask, layout):
        return response_log_probs(
            model,
            input_ids,
            labels,
            mask,
            logits_chunk_tokens=0,
            share_prompts=layout != "plain",
            prompt_tree=layout == "tree",
        )["log_probs"][mask]

    return score


@pytest.mark.parametrize("row_tokens", [None, 12, 1], ids=["one_row", "rows_of_12", "a_row_per_prompt"])
def test_the_rows_hold_each_prompt_once_and_every_completion_without_padding(row_tokens):
    """Whatever the row width: each prompt's tokens appear once, every completion input once, a completion's
    positions continue its prompt's, and it attends to its prompt and its own earlier tokens only."""
    prompt_ids, completions = group_batch()  # prompts of 9 and 6 tokens, 3 completions each of 1 to 7 tokens
    batch = tokenize_prompt_and_output_ids(prompt_ids, completions, pad_token_id=0)
    tree = prompt_tree_rows(batch["input_ids"], batch["labels"], batch["response_mask"], lambda lengths: row_tokens)
    real = 9 + 6 + sum(len(c) - 1 for c in completions)
    assert int((tree.attends[:, 0].diagonal(dim1=1, dim2=2)).sum()) == tree.input_ids.numel()  # all see themselves
    assert tree.index.numel() == sum(map(len, completions))
    if row_tokens is None:
        assert tree.input_ids.shape == (1, real)
    flat_ids, flat_positions = tree.input_ids.flatten(), tree.position_ids.flatten()
    attends = torch.block_diag(*tree.attends[:, 0])  # (R * L, R * L): rows cannot see each other anyway
    offset = 0
    for row, (prompt, completion) in enumerate(zip(prompt_ids, completions, strict=True)):
        where = tree.index[offset : offset + len(completion)]
        offset += len(completion)
        inputs = where[1:]  # the completion's own input positions (the first token is predicted by the prompt)
        assert flat_ids[where[0]] == prompt[-1] and flat_positions[where[0]] == len(prompt) - 1
        assert flat_ids[inputs].tolist() == completion[:-1]
        assert flat_positions[inputs].tolist() == list(range(len(prompt), len(prompt) + len(completion) - 1))
        for position in inputs.tolist():
            seen = attends[position].nonzero().flatten()
            # its prompt (the len(prompt) positions ending at where[0]) and its own tokens up to here
            expected = list(range(int(where[0]) - len(prompt) + 1, int(where[0]) + 1))
            expected += [p for p in inputs.tolist() if p <= position]
            assert seen.tolist() == expected, row


def test_hidden_states_equal_the_plain_forward_at_every_row_width():
    model = build("llama")
    model.eval()
    batch = tokenize_prompt_and_output_ids(*group_batch(), pad_token_id=0)
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        plain = model.model(input_ids=batch["input_ids"]).last_hidden_state[mask]
        for row_tokens in (None, 12, 1):
            tree = prompt_tree_hidden(
                model, model.model, batch["input_ids"], batch["labels"], mask, lambda lengths, r=row_tokens: r
            )
            torch.testing.assert_close(tree, plain, atol=1e-5, rtol=1e-5)


def _learner(tmp_path, monkeypatch, model, overrides=()):
    import grpo_cli.learner.learner

    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=96)
    monkeypatch.setattr(grpo_cli.learner.learner, "build_policy", lambda model_cfg, device: (model, tokenizer))
    cfg = compose_config(["debug=smoke", "model.mixed_precision=no", *overrides], str(tmp_path))
    return grpo_cli.learner.learner.Learner(cfg, tmp_path)


def _long_tailed_data() -> RolloutData:
    """Two prompts x 3 completions of 1 to 12 tokens, rewards that vary (so every row has a gradient)."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [14, 15, 16, 17, 18, 19]]
    completions = [[20, 21, 22, 40, 41, 42, 43, 44, 45, 46, 47, 48], [23], [24, 25, 26], [30, 31], [32, 33], [39]]
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 0.25])
    return RolloutData([prompts[i // 3] for i in range(6)], completions, rewards, rewards - rewards.mean())


def test_the_learner_trains_the_same_parameters_through_the_tree_and_counts_no_completion_padding(
    tmp_path, monkeypatch
):
    """Two optimizer steps with the tree equal the two-pass shared forward's parameters (fp32); the tree's
    perf/padding_frac is that of its rows (R x L positions), below the two-pass forward's."""
    data = _long_tailed_data()
    overrides = [
        "train.rollout_batch_size=6",
        "train.group_size=3",
        "train.train_batch_size=6",
        "train.gradient_accumulation_steps=1",
    ]
    results = {}
    for tree in (True, False):
        model = build("llama")  # seeded: the same weights for both arms
        learner = _learner(
            tmp_path / str(tree), monkeypatch, model, [*overrides, "train.gradient_accumulation_steps=1"]
        )
        assert learner.scoring.share_prompts and learner.scoring.prompt_tree
        learner.scoring = dataclasses.replace(learner.scoring, prompt_tree=tree)
        metrics = [learner.update(data, step=step) for step in (1, 2)]
        results[tree] = (metrics, {n: p.detach().clone() for n, p in model.named_parameters()})
    (tree_metrics, tree_params), (two_pass_metrics, two_pass_params) = results[True], results[False]
    for name, value in two_pass_params.items():
        torch.testing.assert_close(tree_params[name], value, atol=1e-6, rtol=1e-6, msg=name)
    assert any((tree_params[n] != build("llama").state_dict()[n]).any() for n in tree_params)  # it trained
    batch = make_microbatch(data, list(range(6)), 0, torch.device("cpu"))
    rows = prompt_tree_rows(batch["input_ids"], batch["labels"], batch["response_mask"], lambda lengths: None)
    real = 9 + 6 + sum(len(c) - 1 for c in data.completion_ids)
    assert tree_metrics[0]["perf/padding_frac"] == pytest.approx(1 - real / rows.input_ids.numel())
    assert tree_metrics[0]["perf/padding_frac"] < two_pass_metrics[0]["perf/padding_frac"]
    assert tree_metrics[0]["throughput/train_tokens"] == two_pass_metrics[0]["throughput/train_tokens"]


def test_a_refused_model_keeps_the_two_pass_forward_with_one_log_line(tmp_path, monkeypatch, caplog):
    import grpo_cli.batch.forward

    monkeypatch.setattr(grpo_cli.batch.forward, "_REFUSALS_LOGGED", set())
    model = build_tiny(*ARCHITECTURES["mistral"][:2], {**TINY, **ARCHITECTURES["mistral"][2]})
    with caplog.at_level(logging.WARNING, logger="grpo_cli.batch.forward"):
        learners = [_learner(tmp_path, monkeypatch, model) for _ in range(2)]
    assert [(learner.scoring.share_prompts, learner.scoring.prompt_tree) for learner in learners] == [(True, False)] * 2
    lines = [record.getMessage() for record in caplog.records if "prompt tree" in record.getMessage()]
    assert lines == [
        "train: no prompt tree for this model (mistral declares sliding_window=4); the shared-prompt forward "
        "pads the completions instead (same log-probs, more compute)"
    ]


def test_the_tree_takes_packings_place_where_packing_would_beat_the_two_pass_forward():
    """Long-tailed completions make the two-pass forward mostly padding, so packing wins there; the tree computes
    packing's positions less the repeated prompts, so it is taken whether packing is on or not."""
    from grpo_cli.batch.forward import shares_in_forward, tokens_through_model

    prompt = list(range(1, 41))
    long_tail = RolloutData([prompt] * 4, [[5] * 60, [5] * 2, [5] * 3, [5] * 2], torch.zeros(4), torch.zeros(4))
    rows = [0, 1, 2, 3]
    assert not shares_in_forward(long_tail, rows, share_prompts=True, pack_sequences=True)
    assert shares_in_forward(long_tail, rows, share_prompts=True, pack_sequences=True, prompt_tree=True)
    assert tokens_through_model(long_tail, rows, True, pack_sequences=True, prompt_tree=True) == 40 + 67
