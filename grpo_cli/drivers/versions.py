"""The bookkeeping of the sync strategies (docs/architecture.md), as pure functions: no torch, no Ray.

Policy versions count learner steps: version 0 is the initial policy and version k the weights after step k's
updates. A rollout batch carries the version that sampled it (its behaviour policy). Its *lag* (or staleness:
the same number) when the learner trains on it is `learner version - behaviour version`:

- on_policy, multi_epoch: always 0 (generation and training take turns on the same weights);
- one_behind: at most 1, because batch k+1 is sampled while the learner trains on batch k;
- replay_buffer: at most sync.max_staleness; older trajectories are dropped from the buffer, unused or not;
- async: at most sync.max_staleness, where a sample's lag is that of the *oldest* version among its tokens (with
  partial rollouts one completion is sampled by several versions; an episode's environment tokens, version -1,
  have none).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

# The largest lag one_behind allows: the generator is never more than one policy version behind.
ONE_BEHIND_MAX_LAG = 1


def lag(learner_version: int, behaviour_version: int) -> int:
    """How many policy versions the learner has moved since the behaviour policy sampled the data."""
    if behaviour_version > learner_version:
        raise ValueError(f"behaviour version {behaviour_version} is ahead of the learner's {learner_version}")
    return learner_version - behaviour_version


def check_lag(learner_version: int, behaviour_version: int, max_lag: int) -> int:
    """lag(), raising RuntimeError beyond max_lag: an orchestration bug must stop a run, not bias it silently."""
    value = lag(learner_version, behaviour_version)
    if value > max_lag:
        raise RuntimeError(
            f"a rollout batch of policy version {behaviour_version} reached the learner at version "
            f"{learner_version}: lag {value} exceeds {max_lag}"
        )
    return value


def overlap_fraction(produce_s: float, waiting_s: float) -> float:
    """The share of the generator's work on a batch that ran while the learner was busy elsewhere.

    produce_s: the generator's time on the batch (generation, scoring, behaviour log-probs, weight loads);
    waiting_s: how long the learner sat idle waiting for it. Serial execution gives 0, full overlap 1.
    """
    if produce_s <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - waiting_s / produce_s))


@dataclass
class Entry(Generic[T]):
    """One scored trajectory in the replay buffer, with the policy version that sampled it."""

    item: T
    version: int
    uses: int = 0  # how many updates sampled it so far


class ReplayBuffer(Generic[T]):
    """A bounded FIFO of scored trajectories; updates sample from it uniformly without replacement.

    `capacity` bounds memory (the oldest entries go first when it is full); `max_staleness` bounds how
    off-policy an update may be: entries sampled more than that many versions ago are dropped before sampling.
    """

    def __init__(self, capacity: int, max_staleness: int) -> None:
        if capacity < 1 or max_staleness < 0:
            raise ValueError(f"capacity={capacity} must be >= 1 and max_staleness={max_staleness} >= 0")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.entries: deque[Entry[T]] = deque()
        self.dropped_full = 0  # pushed out by newer entries before reaching the staleness bound
        self.dropped_stale = 0  # aged past max_staleness

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, items: Iterable[T], version: int) -> None:
        for item in items:
            if len(self.entries) == self.capacity:
                self.entries.popleft()
                self.dropped_full += 1
            self.entries.append(Entry(item, version))

    def evict_stale(self, learner_version: int) -> int:
        """Drop entries whose staleness exceeds the bound; returns how many went."""
        before = len(self.entries)
        self.entries = deque(e for e in self.entries if lag(learner_version, e.version) <= self.max_staleness)
        gone = before - len(self.entries)
        self.dropped_stale += gone
        return gone

    def can_sample(self, n: int, learner_version: int) -> bool:
        fresh = sum(1 for e in self.entries if lag(learner_version, e.version) <= self.max_staleness)
        return fresh >= n

    def sample(self, n: int, learner_version: int, rng: random.Random) -> list[Entry[T]]:
        """n distinct entries, uniformly, after evicting stale ones (ValueError if fewer than n are left)."""
        self.evict_stale(learner_version)
        if len(self.entries) < n:
            raise ValueError(f"the buffer holds {len(self.entries)} usable trajectories, fewer than {n}")
        chosen = rng.sample(list(self.entries), n)
        for entry in chosen:
            entry.uses += 1
        return chosen


def staleness_stats(learner_version: int, versions: Sequence[int]) -> dict[str, float]:
    """Max and mean lag of the trajectories one update samples."""
    lags = [lag(learner_version, v) for v in versions]
    return {"max": float(max(lags)), "mean": sum(lags) / len(lags)}


def staleness_check(learner_version: int, token_versions: Sequence[Sequence[int]], max_lag: int) -> dict[str, float]:
    """sync=async's hard check and its statistics over one training batch, each sample's token versions given
    (-1: a token no policy sampled). Raises RuntimeError when a sample's oldest token lags more than max_lag.

    Returns "max" and "mean" (over samples) of learner_version - the sample's oldest version, "token_mean" (over
    sampled tokens) of learner_version - the token's version, "partial_frac" (samples with tokens of more than one
    version) and "span_mean" (newest - oldest version, over those samples; 0 when none)."""
    lags: list[int] = []
    token_lags: list[int] = []
    spans: list[int] = []
    for versions in token_versions:
        sampled = [v for v in versions if v >= 0]
        if not sampled:  # nothing sampled (a prompt that filled the context)
            continue
        oldest = min(sampled)
        lags.append(check_lag(learner_version, oldest, max_lag))
        token_lags.extend(lag(learner_version, v) for v in sampled)
        if max(sampled) > oldest:
            spans.append(max(sampled) - oldest)
        if any(later < earlier for earlier, later in zip(sampled, sampled[1:], strict=False)):
            raise RuntimeError(f"a sample's token versions decrease: {sampled}")
    n = max(len(lags), 1)
    return {
        "max": float(max(lags, default=0)),
        "mean": sum(lags) / n,
        "token_mean": sum(token_lags) / max(len(token_lags), 1),
        "partial_frac": len(spans) / n,
        "span_mean": sum(spans) / len(spans) if spans else 0.0,
    }
