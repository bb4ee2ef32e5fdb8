"""Chunked response log-probs (grpo_cli/core/chunked_logprobs.py) equal the unchunked path: log-probs, entropies,
the GRPO loss and every parameter's gradient, for every head the scorer supports."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from grpo_cli.core import grpo_microbatch_train_step, response_log_probs, tokenize_prompt_and_output_ids
from grpo_cli.core import logprobs as logprobs_module
from grpo_cli.core.chunked_logprobs import chunked_label_log_probs
from grpo_cli.models import apply_lora
from tests.conftest import TINY_LM_CONFIG, random_weights, tiny_head_lm


def batch():
    # Two prompts, G = 2 completions each; one completion is empty (no response token at all); 13 response
    # tokens in all, which chunks of 1, 4 and 5 do not divide evenly (1 does, trivially).
    prompts = [[5, 6, 7], [5, 6, 7], [11, 12], [11, 12]]
    completions = [[20, 21, 22, 23, 24], [], [30, 31, 32, 33], [40, 41, 42, 43]]
    return tokenize_prompt_and_output_ids(prompts, completions, pad_token_id=0)


def score_and_backward(model, chunk_tokens: int, share_prompts: bool = False, temperature: float = 0.7):
    """Log-probs, entropies, the GRPO-Clip loss and every parameter's gradient, with `chunk_tokens`."""
    data = batch()
    model.zero_grad(set_to_none=True)
    out = response_log_probs(
        model,
        data["input_ids"],
        data["labels"],
        data["response_mask"],
        return_token_entropy=True,
        temperature=temperature,
        share_prompts=share_prompts,
        logits_chunk_tokens=chunk_tokens,
    )
    mask = data["response_mask"]
    advantages = torch.tensor([[1.0], [-0.5], [0.25], [-1.0]])
    loss, _ = grpo_microbatch_train_step(
        out["log_probs"],
        mask,
        gradient_accumulation_steps=1,
        loss_type="grpo_clip",
        advantages=advantages,
        old_log_probs=out["log_probs"].detach() + 0.1 * mask,  # ratios away from 1, some of them clipped
        cliprange=0.2,
    )
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out["log_probs"].detach(), out["token_entropy"], loss.detach(), grads


def assert_same(chunked, unchunked, atol=1e-5, rtol=1e-4):
    (log_probs, entropy, loss, grads), (ref_log_probs, ref_entropy, ref_loss, ref_grads) = chunked, unchunked
    torch.testing.assert_close(log_probs, ref_log_probs, atol=atol, rtol=rtol)
    torch.testing.assert_close(entropy, ref_entropy, atol=atol, rtol=rtol)
    torch.testing.assert_close(loss, ref_loss, atol=atol, rtol=rtol)
    assert set(grads) == set(ref_grads) and ref_grads
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=atol, rtol=rtol, msg=name)


@pytest.fixture(params=["linear_backward", "checkpointed"])
def chunk_path(request, monkeypatch):
    """Both chunked paths: the hand-written backward of a plain Linear head, and the autograd one through
    torch.utils.checkpoint that any other head (LoRA, quantized) takes."""
    if request.param == "checkpointed":
        monkeypatch.setattr(logprobs_module, "linear_head", lambda model: None)
    return request.param


@pytest.mark.parametrize("architecture", ["llama_tied", "llama_untied", "gemma2_softcap", "cohere_scale"])
def test_chunked_equals_unchunked_values_loss_and_every_gradient(architecture, chunk_path):
    model = tiny_head_lm(architecture)
    unchunked = score_and_backward(model, 0)
    assert unchunked[0][batch()["response_mask"]].abs().min() > 0  # real log-probs, not zeros
    for chunk_tokens in (1, 4, 5, 64):
        assert_same(score_and_backward(model, chunk_tokens), unchunked)


def test_chunked_equals_unchunked_with_shared_prompts(chunk_path):
    model = tiny_head_lm("llama_tied")
    assert_same(score_and_backward(model, 4, share_prompts=True), score_and_backward(model, 0, share_prompts=True))


