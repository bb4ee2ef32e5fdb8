"""job.length_profile=long_tail's forced batches: the long tail's lengths and the equal-length batch of the same
tokens (grpo_cli/jobs/benchmark_layouts.py)."""

from __future__ import annotations

import math

from grpo_cli.jobs.benchmark_layouts import LONGEST, SHORTEST, equal_lengths, forced_batch, long_tail_lengths


def test_long_tail_lengths_follow_one_over_l_on_16_to_512() -> None:
    lengths = long_tail_lengths(4000, seed=0)
    assert min(lengths) >= SHORTEST and max(lengths) <= LONGEST
    # p(L) ~ 1/L: each doubling of the length holds the same share (1/5 of [16, 512]); the mean is 496 / ln 32
    for low in (16, 32, 64, 128, 256):
        share = sum(low <= n < 2 * low for n in lengths) / len(lengths)
        assert abs(share - 0.2) < 0.03
    assert abs(sum(lengths) / len(lengths) - (LONGEST - SHORTEST) / math.log(LONGEST / SHORTEST)) < 8
    assert long_tail_lengths(10, seed=3) == long_tail_lengths(10, seed=3)


def test_the_equal_length_batch_holds_the_same_tokens() -> None:
    lengths = long_tail_lengths(30, seed=1)
    equal = equal_lengths(lengths)
    assert sum(equal) == sum(lengths) and max(equal) - min(equal) <= 1
    batch = forced_batch([[1, 2]] * 30, equal, vocab=500, seed=0)
    assert [len(c) for c in batch.completion_ids] == equal
    assert all(100 <= t < 500 for c in batch.completion_ids for t in c)
