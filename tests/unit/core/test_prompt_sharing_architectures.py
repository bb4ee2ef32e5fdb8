"""The shared-prompt forward (`train.share_prompt_forward`, grpo_cli/core/prompt_sharing.py) serves a model only
where it scores it exactly, and every model scores the same log-probs and gradients as one unpadded forward per
sequence either way.

It serves full, sliding-window (tests/unit/core/test_sliding_window_logprobs.py) and chunked attention (Llama 4, below).
Every architecture of the installed transformers with other layer kinds gets a tiny random config here, with at
least one such layer beside an attention layer where the architecture has both: linear attention, convolutions,
Mamba / SSM blocks and their hybrids, recurrent blocks (RWKV, xLSTM, RecurrentGemma), indexed (DeepSeek sparse
attention) and compressed attention. The shared path crashed on them or scored them wrong (Mamba-2 by 2.6 nats,
RWKV by 6.7, silently); they take the plain forward, decided once from the model (`prompt_sharing_problem`), by
`response_log_probs` for any caller and by the learner for all its passes, with one log line.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import transformers

from grpo_cli.batch.rollout_data import RolloutData
from grpo_cli.core.prompt_sharing import prompt_sharing_problem
from tests.conftest import compose_config
from tests.unit.core.test_sliding_window_logprobs import (  # noqa: F401 - _one_thread is an autouse fixture
    TINY,
    _one_thread,
    assert_scored_like_one_unpadded_forward_per_sequence,
    build_tiny,
    group_batch,
    one_row_log_probs,
)

HYBRID = ["linear_attention", "full_attention"]  # transformers 5's layer kinds: one of each
LINEAR_ATTENTION = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
MAMBA = dict(mamba_d_state=8, mamba_d_conv=4, mamba_expand=2)
MAMBA2_HEADS = dict(mamba_n_heads=4, mamba_d_head=16, mamba_chunk_size=4)  # SSM chunks shorter than the rows
NO_ATTENTION = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, pad_token_id=0)
# DeepSeek-style multi-head latent attention; the indexers pick at least as many keys as a row has (their top-k
# below the length makes transformers' own forward depend on the padding after a token).
SPARSE_MLA = dict(
    kv_lora_rank=8,
    q_lora_rank=8,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_group=1,
    topk_group=1,
    index_topk=64,
    index_head_dim=16,
    index_n_heads=2,
)
TWO_KV_HEADS = {**TINY, "num_key_value_heads": 2}

# The models the shared forward refuses: (transformers model class, config class, config keys), by model type.
REFUSED = {
    "qwen3_next": (
        "Qwen3NextForCausalLM",
        "Qwen3NextConfig",
        dict(**TINY, **LINEAR_ATTENTION, **MOE, layer_types=HYBRID),
    ),
    "qwen3_5_text": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(**TINY, **LINEAR_ATTENTION, layer_types=HYBRID)),
    "qwen3_5_moe_text": (
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeTextConfig",
        dict(**TINY, **LINEAR_ATTENTION, **MOE, layer_types=HYBRID),
    ),
    "qwen4_exp_text": (
        "Qwen4ExpForCausalLM",
        "Qwen4ExpTextConfig",
        dict(
            **TINY,
            **LINEAR_ATTENTION,
            **MOE,
            layer_types=HYBRID,  # its full attention is indexed attention
            hc_count=2,
            hc_lowrank=8,
            ngram_vocab_size_base=97,
            split_ngram_parts=1,
            indexer_n_heads=2,
            indexer_kv_heads=1,
            indexer_head_dim=16,
            indexer_budget=64,
            indexer_compress_ratio=4,
        ),
    ),
    "olmo_hybrid": ("OlmoHybridForCausalLM", "OlmoHybridConfig", dict(**TINY, **LINEAR_ATTENTION, layer_types=HYBRID)),
    "kimi_linear": (
        "KimiLinearForCausalLM",
        "KimiLinearConfig",
        dict(
            **TWO_KV_HEADS,
            layer_types=HYBRID,
            linear_head_dim=8,
            linear_num_heads=2,
            kv_lora_rank=8,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        ),
    ),
    "minimax": (
        "MiniMaxForCausalLM",
        "MiniMaxConfig",
        dict(**TINY, layer_types=HYBRID, block_size=4, num_local_experts=4, num_experts_per_tok=2),
    ),
    "lfm2": ("Lfm2ForCausalLM", "Lfm2Config", dict(**TINY, layer_types=["conv", "full_attention"])),
    "lfm2_moe": (
        "Lfm2MoeForCausalLM",
        "Lfm2MoeConfig",
        dict(
            **TINY,
            layer_types=["conv", "full_attention"],
            num_dense_layers=1,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        ),
    ),
    "jamba": (
        "JambaForCausalLM",
        "JambaConfig",
        dict(
            **TINY,
            **MAMBA,
            attn_layer_period=2,  # layer 1 attention, layer 0 Mamba
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
            mamba_dt_rank=4,
            use_mamba_kernels=False,
        ),
    ),
    "bamba": ("BambaForCausalLM", "BambaConfig", dict(**TINY, **MAMBA, **MAMBA2_HEADS, attn_layer_indices=[1])),
    # Every Falcon-H1 layer runs attention and Mamba-2 side by side; its forward scales the LM head's output.
    "falcon_h1": (
        "FalconH1ForCausalLM",
        "FalconH1Config",
        dict(**TINY, **MAMBA, **MAMBA2_HEADS, mamba_d_ssm=64, lm_head_multiplier=0.5),
    ),
    "granitemoehybrid": (
        "GraniteMoeHybridForCausalLM",
        "GraniteMoeHybridConfig",
        dict(
            **TINY,
            **MAMBA,
            **MAMBA2_HEADS,
            layer_types=["mamba", "attention"],
            num_local_experts=4,
            shared_intermediate_size=32,
        ),
    ),
    "nemotron_h": (
        "NemotronHForCausalLM",
        "NemotronHConfig",
        dict(
            **TINY,
            layers_block_type=["mamba", "attention"],
            ssm_state_size=8,
            mamba_num_heads=4,
            mamba_head_dim=16,
            n_groups=1,
            chunk_size=4,
            use_mamba_kernels=False,
        ),
    ),
    # Zamba: layers 0, 1 Mamba, 2, 3 Mamba with the shared attention block (it needs two to share it).
    "zamba": (
        "ZambaForCausalLM",
        "ZambaConfig",
        dict(
            **{**TINY, "num_hidden_layers": 4},
            **MAMBA,
            attn_layer_period=1,
            attn_layer_offset=0,
            n_mamba_heads=2,
            mamba_dt_rank=4,
            use_mamba_kernels=False,
        ),
    ),
    "zamba2": (
        "Zamba2ForCausalLM",
        "Zamba2Config",
        dict(
            **TINY,
            **MAMBA,
            layers_block_type=["mamba", "hybrid"],
            n_mamba_heads=4,
            chunk_size=4,
            use_mamba_kernels=False,
        ),
    ),
    "zaya": (
        "ZayaForCausalLM",
        "ZayaConfig",
        dict(**TINY, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=32, router_hidden_size=16),
    ),
    "mamba": (
        "MambaForCausalLM",
        "MambaConfig",
        dict(**NO_ATTENTION, state_size=8, time_step_rank=4, use_mambapy=False),
    ),
    "falcon_mamba": (
        "FalconMambaForCausalLM",
        "FalconMambaConfig",
        dict(**NO_ATTENTION, state_size=8, time_step_rank=4),
    ),
    "mamba2": (
        "Mamba2ForCausalLM",
        "Mamba2Config",
        dict(**NO_ATTENTION, num_heads=4, head_dim=16, state_size=8, n_groups=1, chunk_size=4),
    ),
    "rwkv": (
        "RwkvForCausalLM",
        "RwkvConfig",
        dict(**NO_ATTENTION, context_length=64, attention_hidden_size=32, intermediate_size=64),
    ),
    # xLSTM's forward soft-caps the logits (output_logit_soft_cap=30); its kernel chunk is longer than the rows
    # (transformers 4.57's fails on a sequence longer than one chunk).
    "xlstm": (
        "xLSTMForCausalLM",
        "xLSTMConfig",
        dict(**{**NO_ATTENTION, "hidden_size": 64}, num_heads=2, qk_dim_factor=1.0, chunk_size=64),
    ),
    # RecurrentGemma's forward soft-caps the logits (logits_soft_cap=30).
    "recurrent_gemma": (
        "RecurrentGemmaForCausalLM",
        "RecurrentGemmaConfig",
        dict(**TINY, lru_width=32, attention_window_size=64, block_types=["recurrent", "attention"]),
    ),
    "deepseek_v32": (
        "DeepseekV32ForCausalLM",
        "DeepseekV32Config",
        dict(**TWO_KV_HEADS, **SPARSE_MLA, first_k_dense_replace=1),
    ),
    "glm_moe_dsa": (
        "GlmMoeDsaForCausalLM",
        "GlmMoeDsaConfig",
        dict(**TWO_KV_HEADS, **SPARSE_MLA, first_k_dense_replace=1),
    ),
    "axk2": (
        "AXK2ForCausalLM",
        "AXK2Config",
        dict(**TWO_KV_HEADS, **SPARSE_MLA, first_k_dense_replace=1, gated_norm_rank=4),
    ),
    "hy_v4": ("HYV4ForCausalLM", "HYV4Config", dict(**TWO_KV_HEADS, **SPARSE_MLA, hc_mult=2)),
    "deepseek_v4": (
        "DeepseekV4ForCausalLM",
        "DeepseekV4Config",
        dict(
            **TINY,
            q_lora_rank=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            index_topk=64,
            index_head_dim=16,
            index_n_heads=2,
            o_groups=1,
            o_lora_rank=8,
            hc_mult=2,
            sliding_window=4,
            num_nextn_predict_layers=0,
        ),
    ),
}

# Llama 4's text model: every layer chunked attention, chunks of 4 (shorter than every prompt).
LLAMA4 = (
    "Llama4ForCausalLM",
    "Llama4TextConfig",
    dict(**TINY, attention_chunk_size=4, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=64),
)

# transformers 4.x's Zamba2 scans its SSM chunks so that tokens after a position change its output (1.2 nats
# in logits here from 4 padding tokens), so no padded batch scores it like one row; fixed in 5.
_ZAMBA2_PADDING_BUG = pytest.mark.xfail(
    int(transformers.__version__.split(".")[0]) < 5,
    reason="transformers 4.x Zamba2: the output at a token depends on the padding after it",
    strict=True,
)


def build(architecture: str) -> torch.nn.Module:
    return build_tiny(*REFUSED[architecture])


@pytest.mark.parametrize(
    "architecture",
    [pytest.param(a, marks=_ZAMBA2_PADDING_BUG) if a == "zamba2" else a for a in REFUSED],
)
@pytest.mark.parametrize("share_prompts", [True, False], ids=["shared_prompt", "plain"])
def test_a_model_the_shared_forward_refuses_scores_like_one_unpadded_forward_per_sequence(architecture, share_prompts):
    model = build(architecture)
    problem = prompt_sharing_problem(model)
    assert problem is not None and problem.startswith(model.config.model_type)  # a layer kind it cannot serve
    assert_scored_like_one_unpadded_forward_per_sequence(model, share_prompts)


@pytest.mark.parametrize("share_prompts", [True, False], ids=["shared_prompt", "plain"])
def test_chunked_attention_scores_like_one_unpadded_forward_per_sequence(share_prompts):
    """transformers starts each row's chunks at its first real token (the left padding counted), so the shared
    forward serves chunked attention."""
    model = build_tiny(*LLAMA4)
    assert prompt_sharing_problem(model) is None
    assert_scored_like_one_unpadded_forward_per_sequence(model, share_prompts)


def test_the_chunks_are_active_in_the_tiny_llama4():
    """With chunks as long as the model's context, the same weights score differently: the test above tests
    chunks."""
    model_name, config_name, keys = LLAMA4
    chunked = build_tiny(model_name, config_name, keys)
    unchunked = build_tiny(model_name, config_name, {**keys, "attention_chunk_size": TINY["max_position_embeddings"]})
    unchunked.load_state_dict(chunked.state_dict())
    prompt_ids, completions = group_batch()
    with torch.no_grad():
        difference = one_row_log_probs(chunked, prompt_ids, completions) - one_row_log_probs(
            unchunked, prompt_ids, completions
        )
    assert difference.abs().max() > 1e-2


@pytest.mark.parametrize("architecture", ["lfm2", "llama"])
def test_the_learner_decides_once_for_all_its_passes_and_says_why(architecture, tmp_path, monkeypatch, caplog):
    """The learner's flag drives its training forward, its old / reference log-probs and its token counts: off
    for a model the shared forward refuses, with one log line naming the model type and the reason, however many
    learners a process builds."""
    import grpo_cli.batch.forward
    import grpo_cli.learner.learner

    if architecture == "llama":
        model = build_tiny("LlamaForCausalLM", "LlamaConfig", TINY)
    else:
        model = build(architecture)
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=96)
    monkeypatch.setattr(grpo_cli.learner.learner, "build_policy", lambda model_cfg, device: (model, tokenizer))
    monkeypatch.setattr(grpo_cli.batch.forward, "_REFUSALS_LOGGED", set())
    cfg = compose_config(["debug=smoke", "model.mixed_precision=no", "rollout.temperature=1.0"], str(tmp_path))
    assert cfg.train.share_prompt_forward and cfg.train.train_batch_size == 4
    with caplog.at_level(logging.WARNING, logger="grpo_cli.batch.forward"):
        learners = [grpo_cli.learner.learner.Learner(cfg, tmp_path) for _ in range(2)]
    refused = architecture != "llama"
    assert [learner.share_prompts for learner in learners] == [not refused] * 2
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == refused
    if refused:
        assert lines[0].startswith(f"train: no shared-prompt forward for this model ({architecture} has conv layers)")

    # Two prompts, two completions each: each microbatch (2 rows) repeats its prompt.
    prompts, completions = group_batch()
    rows = [0, 1, 3, 4]
    data = RolloutData(
        [prompts[i] for i in rows],
        [completions[i] for i in rows],
        raw_rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]),
        advantages=torch.tensor([0.5, -0.5, 0.5, -0.5]),
    )
    learner = learners[0]
    scored = learner.log_probs_under(learner.inference_model, data)  # the old / reference pass
    with torch.no_grad():
        expected = one_row_log_probs(model, data.prompt_ids, data.completion_ids)
    torch.testing.assert_close(torch.cat(scored), expected, atol=1e-5, rtol=1e-5)
    metrics = learner.update(data, step=1)  # the training forward
    assert metrics["train/nonfinite_skipped"] == 0
    prompt_tokens = sum(map(len, data.prompt_ids)) // (2 if learner.share_prompts else 1)
    assert metrics["throughput/train_tokens"] == prompt_tokens + sum(map(len, data.completion_ids))
