"""Which completions go into which microbatch, and onto which data-parallel rank: pure functions of token counts
that return lists of row indices (no tensors, no model), so every layout that consumes them (the padded forward
here, a packed one) reads the same partition.

Two layouts of an optimizer step's rows (`train.microbatch_tokens`):

- fixed: `fixed_microbatches`, today's consecutive runs of `train_batch_size / gradient_accumulation_steps` rows,
  each right-padded to its longest row whatever the lengths (null, the default).
- token budget: `token_microbatches`, microbatches of at most N positions processed each (a padded microbatch
  costs rows x its longest row). A row longer than N is a microbatch of its own.

Why not Karmarkar-Karp inside a rank, as verl's `rearrange_micro_batches` does: verl balances the sums of
*unpadded* lengths into near-equal microbatches because its microbatches are packed (`use_remove_padding`), where
mixing a long and a short row costs nothing. A padded microbatch pays rows x its longest row, so mixing lengths is
the waste itself (near-equal sums of a long-tailed batch put a 512-token row beside 16-token ones: 30% padding
measured at 3 microbatches of 8k). Here the rows are sorted by length and cut into the contiguous runs that
process the fewest positions, each run charged a fixed overhead (MICROBATCH_OVERHEAD) so the tail is not run row
by row; runs of alike lengths fill the budget where the lengths allow. Karmarkar-Karp (the largest differencing
method, `karmarkar_karp`) balances what has no padding between its parts: the ranks (`rank_shares`, verl's
`balance_batch`, where the waiting is) and packed microbatches (`packed=True`).

With the shared-prompt forward (`train.share_prompt_forward`, core/prompt_sharing.py) a microbatch that holds
several completions of one prompt runs that prompt once; the units are then whole groups (a prompt's
completions), and whichever of the two layouts, groups kept together or rows sorted by length, processes fewer
positions for the step is taken (`StepLayout.keeps_groups`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenCounts:
    """Per completion of a batch: its prompt's length, its completion's length and its prompt (a hashable key:
    completions with equal keys share a prompt)."""

    prompt_lengths: Sequence[int]
    completion_lengths: Sequence[int]
    prompt_keys: Sequence[Hashable]

    @classmethod
    def of(cls, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]) -> TokenCounts:
        return cls([len(p) for p in prompt_ids], [len(c) for c in completion_ids], [tuple(p) for p in prompt_ids])

    def row_tokens(self, row: int) -> int:
        """Input positions of `row` alone: prompt and completion but the last token (it is only a label)."""
        return self.prompt_lengths[row] + self.completion_lengths[row] - 1


@dataclass
class _Fill:
    """A microbatch being filled: the running maxima its cost reads, so adding a row is O(1)."""

    counts: TokenCounts
    share_prompts: bool
    packed: bool = False
    rows: list[int] = field(default_factory=list)
    longest_row: int = 0
    longest_prompt: int = 0
    longest_completion: int = 0
    prompts: set[Hashable] = field(default_factory=set)
    real: int = 0

    def add(self, row: int) -> None:
        c = self.counts
        self.rows.append(row)
        self.longest_row = max(self.longest_row, c.row_tokens(row))
        self.longest_prompt = max(self.longest_prompt, c.prompt_lengths[row])
        self.longest_completion = max(self.longest_completion, c.completion_lengths[row])
        self.prompts.add(c.prompt_keys[row])
        self.real += c.row_tokens(row)

    def cost(self, extra: Sequence[int] = ()) -> int:
        """Positions the forward processes for these rows (and `extra`), padding included."""
        if extra:
            trial = _Fill(self.counts, self.share_prompts, self.packed)
            for row in (*self.rows, *extra):
                trial.add(row)
            return trial.cost()
        if not self.rows:
            return 0
        if self.packed:
            return self.real
        rows = len(self.rows)
        if self.share_prompts and len(self.prompts) < rows:
            # core.prompt_sharing: each distinct prompt once, left-padded to the longest, then every completion
            # but its last token, right-padded to the longest.
            return len(self.prompts) * self.longest_prompt + rows * max(self.longest_completion - 1, 0)
        return rows * self.longest_row  # right-padded to the longest prompt + completion


def positions_processed(counts: TokenCounts, rows: Sequence[int], share_prompts: bool) -> tuple[int, int]:
    """(positions processed, real tokens among them) of one padded forward over `rows`, as the learner's forward
    runs it (the shared-prompt forward when `share_prompts` and some prompt repeats). Their difference is padding."""
    fill = _Fill(counts, share_prompts)
    for row in rows:
        fill.add(row)
    if share_prompts and len(fill.prompts) < len(rows):
        distinct: dict[Hashable, int] = {counts.prompt_keys[r]: counts.prompt_lengths[r] for r in rows}
        real = sum(distinct.values()) + sum(max(counts.completion_lengths[r] - 1, 0) for r in rows)
        return fill.cost(), real
    return fill.cost(), fill.real


def fixed_microbatches(rows: Sequence[int], size: int) -> list[list[int]]:
    """Today's layout: consecutive runs of `size` rows (the last may be shorter)."""
    return [list(rows[start : start + size]) for start in range(0, len(rows), size)]


