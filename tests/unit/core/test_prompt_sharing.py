"""Sharing a prompt's forward pass among its completions gives the plain forward's log-probs and gradients."""

from __future__ import annotations

import inspect
import warnings

import torch

from grpo_cli.core import prompt_sharing, response_log_probs, tokenize_prompt_and_output_ids
from grpo_cli.core.causal_lm import cache_keyword
from grpo_cli.core.prompt_sharing import distinct_prompts, shared_prompt_response_hidden, worth_sharing
from grpo_cli.models import TINY_RANDOM, load_policy


def group_batch():
    # Two prompts of different lengths, G = 3 completions each, completions of different lengths (incl. 1).
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    completions = [[20, 21, 22], [23], [24, 25, 26, 27, 28], [30, 31], [32, 33, 34, 35], [36]]
    prompt_ids = [prompts[i // 3] for i in range(6)]
    return tokenize_prompt_and_output_ids(prompt_ids, completions, pad_token_id=0), prompts


def test_distinct_prompts_reads_prompts_back_from_the_batch():
    batch, prompts = group_batch()
    found, rows, lengths = distinct_prompts(batch["input_ids"], batch["response_mask"])
    assert found == prompts
    assert rows == [0, 0, 0, 1, 1, 1] and lengths == [5, 5, 5, 3, 3, 3]
    assert worth_sharing(batch["input_ids"], batch["response_mask"])
    single = tokenize_prompt_and_output_ids([[1, 2], [3, 4]], [[5], [6]], pad_token_id=0)
    assert not worth_sharing(single["input_ids"], single["response_mask"])


def test_shared_prompt_forward_matches_the_plain_forward_values_and_gradients():
    model, _ = load_policy(TINY_RANDOM, torch.device("cpu"), torch.float32, seed=0)
    model.train()
    batch, _ = group_batch()
    results = []
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        mask = batch["response_mask"]
        out = response_log_probs(
            model, batch["input_ids"], batch["labels"], mask, return_token_entropy=True, share_prompts=share
        )
        log_probs, entropy = out["log_probs"], out["token_entropy"][mask.bool()].mean()
        weights = torch.linspace(-1, 1, log_probs.numel()).reshape(log_probs.shape)  # any non-uniform loss
        (log_probs * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((log_probs.detach(), entropy, grads))
    (plain, plain_entropy, plain_grads), (shared, shared_entropy, shared_grads) = results
    assert (plain[~batch["response_mask"]] == 0).all() and (shared[~batch["response_mask"]] == 0).all()
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared_entropy, plain_entropy, atol=1e-5, rtol=1e-5)
    assert set(shared_grads) == set(plain_grads)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    # The prompt-side weights got gradient through the shared keys/values (not only via the completions).
    assert plain_grads["model.embed_tokens.weight"][5].abs().sum() > 0
    assert shared_grads["model.embed_tokens.weight"][5].abs().sum() > 0


def test_tokens_through_model_counts_a_shared_prompt_once():
    from grpo_cli.batch.forward import tokens_through_model
    from grpo_cli.batch.rollout_data import RolloutData

    data = RolloutData(
        prompt_ids=[[1, 2, 3]] * 3 + [[4, 5]],
        completion_ids=[[9], [9, 9], [9, 9, 9], [9]],
        raw_rewards=torch.zeros(4),
        advantages=torch.zeros(4),
    )
    assert tokens_through_model(data, [0, 1, 2, 3], share_prompts=False) == 3 * 3 + 2 + 7
    assert tokens_through_model(data, [0, 1, 2, 3], share_prompts=True) == 3 + 2 + 7
    assert tokens_through_model(data, [0, 3], share_prompts=True) == 3 + 2 + 2  # nothing shared


class RenamedCacheKeyword(torch.nn.Module):
    """A decoder as transformers 5.24+ declares it, on any installed release: the cache comes as `cache`; the old
    `past_key_values` still works but warns (FutureWarning, stacklevel=2: reported at torch's module.py, as
    transformers' `deprecate_kwarg` reports it)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.passed: list[str] = []  # the keyword each call brought its cache by

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None, **kwargs):
        if "past_key_values" in kwargs:
            warnings.warn(
                "`past_key_values` is deprecated and will be removed in version 5.40.0 for RenamedCacheKeyword."
                "forward. Use `cache` instead.",
                FutureWarning,
                stacklevel=2,
            )
            cache = kwargs.pop("past_key_values")
            self.passed.append("past_key_values")
        elif cache is not None:
            self.passed.append("cache")
        inner_keyword = cache_keyword(self.inner)  # what the installed release's own decoder takes
        return self.inner(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            **{inner_keyword: cache},
            **kwargs,
        )


def shared_and_plain_hidden(decoder: torch.nn.Module, plain_decoder: torch.nn.Module):
    """(shared-prompt, plain) hidden states at group_batch's response positions, (N, H) each."""
    batch, _ = group_batch()
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        shared = shared_prompt_response_hidden(decoder, batch["input_ids"], batch["labels"], mask, pad_id=0)
        plain = plain_decoder(input_ids=batch["input_ids"]).last_hidden_state[mask]
    return shared, plain


def test_the_shared_forward_passes_the_cache_by_the_keyword_the_installed_release_declares():
    """On the installed transformers the decoder's forward declares the keyword chosen, and the shared forward
    runs without a deprecation warning of its own (transformers 5.24 to 5.39 warn on `past_key_values`)."""
    model, _ = load_policy(TINY_RANDOM, torch.device("cpu"), torch.float32, seed=0)
    decoder = model.get_decoder()
    assert cache_keyword(decoder) in inspect.signature(decoder.forward).parameters
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        shared, plain = shared_and_plain_hidden(decoder, decoder)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)
    # A forward that declares `cache` (transformers 5.24+) gets `cache`, whatever the installed release is.
    renamed = RenamedCacheKeyword(decoder)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        shared, plain = shared_and_plain_hidden(renamed, decoder)
    assert renamed.passed == ["cache", "cache"]  # the prompts' pass and the completions' pass
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)


def test_a_cache_keyword_the_forward_ignores_fails_the_equality(monkeypatch):
    """Why the equality above guards the keyword: the forwards take **kwargs, so a keyword transformers stops
    reading is swallowed without a word, the completions run without their prompt's cache, and the shared
    log-probs no longer match the plain forward's (or the forward fails on its mask's width)."""
    model, _ = load_policy(TINY_RANDOM, torch.device("cpu"), torch.float32, seed=0)
    decoder = model.get_decoder()
    monkeypatch.setattr(prompt_sharing, "cache_keyword", lambda module: "kv_cache_that_was_renamed")
    try:
        shared, plain = shared_and_plain_hidden(decoder, decoder)
    except (RuntimeError, ValueError, IndexError):
        return  # the completions' mask is wider than their input without the cache: an error fails the test too
    assert (shared - plain).abs().max() > 1e-2  # the completions scored without their prompt