def test_chunked_equals_unchunked_with_lora_on_the_lm_head():
    model = apply_lora(tiny_head_lm("llama_untied"), r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "lm_head"])
    random_weights(model, seed=None, only="lora_B")  # LoRA's B starts at zero; make the adapters matter
    assert logprobs_module.linear_head(model) is None  # a LoRA-wrapped head takes the checkpointed path
    unchunked = score_and_backward(model, 0)
    assert any("lm_head" in name and "lora" in name for name in unchunked[3])
    assert_same(score_and_backward(model, 5), unchunked)


def test_chunked_equals_unchunked_under_bf16_autocast(chunk_path):
    model = tiny_head_lm("gemma2_softcap")
    results = []
    for chunk_tokens in (0, 4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(score_and_backward(model, chunk_tokens))
    assert results[0][0].dtype == torch.float32  # the log-softmax ran in float32
    # Same bf16 matmuls chunk by chunk as whole, so the same numbers up to bf16 accumulation order.
    assert_same(results[1], results[0], atol=2e-2, rtol=2e-2)


def test_chunked_equals_unchunked_with_half_precision_weights(chunk_path):
    # model.dtype=bfloat16 without autocast: the hand-written backward's matmuls run in the weight's dtype (it
    # multiplied float32 gradients by the bf16 weight and stopped with a dtype error before).
    model = tiny_head_lm("llama_tied").to(torch.bfloat16)
    chunked, unchunked = score_and_backward(model, 4), score_and_backward(model, 0)
    assert unchunked[3]["model.embed_tokens.weight"].dtype == torch.bfloat16  # tied to the head
    assert_same(chunked, unchunked, atol=2e-2, rtol=2e-2)


def test_a_head_with_a_bias_and_no_entropy_asked_equals_unchunked(chunk_path):
    # The hand-written backward keeps the forward's log Z for its softmax and reuses one logits buffer across
    # chunks; without entropies the forward exponentiates in place: all of it against autograd's unchunked path.
    model = tiny_head_lm("llama_untied")
    model.lm_head = torch.nn.Linear(TINY_LM_CONFIG["hidden_size"], TINY_LM_CONFIG["vocab_size"], bias=True)
    with torch.no_grad():
        model.lm_head.bias.normal_(0, 0.5)
    data = batch()
    results = []
    for chunk_tokens in (0, 4):
        model.zero_grad(set_to_none=True)
        out = response_log_probs(
            model, data["input_ids"], data["labels"], data["response_mask"], logits_chunk_tokens=chunk_tokens
        )
        assert set(out) == {"log_probs"}
        (out["log_probs"] * torch.linspace(-1, 2, out["log_probs"].numel()).view_as(out["log_probs"])).sum().backward()
        results.append((out["log_probs"].detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (chunked, chunked_grads), (unchunked, unchunked_grads) = results[1], results[0]
    torch.testing.assert_close(chunked, unchunked, atol=1e-5, rtol=1e-4)
    assert unchunked_grads["lm_head.bias"].abs().sum() > 0
    for name, grad in unchunked_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_no_grad_passes_are_chunked_too_and_equal(chunk_path):
    model = tiny_head_lm("llama_tied").eval()
    data = batch()
    with torch.inference_mode():
        full = response_log_probs(
            model, data["input_ids"], data["labels"], data["response_mask"], logits_chunk_tokens=0
        )
        chunked = response_log_probs(
            model, data["input_ids"], data["labels"], data["response_mask"], logits_chunk_tokens=3
        )
    torch.testing.assert_close(chunked["log_probs"], full["log_probs"], atol=1e-5, rtol=1e-5)


def test_no_chunk_holds_more_rows_than_asked():
    seen = []

    def score(hidden, labels, want_entropy):
        seen.append(hidden.shape[0])
        return hidden.pow(2).sum(dim=1), None  # pow keeps its input for backward: a chunk to recompute

    hidden = torch.randn(13, 4, requires_grad=True)
    out = chunked_label_log_probs(hidden, torch.zeros(13, dtype=torch.long), score, chunk_tokens=5)
    out["log_probs"].sum().backward()
    # forward 5, 5, 3; then the backward recomputes each chunk once
    assert seen[:3] == [5, 5, 3] and sorted(seen[3:]) == [3, 5, 5]
    torch.testing.assert_close(hidden.grad, 2 * hidden.detach())
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_label_log_probs(hidden, torch.zeros(13, dtype=torch.long), score, chunk_tokens=0)


class _ShapeRecorder(TorchDispatchMode):
    """Records the shape of every tensor an op returns while it is active (forward or backward)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def test_no_tensor_of_more_than_a_chunk_of_tokens_by_the_vocabulary_exists_in_either_pass(chunk_path):
    model, data, vocab, chunk_tokens = tiny_head_lm("llama_tied"), batch(), TINY_LM_CONFIG["vocab_size"], 4
    scored = int(data["response_mask"].sum())  # 13 response tokens, more than a chunk, fewer than hidden_size

    def too_large(shapes):  # any tensor with a vocabulary dimension and another one longer than a chunk
        return [s for s in shapes if vocab in s and any(chunk_tokens < d <= scored for d in s if d != vocab)]

    for chunk, expect_large in ((0, True), (chunk_tokens, False)):
        model.zero_grad(set_to_none=True)
        with _ShapeRecorder() as forward:
            out = response_log_probs(
                model, data["input_ids"], data["labels"], data["response_mask"], True, logits_chunk_tokens=chunk
            )
        with _ShapeRecorder() as backward:
            out["log_probs"].sum().backward()
        assert bool(too_large(forward.shapes)) is expect_large, too_large(forward.shapes)
        assert bool(too_large(backward.shapes)) is expect_large, too_large(backward.shapes)
        assert model.lm_head.weight.grad is not None


def test_the_backward_recomputes_every_chunk_but_the_last_and_a_retained_graph_twice():
    # The forward keeps the last chunk's softmax, so a one-chunk batch recomputes nothing and a batch of chunks
    # 4, 4, 4, 1 recomputes the three 4-row chunks only; a second backward through a retained graph recomputes
    # everything and gives the same gradients.
    model, data, vocab = tiny_head_lm("llama_untied"), batch(), TINY_LM_CONFIG["vocab_size"]

    class MatmulShapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.rows_by_vocab = []  # rows of every (rows, vocabulary) matmul output: the head's logits

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm) and out.shape[-1] == vocab:
                self.rows_by_vocab.append(out.shape[0])
            return out

    for chunk, recomputed in ((64, []), (4, [4, 4, 4])):
        model.zero_grad(set_to_none=True)
        out = response_log_probs(
            model, data["input_ids"], data["labels"], data["response_mask"], True, logits_chunk_tokens=chunk
        )
        loss = (out["log_probs"] * torch.linspace(-1, 1, out["log_probs"].numel()).view_as(out["log_probs"])).sum()
        with MatmulShapes() as first:
            loss.backward(retain_graph=True)
        assert first.rows_by_vocab == recomputed
        once = {name: p.grad.clone() for name, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        with MatmulShapes() as second:
            loss.backward()
        assert sorted(second.rows_by_vocab) == sorted(recomputed + [13 - sum(recomputed)])
        # To 1e-5 of each tensor's scale: the kept softmax and its recomputation round differently in the last
        # bits (exp(logits - log Z) against the forward's log-softmax; 2.6e-6 of a 4.6 scale on an AVX-512 CPU).
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, once[name], atol=1e-5 * float(once[name].abs().max()), rtol=0, msg=name)


def test_an_all_empty_batch_scores_nothing_and_keeps_the_head_in_the_graph(chunk_path):
    model = tiny_head_lm("llama_untied")
    data = tokenize_prompt_and_output_ids([[5, 6], [7, 8]], [[], []], pad_token_id=0)
    for chunk_tokens in (0, 4):
        model.zero_grad(set_to_none=True)
        out = response_log_probs(
            model, data["input_ids"], data["labels"], data["response_mask"], logits_chunk_tokens=chunk_tokens
        )
        assert (out["log_probs"] == 0).all()
        out["log_probs"].sum().backward()
        assert (model.lm_head.weight.grad == 0).all()


def test_the_configs_default_is_the_cores_and_a_negative_chunk_is_refused():
    from grpo_cli.config import validate_config
    from grpo_cli.core import LOGITS_CHUNK_TOKENS
    from grpo_cli.errors import UserFacingError
    from tests.conftest import compose_config

    cfg = compose_config([])
    assert cfg.train.logits_chunk_tokens == LOGITS_CHUNK_TOKENS  # the config's literal (it imports no torch)
    with pytest.raises(UserFacingError, match="logits_chunk_tokens"):
        validate_config(compose_config(["train.logits_chunk_tokens=-1"]))