# What a microbatch costs beyond its positions, as a fraction of the budget: each forward streams every weight
# once and launches every kernel once, whatever its rows. Without it the cheapest cut would run each of a long
# tail's rows alone to save a little padding; with it a run is split only where that saves more than 1/16 of a
# full microbatch.
MICROBATCH_OVERHEAD = 1 / 16


def _cheapest_cuts(units: Sequence[Sequence[int]], budget: int, counts: TokenCounts, share: bool) -> list[list[int]]:
    """`units` (sorted by length) cut into contiguous runs of at most `budget` positions each (a unit over it
    alone) that process the fewest positions, each run charged MICROBATCH_OVERHEAD x budget more: a shortest-path
    over the cut points (dynamic programming, O(units x the longest run))."""
    n = len(units)
    overhead = budget * MICROBATCH_OVERHEAD
    best = [0.0] + [math.inf] * n  # best[j]: the cheapest cut of units[:j]
    previous = [0] * (n + 1)
    for i in range(n):
        fill = _Fill(counts, share)
        for j in range(i, n):
            for row in units[j]:
                fill.add(row)
            cost = fill.cost()
            if cost > budget and j > i:
                break
            if best[i] + cost + overhead < best[j + 1]:
                best[j + 1], previous[j + 1] = best[i] + cost + overhead, i
            if cost > budget:  # a unit over the budget alone: nothing joins it
                break
    runs: list[list[int]] = []
    end = n
    while end > 0:
        start = previous[end]
        runs.append([row for unit in units[start:end] for row in unit])
        end = start
    return runs[::-1]


def _split_group(rows: list[int], budget: int, counts: TokenCounts, share: bool) -> list[list[int]]:
    """A group (one prompt's completions) as units: whole when it fits the budget, else runs of its rows, longest
    first, that each fit (each run still shares its prompt)."""
    fill = _Fill(counts, share)
    for row in rows:
        fill.add(row)
    if fill.cost() <= budget:
        return [rows]
    ordered = sorted(rows, key=lambda r: (-counts.completion_lengths[r], r))
    return _cheapest_cuts([[r] for r in ordered], budget, counts, share)


def groups_of(counts: TokenCounts, rows: Sequence[int]) -> list[list[int]]:
    """`rows` grouped by prompt, in order of first appearance."""
    groups: dict[Hashable, list[int]] = {}
    for row in rows:
        groups.setdefault(counts.prompt_keys[row], []).append(row)
    return list(groups.values())


def _row_units(counts: TokenCounts, rows: Sequence[int]) -> list[list[int]]:
    """Every row a unit, longest first (ties: in order)."""
    return [[r] for r in sorted(rows, key=lambda r: (-counts.row_tokens(r), r))]


def _group_units(counts: TokenCounts, rows: Sequence[int], budget: int) -> list[list[int]]:
    """Every prompt's completions a unit (split where over the budget), longest completions first."""
    units = [unit for group in groups_of(counts, rows) for unit in _split_group(group, budget, counts, True)]
    return sorted(
        units,
        key=lambda u: (-max(counts.completion_lengths[r] for r in u), -counts.prompt_lengths[u[0]], u[0]),
    )


@dataclass(frozen=True)
class StepLayout:
    """The token-budget microbatches of some rows: `microbatches` (row indices), whether each prompt's completions
    were kept together (`keeps_groups`), and the positions processed by each layout that was weighed."""

    microbatches: list[list[int]]
    keeps_groups: bool
    positions_by_rows: int
    positions_by_groups: int | None = None


