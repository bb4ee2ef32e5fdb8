"""The one scoring forward: completions' response-token log-probs under a policy, microbatched, with the settings
every pass shares (ScoringSettings). The learner's training, old and reference passes and the rollout worker's
behaviour log-probs all run it, so it sits below both.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_cli.batch.microbatches import TokenCounts, fixed_microbatches, token_microbatches
from grpo_cli.batch.rollout_data import RolloutData, make_microbatch
from grpo_cli.core import response_log_probs
from grpo_cli.core.packing import packing_beats_sharing, packing_problem
from grpo_cli.core.prompt_sharing import prompt_sharing_problem
from grpo_cli.core.prompt_tree import prompt_tree_problem

log = logging.getLogger(__name__)
_REFUSALS_LOGGED: set[str] = set()  # each reason once per process
# The prompt tree's probe result per model (it reads how the model applies a mask, which training does not change).
_TREE_PROBED: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class ScoringSettings:
    """How completions are scored (their response tokens' log-probs under a policy), the same for every pass
    that scores them: the learner's training forward, its old and reference passes, and the generator's
    behaviour log-probs. Built once from the config (grpo_cli.batch.settings.scoring_settings)."""

    # Tokens were sampled from softmax(logits / T): ratios, KL and entropy must be of that distribution.
    temperature: float
    # Run each distinct prompt of a microbatch once and share its keys/values among its completions
    # (train.share_prompt_forward, where the model and the distributed strategy allow it).
    share_prompts: bool
    # Response tokens per LM-head chunk (train.logits_chunk_tokens; 0: unchunked).
    logits_chunk_tokens: int
    # Completions per forward pass of the no-grad passes (the training microbatch).
    microbatch_size: int
    pad_token_id: int
    # Positions per forward pass of the no-grad passes instead (train.microbatch_tokens; None: microbatch_size rows).
    microbatch_tokens: int | None = None
    # Run a microbatch's sequences packed into a few rows, without padding (train.pack_sequences, where the
    # model's probe passed: packs_sequences).
    pack_sequences: bool = False
    # Run the shared-prompt forward as packed rows of each prompt and its completions, without padding
    # (core/prompt_tree.py; where share_prompts is on and the model's probe passed: uses_prompt_tree).
    prompt_tree: bool = False


def shares_prompts(model: torch.nn.Module, wanted: bool) -> bool:
    """Whether the learner's forward passes (training, old and reference log-probs, and their token counts)
    share prompts: `train.share_prompt_forward` asked for it and the shared forward can score `model` exactly
    (core.prompt_sharing.prompt_sharing_problem); a model it cannot gets the plain forward, said in one log line."""
    if not wanted:
        return False
    problem = prompt_sharing_problem(model)
    if problem is None:
        return True
    _say_refusal_once(
        problem,
        "train: no shared-prompt forward for this model (%s); every completion runs with its own copy of its "
        "prompt (train.share_prompt_forward: same log-probs, more compute)",
    )
    return False


def _say_refusal_once(problem: str, message: str) -> None:
    """One warning line per refusal reason and process (`message` %-formatted with `problem`)."""
    if problem not in _REFUSALS_LOGGED:
        _REFUSALS_LOGGED.add(problem)
        log.warning(message, problem)


def _scorer(model: torch.nn.Module, temperature: float, logits_chunk_tokens: int) -> Callable[..., torch.Tensor]:
    """The scoring path's response log-probs ((N,): at the mask's positions) of `model`, in the layout the keyword
    arguments name (response_log_probs'): what the probes compare layouts with."""

    def score(
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        mask: torch.Tensor,
        share_prompts: bool = False,
        pack_sequences: bool = False,
        prompt_tree: bool = False,
    ) -> torch.Tensor:
        return response_log_probs(
            model,
            input_ids,
            labels,
            mask,
            temperature=temperature,
            logits_chunk_tokens=logits_chunk_tokens,
            share_prompts=share_prompts,
            pack_sequences=pack_sequences,
            prompt_tree=prompt_tree,
        )["log_probs"][mask]

    return score


def packs_sequences(
    model: torch.nn.Module, wanted: bool, temperature: float = 1.0, logits_chunk_tokens: int = 0
) -> bool:
    """Whether the forward passes run packed rows: `train.pack_sequences` asked for it and the probe
    (core.packing.packing_problem: packed against separate log-probs, through response_log_probs as scored here)
    passed on `model`; a model it fails keeps the padded layout, said in one log line."""
    if not wanted:
        return False

    score = _scorer(model, temperature, logits_chunk_tokens)

    def packed_or_not(input_ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, packed: bool) -> torch.Tensor:
        return score(input_ids, labels, mask, pack_sequences=packed)

    problem = packing_problem(model, packed_or_not)
    if problem is None:
        return True
    _say_refusal_once(
        problem,
        "train: no packed rows for this model (%s); its microbatches stay padded (train.pack_sequences: same "
        "log-probs, more compute)",
    )
    return False


def uses_prompt_tree(
    model: torch.nn.Module, share_prompts: bool, temperature: float = 1.0, logits_chunk_tokens: int = 0
) -> bool:
    """Whether the shared-prompt forward runs as a prompt tree (core/prompt_tree.py: each prompt and its
    completions in one packed row, no padding): prompts are shared and the probe (core.prompt_tree.
    prompt_tree_problem: the tree against the plain forward, through response_log_probs as scored here) passed on
    `model`; a model it fails keeps the two-pass shared forward, said in one log line."""
    if not share_prompts:
        return False
    if model in _TREE_PROBED:  # the learner's and the in-process generator's passes share one model
        return _TREE_PROBED[model]

    score = _scorer(model, temperature, logits_chunk_tokens)

    def in_layout(input_ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, layout: str) -> torch.Tensor:
        return score(input_ids, labels, mask, share_prompts=layout != "plain", prompt_tree=layout == "tree")

    problem = prompt_tree_problem(model, in_layout)
    _TREE_PROBED[model] = problem is None
    if problem is None:
        return True
    _say_refusal_once(
        problem,
        "train: no prompt tree for this model (%s); the shared-prompt forward pads the completions instead "
        "(same log-probs, more compute)",
    )
    return False


def shares_in_forward(
    data: RolloutData, indices: list[int], share_prompts: bool, pack_sequences: bool, prompt_tree: bool = False
) -> bool:
    """Whether the forward over the microbatch `indices` takes the shared-prompt layout, as response_log_probs
    decides: some prompt repeats, and it runs as a prompt tree or packing (when on) would not process fewer
    positions (core.packing.packing_beats_sharing)."""
    if not share_prompts:
        return False
    distinct = {tuple(data.prompt_ids[i]) for i in indices}
    packs = (
        not prompt_tree
        and pack_sequences
        and packing_beats_sharing(
            [len(data.prompt_ids[i]) for i in indices],
            [len(data.completion_ids[i]) for i in indices],
            [len(p) for p in distinct],
        )
    )
    return len(distinct) < len(indices) and not packs


def tokens_through_model(
    data: RolloutData, indices: list[int], share_prompts: bool, pack_sequences: bool = False, prompt_tree: bool = False
) -> int:
    """Tokens one forward pass over the microbatch `indices` processes (without padding): a shared prompt once,
    unless packing processes fewer positions (shares_in_forward)."""
    completions = sum(len(data.completion_ids[i]) for i in indices)
    if shares_in_forward(data, indices, share_prompts, pack_sequences, prompt_tree):
        return completions + sum(len(p) for p in {tuple(data.prompt_ids[i]) for i in indices})
    return completions + sum(len(data.prompt_ids[i]) for i in indices)


def scoring_microbatches(data: RolloutData, scoring: ScoringSettings) -> list[list[int]]:
    """The microbatches (row indices) the no-grad passes score `data` in: runs of scoring.microbatch_size rows, or
    with scoring.microbatch_tokens token-budget microbatches (batch.microbatches.token_microbatches)."""
    rows = list(range(len(data.completion_ids)))
    if scoring.microbatch_tokens is None:
        return fixed_microbatches(rows, scoring.microbatch_size)
    counts = TokenCounts.of(data.prompt_ids, data.completion_ids)
    return token_microbatches(
        counts, rows, scoring.microbatch_tokens, scoring.share_prompts, packed=scoring.pack_sequences
    ).microbatches


def per_completion_log_probs(
    model: torch.nn.Module, data: RolloutData, device: torch.device, scoring: ScoringSettings
) -> list[torch.Tensor]:
    """Response-token log-probs of every completion under `model` (old or reference policy), no grad, scored as
    `scoring` says (at the sampling temperature, in scoring_microbatches)."""
    rows = log_probs_of_rows(model, data, device, scoring, scoring_microbatches(data, scoring))
    return [rows[i] for i in range(len(data.completion_ids))]


@torch.inference_mode()
def log_probs_of_rows(
    model: torch.nn.Module,
    data: RolloutData,
    device: torch.device,
    scoring: ScoringSettings,
    microbatches: list[list[int]],
) -> dict[int, torch.Tensor]:
    """per_completion_log_probs of the rows of `microbatches` only (an empty one runs a dummy row), by row.
    Eval mode for the pass: these are fixed targets, not samples of dropout noise."""

    def score(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return score_microbatch(model, batch, scoring, return_token_entropy=False)["log_probs"]

    return per_completion_rows(score, model, data, microbatches, scoring.pad_token_id, device)


def score_microbatch(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    scoring: ScoringSettings,
    return_token_entropy: bool = True,
) -> dict[str, torch.Tensor]:
    """make_microbatch's `batch` scored under `model` as `scoring` says: response-token "log_probs" (B, T) (and
    "token_entropy" (B, T)). The one call every scoring pass makes, with or without grad."""
    return response_log_probs(
        model,
        batch["input_ids"],
        batch["labels"],
        batch["response_mask"].bool(),
        return_token_entropy=return_token_entropy,
        temperature=scoring.temperature,
        share_prompts=scoring.share_prompts,
        logits_chunk_tokens=scoring.logits_chunk_tokens,
        pack_sequences=scoring.pack_sequences,
        prompt_tree=scoring.prompt_tree,
    )


def shortest_row(data: RolloutData) -> int | None:
    """The completion with a token whose forward is cheapest: what a dummy microbatch runs; None when no
    completion has a token (every episode skipped before it reached the model)."""
    rows = [i for i in range(len(data.completion_ids)) if data.completion_ids[i]]
    return min(rows, key=lambda i: len(data.prompt_ids[i]) + len(data.completion_ids[i]), default=None)


def dummy_microbatch(data: RolloutData, pad_token_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """A dummy microbatch (scored, its values dropped: every rank makes as many collective calls): the cheapest
    row of `data`, or without a row that has a completion token one of a padding prompt and completion token."""
    row = shortest_row(data)
    if row is not None:
        return make_microbatch(data, [row], pad_token_id, device)
    zero = torch.zeros(1)
    return make_microbatch(RolloutData([[pad_token_id]], [[pad_token_id]], zero, zero), [0], pad_token_id, device)


def per_completion_rows(
    score: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    model: torch.nn.Module,
    data: RolloutData,
    microbatches: list[list[int]],
    pad_token_id: int,
    device: torch.device,
) -> dict[int, torch.Tensor]:
    """`score`'s (B, T) values of each microbatch of `data` (make_microbatch's tensors of each list of row indices
    of `microbatches`), cut back into one (len_i,) tensor of response tokens per completion, on the CPU, by row. An
    empty microbatch runs `score` on one dummy row and keeps nothing (under FSDP every rank makes as many calls).
    `model`, the module `score` runs, is in eval mode meanwhile. The caller picks the grad mode (no_grad, or
    inference_mode where nothing reuses the module's tensors in autograd later)."""
    result: dict[int, torch.Tensor] = {}
    was_training = model.training
    model.eval()
    try:
        for listed in microbatches:
            # A row without a completion token has no value to score (a skipped episode that never reached the
            # model): an empty one of its own, and not in the forward.
            result.update({row: torch.zeros(0) for row in listed if not data.completion_ids[row]})
            indices = [row for row in listed if data.completion_ids[row]]
            # A microbatch left without rows runs a dummy (as an empty one does): as many calls as before.
            if indices:
                batch = make_microbatch(data, indices, pad_token_id, device)
            else:
                batch = dummy_microbatch(data, pad_token_id, device)
            mask = batch["response_mask"].bool()
            values = score(batch)
            for row, values_row, row_mask in zip(indices, values, mask, strict=False):
                result[row] = values_row[row_mask].cpu()
    finally:
        model.train(was_training)
    return result
