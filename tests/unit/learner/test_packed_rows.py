"""train.pack_sequences in the learner: decided once by the probe for every pass (training, old and reference
log-probs), the same log-probs as one unpadded forward per sequence, and a model the probe refuses stays padded
with one log line."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from grpo_cli.batch.forward import shares_in_forward, tokens_through_model
from grpo_cli.batch.rollout_data import RolloutData
from tests.conftest import compose_config
from tests.unit.core.test_prompt_sharing_architectures import REFUSED
from tests.unit.core.test_sliding_window_logprobs import (  # noqa: F401 - _one_thread is an autouse fixture
    TINY,
    _one_thread,
    build_tiny,
    group_batch,
    one_row_log_probs,
)


@pytest.mark.parametrize("architecture", ["llama", "lfm2"])
def test_the_learner_packs_where_the_probe_passes_and_says_why_not(architecture, tmp_path, monkeypatch, caplog):
    import grpo_cli.batch.forward
    import grpo_cli.learner.learner

    if architecture == "llama":
        model = build_tiny("LlamaForCausalLM", "LlamaConfig", TINY)
    else:
        model = build_tiny(*REFUSED[architecture])
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=96)
    monkeypatch.setattr(grpo_cli.learner.learner, "build_policy", lambda model_cfg, device: (model, tokenizer))
    monkeypatch.setattr(grpo_cli.batch.forward, "_REFUSALS_LOGGED", set())
    overrides = ["debug=smoke", "model.mixed_precision=no", "rollout.temperature=1.0", "train.pack_sequences=true"]
    cfg = compose_config([*overrides, "train.share_prompt_forward=false"], str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="grpo_cli.batch.forward"):
        learners = [grpo_cli.learner.learner.Learner(cfg, tmp_path) for _ in range(2)]
    refused = architecture != "llama"
    assert [learner.scoring.pack_sequences for learner in learners] == [not refused] * 2
    lines = [record.getMessage() for record in caplog.records if "packed rows" in record.getMessage()]
    assert len(lines) == refused  # once per process, however many learners
    if refused:
        assert lines[0].startswith(f"train: no packed rows for this model ({architecture} scores packed rows")

    prompts, completions = group_batch()
    rows = [0, 1, 3, 4]  # two prompts, two completions each: the train batch (debug=smoke)
    prompts, completions = [prompts[i] for i in rows], [completions[i] for i in rows]
    data = RolloutData(
        prompts, completions, raw_rewards=torch.tensor([1.0, 0.0] * 2), advantages=torch.tensor([0.5, -0.5] * 2)
    )
    learner = learners[0]
    scored = learner.log_probs_under(learner.inference_model, data)  # the old / reference pass
    with torch.no_grad():
        expected = one_row_log_probs(model, data.prompt_ids, data.completion_ids)
    torch.testing.assert_close(torch.cat(scored), expected, atol=1e-5, rtol=1e-5)
    metrics = learner.update(data, step=1)  # the training forward
    assert metrics["train/nonfinite_skipped"] == 0
    assert metrics["throughput/train_tokens"] == sum(map(len, prompts)) + sum(map(len, completions))


def test_pack_and_share_count_the_layout_each_microbatch_takes():
    """With both on, a microbatch of long-tailed completions is packed (every prompt counted), one of equal
    completions under a long prompt shares it (the prompt counted once)."""
    prompt = list(range(1, 41))
    long_tail = RolloutData([prompt] * 4, [[5] * 60, [5] * 2, [5] * 3, [5] * 2], torch.zeros(4), torch.zeros(4))
    equal = RolloutData([prompt] * 4, [[5] * 6] * 4, torch.zeros(4), torch.zeros(4))
    rows = [0, 1, 2, 3]
    assert tokens_through_model(long_tail, rows, share_prompts=True, pack_sequences=True) == 4 * 40 + 67
    assert tokens_through_model(long_tail, rows, share_prompts=True, pack_sequences=False) == 40 + 67
    assert tokens_through_model(equal, rows, share_prompts=True, pack_sequences=True) == 40 + 24
    # The layout each one takes, as perf/padding_frac counts it (packed rows or the shared-prompt forward).
    assert not shares_in_forward(long_tail, rows, share_prompts=True, pack_sequences=True)
    assert shares_in_forward(long_tail, rows, share_prompts=True, pack_sequences=False)
    assert shares_in_forward(equal, rows, share_prompts=True, pack_sequences=True)
    assert not shares_in_forward(equal, [0], share_prompts=True, pack_sequences=False)  # no prompt repeats