def token_microbatches(
    counts: TokenCounts,
    rows: Sequence[int],
    budget: int,
    share_prompts: bool,
    keep_groups: bool | None = None,
    packed: bool = False,
) -> StepLayout:
    """`rows` cut into microbatches of at most `budget` positions processed each (a row over it alone).

    Padded (the default): rows sorted by length and cut into the cheapest contiguous runs (see the module
    docstring); with
    `share_prompts` also whole groups sorted by their longest completion, each microbatch's cost being the
    shared-prompt forward's, and the layout processing fewer positions wins (ties: rows), unless `keep_groups`
    decides (True: groups, False: rows). `packed`: the cost of a microbatch is its rows' real tokens (a packed
    forward pads nothing), and the rows are spread over the fewest microbatches that fit by Karmarkar-Karp.
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1 token, got {budget}")
    rows = list(rows)
    if packed:
        return StepLayout(_packed_microbatches(counts, rows, budget), False, sum(map(counts.row_tokens, rows)))
    by_rows = _cheapest_cuts(_row_units(counts, rows), budget, counts, share_prompts)
    positions_rows = sum(positions_processed(counts, mb, share_prompts)[0] for mb in by_rows)
    if not share_prompts or keep_groups is False:
        return StepLayout(by_rows, False, positions_rows)
    by_groups = _cheapest_cuts(_group_units(counts, rows, budget), budget, counts, True)
    positions_groups = sum(positions_processed(counts, mb, True)[0] for mb in by_groups)
    groups_win = positions_groups < positions_rows if keep_groups is None else True
    return StepLayout(by_groups if groups_win else by_rows, groups_win, positions_rows, positions_groups)


def _packed_microbatches(counts: TokenCounts, rows: list[int], budget: int) -> list[list[int]]:
    """The fewest Karmarkar-Karp parts of `rows` whose real tokens each fit `budget` (a row over it alone)."""
    if not rows:
        return []
    tokens = [counts.row_tokens(r) for r in rows]
    over = [r for r, t in zip(rows, tokens, strict=True) if t > budget]
    rest = [r for r, t in zip(rows, tokens, strict=True) if t <= budget]
    parts = max(1, -(-sum(counts.row_tokens(r) for r in rest) // budget)) if rest else 0
    while rest:
        split = karmarkar_karp([counts.row_tokens(r) for r in rest], parts)
        if all(sum(counts.row_tokens(rest[i]) for i in part) <= budget for part in split):
            return [[r] for r in over] + [[rest[i] for i in part] for part in split if part]
        parts += 1
    return [[r] for r in over]


def karmarkar_karp(weights: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of `weights` in `parts` sets of near-equal sums, by the largest differencing method (Karmarkar and
    Karp 1982; verl's `karmarkar_karp` with equal_size=False): every item starts as a partial partition of its own;
    the two partitions with the largest spread are merged, one's heaviest set with the other's lightest, until one
    is left. Sets may hold different numbers of items; some are empty when there are fewer items than parts.
    Deterministic (ties broken by index). Each set's indices come sorted."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    # A partial partition: `parts` (sum, indices) sets, heaviest first; the heap pops the largest spread first.
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for order, (index, weight) in enumerate(sorted(enumerate(weights), key=lambda p: (p[1], p[0]))):
        sets = [(weight, [index])] + [(0, []) for _ in range(parts - 1)]
        heapq.heappush(heap, (-weight, order, sets))
    counter = len(heap)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        merged = [(a + b, ia + ib) for (a, ia), (b, ib) in zip(first, reversed(second), strict=True)]
        merged.sort(key=lambda s: (-s[0], s[1]))
        counter += 1
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], counter, merged))
    if not heap:
        return [[] for _ in range(parts)]
    return [sorted(indices) for _, indices in heap[0][2]]


def rank_shares(
    counts: TokenCounts, rows: Sequence[int], ranks: int, keep_groups: bool, share_prompts: bool
) -> list[list[int]]:
    """`rows` spread over `ranks` data-parallel ranks by token count (verl's balance_batch, without its equal row
    counts: the step's totals give any split its exact share), whole groups when `keep_groups`. The weight of a
    unit is the tokens its forward runs alone (a shared prompt once). Each rank's rows come in `rows`' order."""
    units = groups_of(counts, rows) if keep_groups else [[r] for r in rows]
    weights = [positions_processed(counts, unit, share_prompts)[1] for unit in units]
    position = {row: i for i, row in enumerate(rows)}
    shares = []
    for part in karmarkar_karp(weights, ranks):
        share = [row for unit_index in part for row in units[unit_index]]
        shares.append(sorted(share, key=position.__getitem__))
    return shares


def equalize(per_rank: list[list[list[int]]]) -> list[list[list[int]]]:
    """Every rank's microbatches padded with empty ones (a dummy microbatch: one row, its loss x 0) to the most any
    rank has, so every rank makes the same collective calls (DDP's gradient reduction, FSDP's gathers)."""
    most = max((len(mbs) for mbs in per_rank), default=0)
    return [mbs + [[] for _ in range(most - len(mbs))] for mbs in per_rank]
