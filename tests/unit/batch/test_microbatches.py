"""train.microbatch_tokens' partitions (grpo_cli/batch/microbatches.py), checked against brute force and against
the positions a padded forward processes, counted by hand."""

from __future__ import annotations

import itertools
import random

import pytest

from grpo_cli.batch.microbatches import (
    TokenCounts,
    equalize,
    fixed_microbatches,
    groups_of,
    karmarkar_karp,
    positions_processed,
    rank_shares,
    token_microbatches,
)


def long_tail(n_prompts: int, group: int, seed: int = 0) -> TokenCounts:
    """Prompts of 10-30 tokens, each with `group` completions of long-tailed lengths in [4, 200]."""
    rng = random.Random(seed)
    prompts = [[p] * rng.randint(10, 30) for p in range(n_prompts)]
    prompt_ids = [p for p in prompts for _ in range(group)]
    completion_ids = [[1] * min(200, int(4 / rng.random() ** 0.8)) for _ in prompt_ids]
    return TokenCounts.of(prompt_ids, completion_ids)


def test_positions_of_a_padded_and_a_shared_prompt_microbatch_counted_by_hand() -> None:
    # prompt A (3 tokens) with completions of 2 and 5 tokens, prompt B (4 tokens) with one of 1 token
    counts = TokenCounts.of([[7, 7, 7], [7, 7, 7], [8, 8, 8, 8]], [[1, 1], [1] * 5, [1]])
    # right-padded: 3 rows x the longest input (3 + 5 - 1 = 7); real inputs 4 + 7 + 4
    assert positions_processed(counts, [0, 1, 2], share_prompts=False) == (21, 15)
    # shared: 2 distinct prompts x 4 (left-padded) + 3 rows x (5 - 1) completion inputs; real 3 + 4 + (1 + 4 + 0)
    assert positions_processed(counts, [0, 1, 2], share_prompts=True) == (20, 12)
    assert positions_processed(counts, [0, 2], share_prompts=True) == positions_processed(counts, [0, 2], False)


@pytest.mark.parametrize("budget", [64, 256, 1024])
@pytest.mark.parametrize("share", [False, True])
def test_token_microbatches_hold_every_row_once_within_the_budget(budget: int, share: bool) -> None:
    counts = long_tail(16, 4)
    rows = list(range(64))
    layout = token_microbatches(counts, rows, budget, share)
    assert sorted(r for mb in layout.microbatches for r in mb) == rows
    for mb in layout.microbatches:
        processed, _ = positions_processed(counts, mb, share)
        assert processed <= budget or len(mb) == 1  # a row over the budget is a microbatch of its own


def test_sorted_runs_pad_less_than_the_fixed_rows_at_no_more_positions_per_microbatch() -> None:
    counts = long_tail(16, 4)
    rows = list(range(64))
    fixed = fixed_microbatches(rows, 8)
    largest = max(positions_processed(counts, mb, False)[0] for mb in fixed)
    budgeted = token_microbatches(counts, rows, largest, False).microbatches

    def padding(microbatches: list[list[int]]) -> float:
        processed = [positions_processed(counts, mb, False) for mb in microbatches]
        return 1 - sum(r for _, r in processed) / sum(p for p, _ in processed)

    assert padding(budgeted) < padding(fixed) / 2


def test_a_prompt_s_completions_stay_together_where_the_shared_forward_pays() -> None:
    # Long prompts, short alike completions: running each prompt once beats sorting rows by length.
    counts = TokenCounts.of([[p] * 100 for p in range(4) for _ in range(4)], [[1] * (5 + i % 3) for i in range(16)])
    layout = token_microbatches(counts, list(range(16)), 300, share_prompts=True)
    assert layout.keeps_groups and layout.positions_by_groups is not None
    assert layout.positions_by_groups < layout.positions_by_rows
    for mb in layout.microbatches:  # whole groups
        assert len({counts.prompt_keys[r] for r in mb}) * 4 == len(mb)
    # Short prompts, long-tailed completions: sorting by length wins.
    assert not token_microbatches(long_tail(16, 4), list(range(64)), 512, share_prompts=True).keeps_groups


def test_karmarkar_karp_matches_the_best_two_way_split_on_small_sets() -> None:
    rng = random.Random(1)
    for _ in range(30):
        weights = [rng.randint(1, 50) for _ in range(rng.randint(2, 9))]
        parts = karmarkar_karp(weights, 2)
        assert sorted(i for p in parts for i in p) == list(range(len(weights)))
        spread = abs(sum(weights[i] for i in parts[0]) - sum(weights[i] for i in parts[1]))
        best = min(
            abs(2 * sum(c) - sum(weights)) for k in range(len(weights) + 1) for c in itertools.combinations(weights, k)
        )
        assert spread <= best + max(weights) // 2  # the differencing method: near the optimum, often on it
    assert karmarkar_karp([8, 7, 6, 5, 4], 2) == [[1, 3, 4], [0, 2]]  # 15 and 14; greedy in order gives 18 / 12
    assert karmarkar_karp([3], 3) == [[0], [], []]


def test_rank_shares_balance_tokens_and_keep_groups_whole() -> None:
    counts = long_tail(8, 4)
    rows = list(range(32))
    for keep in (False, True):
        shares = rank_shares(counts, rows, 2, keep_groups=keep, share_prompts=keep)
        assert sorted(r for s in shares for r in s) == rows

        def tokens(share: list[int], keep: bool = keep) -> int:  # a shared prompt's tokens count once
            return sum(positions_processed(counts, group, keep)[1] for group in groups_of(counts, share))

        by_tokens = [tokens(share) for share in shares]
        halves = [tokens(rows[:16]), tokens(rows[16:])]  # the equal row counts of today's split
        assert max(by_tokens) - min(by_tokens) <= max(halves) - min(halves)
        if keep:
            for share in shares:
                assert all(r in share for s in share for r in rows if counts.prompt_keys[r] == counts.prompt_keys[s])


def test_equalize_pads_every_rank_with_dummies_to_the_most_microbatches() -> None:
    assert equalize([[[0, 1]], [[2], [3], [4]]]) == [[[0, 1], [], []], [[2], [3], [4]]]


def test_packed_microbatches_fit_the_budget_in_real_tokens() -> None:
    counts = long_tail(16, 4)
    layout = token_microbatches(counts, list(range(64)), 600, share_prompts=False, packed=True)
    assert sorted(r for mb in layout.microbatches for r in mb) == list(range(64))
    sums = [sum(counts.row_tokens(r) for r in mb) for mb in layout.microbatches]
    assert all(s <= 600 or len(mb) == 1 for s, mb in zip(sums, layout.microbatches, strict=True))
    assert len(sums) == -(-sum(sums) // 600) or max(sums) - min(sums) < 100  # as few as fit, near-equal
