"""Multi-turn episodes in the learner: an episode's completion is every id after its prompt, its tool/environment
tokens are holes in the loss (RolloutData.token_masks). The learner's gradient equals one computed by hand with
those tokens' loss zeroed and the step's normalizers counting model tokens only, under every length normalization,
with and without the shared-prompt forward (the shared prompt is the episode's prompt) and train.mask_truncated."""

from __future__ import annotations

import pytest
import torch

from grpo_cli.batch.rollout_data import (
    RolloutData,
    concat_rollouts,
    make_microbatch,
    model_token_mask,
    select_completions,
)
from grpo_cli.learner.accounting import optimizer_step_totals
from grpo_cli.learner.settings import default_length_constant, episode_length_constant, loss_settings
from tests.conftest import compose_config

# Two prompts, two episodes each (the shared-prompt forward shares them); 1 = model token, 0 = tool/env token.
PROMPTS = [[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]]
COMPLETIONS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18], [19, 20]]
MASKS = [[1, 1, 0, 0, 0, 1], [1, 0, 1], [1, 0, 0, 1, 1], [1, 1]]
ADVANTAGES = [1.0, -0.5, 0.7, -1.2]


def episode_data(masks: list[list[int]] = MASKS) -> RolloutData:
    return RolloutData(
        PROMPTS,
        COMPLETIONS,
        raw_rewards=torch.zeros(4),
        advantages=torch.tensor(ADVANTAGES),
        token_masks=[torch.tensor(m, dtype=torch.float32) for m in masks],
    )


def hand_gradient(
    model: torch.nn.Module, mode: str, masks: list[list[int]], constant: float, keep: list[float]
) -> dict[str, torch.Tensor]:
    """The gradient of the on-policy loss -A * log p (ratio 1), each token weighted by its mask, normalized as
    `mode` says over the model tokens of the completions kept in the loss."""
    model.zero_grad(set_to_none=True)
    terms, model_tokens = [], 0.0
    for prompt, completion, mask, advantage, kept in zip(PROMPTS, COMPLETIONS, masks, ADVANTAGES, keep, strict=True):
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
        log_probs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        token_log_probs = log_probs.gather(-1, torch.tensor(completion)[:, None])[:, 0]
        weights = torch.tensor(mask, dtype=torch.float32) * kept
        summed = -(advantage * token_log_probs * weights).sum()
        model_tokens += float(weights.sum())
        if mode == "sequence_mean":
            terms.append(summed / max(float(torch.tensor(mask).sum()), 1.0))
        elif mode == "constant":
            terms.append(summed / constant)
        else:
            terms.append(summed)
    total = sum(terms)
    loss = total / model_tokens if mode == "token_mean" else total / len(terms)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("mode", "share", "mask_truncated"),
    [
        ("token_mean", True, False),
        ("token_mean", False, True),
        ("sequence_mean", True, False),
        ("constant", True, True),
    ],
)
def test_the_learners_gradient_leaves_tool_and_environment_tokens_out(tmp_path, mode, share, mask_truncated) -> None:
    from grpo_cli.learner.learner import Learner

    cfg = compose_config(
        [
            "debug=smoke",
            "model.mixed_precision=no",
            "loss=reinforce_with_baseline",
            "kl.beta=0",
            "train.max_grad_norm=1e9",
            f"normalization.length={mode}",
            f"train.share_prompt_forward={str(share).lower()}",
        ],
        output_dir=str(tmp_path),
    )
    learner = Learner(cfg, tmp_path)
    assert learner.shape.microbatch_size == 2 and cfg.rollout.temperature == 1.0
    grads: list[dict[str, torch.Tensor]] = []
    learner.optimizer.step = lambda: grads.append(  # keep the weights: compare this step's gradient
        {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}
    )
    data = episode_data()
    keep = [1.0, 1.0, 0.0, 1.0] if mask_truncated else [1.0] * 4  # a truncated episode left out of the loss
    if mask_truncated:
        data.loss_mask = torch.tensor(keep)
    learner.update(data, step=1)
    constant = learner.loss.normalize_constant
    expected = hand_gradient(learner.model, mode, MASKS, constant, keep)
    leaked = hand_gradient(learner.model, mode, [[1] * len(m) for m in MASKS], constant, keep)
    (got,) = grads
    assert set(got) == set(expected)
    # Relative to the whole gradient's norm: float32 sums in another order differ by ~1e-7 of it.
    assert relative_gap(got, expected) < 1e-5
    # The check can fail: with the tool/environment tokens in the loss the gradient is another one.
    assert relative_gap(leaked, expected) > 1e-2


def relative_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    difference = sum(float((a[n] - b[n]).pow(2).sum()) for n in b) ** 0.5
    return difference / sum(float(b[n].pow(2).sum()) for n in b) ** 0.5


def test_step_totals_count_model_tokens_and_the_holes_survive_selection_and_concatenation() -> None:
    data = episode_data()
    sequences, tokens = optimizer_step_totals(data, [0, 1, 2, 3])
    assert (sequences, tokens) == (4.0, float(sum(map(sum, MASKS))))
    mb = make_microbatch(data, [0, 3], pad_token_id=0, device=torch.device("cpu"))
    response = mb["response_mask"]
    # Everything after the prompt is scored (response_mask); the loss's mask has the holes.
    assert response.sum(-1).tolist() == [6, 2]
    holes = model_token_mask(mb)
    assert [row[r].int().tolist() for row, r in zip(holes, response.bool(), strict=True)] == [MASKS[0], MASKS[3]]
    picked = select_completions(data, [2, 0])
    assert [m.tolist() for m in picked.token_masks] == [MASKS[2], MASKS[0]]
    single_turn = RolloutData([[1]], [[2, 3]], torch.zeros(1), torch.zeros(1))
    joined = concat_rollouts([picked, single_turn])
    assert [m.tolist() for m in joined.token_masks] == [MASKS[2], MASKS[0], [1.0, 1.0]]


def test_dr_grpos_constant_for_episodes_is_the_most_model_tokens_an_episode_can_hold() -> None:
    assert episode_length_constant(max_tokens_per_turn=64, max_turns=4, max_episode_tokens=None) == 256
    assert episode_length_constant(max_tokens_per_turn=64, max_turns=4, max_episode_tokens=200) == 200
    assert episode_length_constant(max_tokens_per_turn=64, max_turns=1, max_episode_tokens=None) == 64


def test_the_default_constant_of_a_multi_turn_task_is_its_episodes_and_single_turn_keeps_max_tokens() -> None:
    single = compose_config(["rollout.max_tokens=32"])
    assert default_length_constant(single) == 32 == loss_settings(single).normalize_constant
    guess = compose_config(["task=guess_number", "rollout.max_tokens=32", "task.max_turns=3"])
    assert default_length_constant(guess) == 96 == loss_settings(guess).normalize_constant
    capped = compose_config(["task=guess_number", "rollout.max_tokens=32", "task.max_episode_tokens=50"])
    assert default_length_constant(capped) == 50
    given = compose_config(["task=guess_number", "normalization.length_constant=10"])
    assert loss_settings(given).normalize_constant == 10
