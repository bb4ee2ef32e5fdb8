"""Packed rows: a microbatch's sequences (prompt + response, unpadded) concatenated into a few rows, position ids
restarting at 0 for each sequence, so the model processes tokens instead of padding (train.pack_sequences).

transformers (`masking_utils`, 4.57.1 to 5.x) reads restarting position ids as sequence boundaries and builds the
block-diagonal causal mask itself (sdpa, eager, flex; sliding windows measured inside each sequence), but only when
the forward gets ``attention_mask=None`` and no cache (``use_cache=False``): an all-ones mask or a cache makes it
skip the detection and every sequence attends to the ones before it in its row. flash-attention's variable-length
path (`_flash_attention_forward`) detects the same position ids, but only in a batch of one row, so there the whole
microbatch is one row (:func:`packed_row_tokens`). Where the architecture does something else with positions
(chunked attention counts its chunks from the row's start; a recurrent state runs across sequence boundaries), the
packed forward scores wrong: the probe (:func:`packing_problem`) compares packed against separate log-probs on
the model itself before training, then changes one packed sequence at a time and requires every other one's
packed log-probs to stay bitwise the same (:func:`packed_sequences_leak`, which no rounding tolerance can hide),
and a model that fails either keeps the padded layout.

The layout changes, never the scores: the model is called where it always is (core/logprobs.py), on the packed
rows, and :func:`unpack_at` hands back the last hidden states at the padded layout's response positions in its
row-major order, so the one log-prob computation (core/logprobs.py, core/chunked_logprobs.py) fills the same
(rows x response) log-probs and entropies as without packing, and the losses, masks and step totals after it are
untouched.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from grpo_cli.core.causal_lm import as_causal_lm


@dataclass(frozen=True)
class PackedRows:
    """A padded (B, T) batch's sequences packed into (R, L) rows."""

    input_ids: torch.Tensor  # (R, L) long; padding after the last sequence of a row
    position_ids: torch.Tensor  # (R, L) long, 0, 1, ... per sequence (the row's padding counts as one more)
    # (B, T) long: where each padded position went, as a flat index r * L + l into the packed rows; -1 for the
    # positions not packed (the padding after each sequence, and rows without a response)
    index: torch.Tensor
    sequences: int  # sequences packed (rows of the padded batch with a response)


def sequence_lengths(response_mask: torch.Tensor) -> list[int]:
    """Each row's real length in a right-padded (input_ids, labels, response_mask) batch: up to its last response
    position (the input there predicts the last response token; what follows is padding), 0 for a row without a
    response, whose positions are never scored."""
    mask = response_mask.bool()
    columns = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (mask * columns).amax(dim=1).tolist() if mask.shape[1] else [0] * mask.shape[0]


def assign_rows(lengths: list[int], row_tokens: int | None) -> list[list[int]]:
    """The sequences (indices into `lengths`, zero lengths left out) of each packed row: first-fit decreasing into
    rows of at most `row_tokens` tokens (a longer sequence is a row of its own), or one row when None. Each row
    lists its sequences in their original order."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (-lengths[i], i))
    if row_tokens is None:
        return [sorted(order)] if order else []
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(max(row_tokens, lengths[i]) - lengths[i])
    return [sorted(row) for row in rows]


def pack_rows(
    input_ids: torch.Tensor, response_mask: torch.Tensor, row_tokens: int | None = None, pad_id: int = 0
) -> PackedRows:
    """Pack the sequences of a right-padded batch (make_microbatch's input_ids and response_mask, (B, T)) into
    rows of `row_tokens` tokens at most (:func:`assign_rows`; None: one row). Rows are as wide as the widest."""
    device = input_ids.device
    lengths = sequence_lengths(response_mask)
    rows = assign_rows(lengths, row_tokens)
    width = max((sum(lengths[i] for i in row) for row in rows), default=1)
    packed_ids = torch.full((max(len(rows), 1), width), pad_id, dtype=torch.long, device=device)
    positions = torch.zeros_like(packed_ids)
    index = torch.full(input_ids.shape, -1, dtype=torch.long, device=device)
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            n = lengths[i]
            packed_ids[r, offset : offset + n] = input_ids[i, :n]
            positions[r, offset : offset + n] = torch.arange(n, device=device)
            index[i, :n] = r * width + offset + torch.arange(n, device=device)
            offset += n
        # The row's padding restarts too: a sequence of its own that no real token attends to.
        positions[r, offset:] = torch.arange(width - offset, device=device)
    return PackedRows(packed_ids, positions, index, sum(1 for n in lengths if n > 0))


def unpack_at(values: torch.Tensor, packed: PackedRows, mask: torch.Tensor) -> torch.Tensor:
    """`values` of the packed rows, (R, L, ...), at the padded batch's `mask` positions ((B, T) bool, inside the
    packed sequences): (N, ...) in the row-major order of `mask`, as ``padded_values[mask]`` would give them.
    Differentiable (a gather)."""
    where = packed.index[mask]  # (N,)
    if bool((where < 0).any()):
        raise ValueError("mask selects positions outside the packed sequences")
    return values.flatten(0, 1)[where]


def packed_row_tokens(model: torch.nn.Module, lengths: list[int]) -> int | None:
    """How long a packed row may be for `model`'s attention: one row for flash-attention (its variable-length
    path reads packed position ids only in a batch of one row, and costs each sequence its own length squared);
    otherwise the width :func:`row_width` finds cheapest for the model's hidden size: sdpa and eager apply the
    block-diagonal mask to a whole (row x row) score matrix, so one row of every sequence would cost the square
    of the microbatch's tokens, and rows of the longest sequence leave up to one row of padding."""
    config = as_causal_lm(model).config
    implementation = str(getattr(config, "_attn_implementation", None) or "")
    if "flash" in implementation:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None)
    return row_width(lengths, hidden if isinstance(hidden, int) and hidden > 0 else None)


def packed_positions(lengths: list[int], row_tokens: int | None) -> tuple[int, int]:
    """(rows, width) of :func:`pack_rows` for sequences of `lengths` at `row_tokens`: width x rows positions."""
    rows = assign_rows(lengths, row_tokens)
    return len(rows), max((sum(lengths[i] for i in row) for row in rows), default=0)


def row_width(lengths: list[int], hidden_size: int | None) -> int:
    """The packed row width that costs least under masked (sdpa, eager) attention: for each row count k, the
    narrowest width (at least the longest sequence and tokens / k) at which first-fit decreasing fills k rows,
    priced rows x width x (1 + width / hidden_size); k falls until no wider row can be cheaper.

    Why that price: per position and layer the projections and MLP cost ~12 hidden^2 multiply-adds and the
    masked attention ~2 x width x hidden over the whole row (its mask is applied, not skipped), a ratio of
    width / (6 hidden); the (row x row) scores' mask and softmax are memory-bound on top, so the price takes
    width / hidden, which ranks the layouts as measured (docs/results/2026-11-28-packing.md, SmolLM2's 4 layers
    on a long-tailed microbatch: two rows of 646 at 0.76x the time of three rows of the longest, 571, and one
    row of 1,250 at 0.99x). A few rows slightly wider than the longest sequence often fill exactly where rows
    of the longest leave most of a row empty. Without a hidden size: rows of the longest sequence."""
    real = [n for n in lengths if n > 0]
    longest = max(real, default=1)
    if hidden_size is None or not real:
        return longest
    tokens = sum(real)
    best: tuple[float, int, int] | None = None  # (cost, positions, width)
    for k in range(-(-tokens // longest), 0, -1):
        narrowest = max(longest, -(-tokens // k))
        if best is not None and tokens * (1 + narrowest / hidden_size) >= best[0]:
            break  # every later candidate is wider and costs at least this much even without padding
        width = _narrowest_width_for(real, k, narrowest, tokens)
        rows, filled = packed_positions(real, width)
        cost = rows * filled * (1 + filled / hidden_size)
        if best is None or (cost, rows * filled) < best[:2]:
            best = (cost, rows * filled, width)
    assert best is not None
    return best[2]


def _narrowest_width_for(lengths: list[int], rows: int, low: int, high: int) -> int:
    """The narrowest width in [low, high] at which first-fit decreasing fills at most `rows` rows (bisection:
    wider rows never need more of them in practice; `high`, every token in one row, always fits)."""
    while low < high:
        middle = (low + high) // 2
        if len(assign_rows(lengths, middle)) <= rows:
            high = middle
        else:
            low = middle + 1
    return low


def packing_beats_sharing(
    prompt_lengths: list[int], completion_lengths: list[int], distinct_prompt_lengths: list[int]
) -> bool:
    """Whether a microbatch processes fewer positions packed than through the shared-prompt forward, the two
    layouts that cannot be combined (transformers' packed detection has no "attend to my prompt and to myself"):
    packed, every sequence once without padding (sum of prompt + completion - 1); shared, each distinct prompt
    once, left-padded to the longest, then every completion padded to the longest (core/prompt_sharing.py).
    Long-tailed completions make the shared layout mostly padding; equal ones with long prompts make it cheaper.

    Args: per row, its prompt's and completion's lengths; the lengths of the distinct prompts."""
    packed = sum(p + c - 1 for p, c in zip(prompt_lengths, completion_lengths, strict=True) if c > 0)
    shared = len(distinct_prompt_lengths) * max(distinct_prompt_lengths, default=0) + len(completion_lengths) * max(
        max(completion_lengths, default=0) - 1, 0
    )
    return packed < shared


# The probe's longest window: a model whose attention declares a longer sliding window or chunk is not packed
# (the probe must cross every window to see it; its two forwards cost about 2 x this many tokens).
PROBE_MAX_WINDOW = 8192
_WINDOW_KEYS = ("sliding_window", "attention_chunk_size", "attention_window_size", "chunk_size")


def probe_lengths(config: object) -> list[int]:
    """The probe's sequence lengths for a model `config`: sequences longer than every sliding window or attention
    chunk the config declares, packed at offsets that are not multiples of them (a chunked mask counted from the
    row's start shows), with a short one and the row padding beside them; [] when a window is longer than
    PROBE_MAX_WINDOW or the model's context cannot hold the probe."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    windows = [w for w in (getattr(text, key, None) for key in _WINDOW_KEYS) if isinstance(w, int) and w > 0]
    longest_window = max(windows, default=0)
    if longest_window > PROBE_MAX_WINDOW:
        return []
    n = max(8, longest_window + 3)
    # Rows of the longest (n + 5): [n + 5], [n // 2 + 3, n // 2 + 2 + (n % 2)] (the second starts mid-row and ends
    # past n), [3] + padding.
    lengths = [n // 2 + 3, n + 5, 3, n // 2 + 2 + n % 2]
    context = getattr(text, "max_position_embeddings", None)
    if isinstance(context, int) and context < max(lengths):
        return []
    return lengths


Score = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def packing_problem(model: torch.nn.Module, score: Score, tolerance: float = 1e-5) -> str | None:
    """Why `model` cannot be scored packed (one clause naming the model type), or None when it can: on a short
    synthetic batch (:func:`probe_lengths`), the response log-probs `score(input_ids, labels, mask, packed)`
    gives ((N,), the scoring path's own computation), in eval mode and without grad, pass two checks:

    1. packed against one unpadded forward per sequence, to `tolerance`; where the weights are half precision,
       whose rounding differs between batch shapes anyway, to 4 x the padded batch's own difference from the
       separate forwards or one unit in the last place of the largest log-prob, whichever is larger;
    2. :func:`packed_sequences_leak`: no packed sequence's log-probs move by a single bit when another one's tokens
       change. A leak small enough to hide inside check 1's half-precision tolerance still fails here.

    A model whose forward takes no position ids, or computes something else from them (chunked attention counted
    from the row's start, a recurrent state), differs or fails here, and is never trained on a wrong number."""
    config = as_causal_lm(model).config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", None) or type(model).__name__
    lengths = probe_lengths(config)
    if not lengths:
        return f"{model_type}'s attention window or context does not fit the packing probe (<= {PROBE_MAX_WINDOW})"
    parameter = next(model.parameters())
    vocab = int(getattr(text, "vocab_size", 0) or 0) or 2
    generator = torch.Generator().manual_seed(0)
    width = max(lengths)
    input_ids = torch.zeros((len(lengths), width), dtype=torch.long)
    labels = torch.zeros_like(input_ids)
    mask = torch.zeros((len(lengths), width), dtype=torch.bool)
    for row, n in enumerate(lengths):
        tokens = torch.randint(1, vocab, (n + 1,), generator=generator)
        input_ids[row, :n], labels[row, :n] = tokens[:-1], tokens[1:]
        mask[row, 1:n] = True  # the first label is the prompt's
    input_ids, labels, mask = (t.to(parameter.device) for t in (input_ids, labels, mask))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = score(input_ids, labels, mask, True).float()
            padded = score(input_ids, labels, mask, False).float()
            separate = torch.cat(
                [
                    score(input_ids[row : row + 1, :n], labels[row : row + 1, :n], mask[row : row + 1, :n], False)
                    for row, n in enumerate(lengths)
                ]
            ).float()
            if parameter.dtype not in (torch.float32, torch.float64):
                # Half precision rounds differently in every batch shape (a sequence at another offset of a longer
                # row): allow 4 x the padded batch's own difference, or one unit in the last place of the largest
                # log-prob (eps x |value|), whichever is larger; a wrong mask is usually off by tenths (0.17-5.8,
                # measured), not ulps, but a weak leak is not: check 2 is the one that cannot be fooled.
                ulp = torch.finfo(parameter.dtype).eps * float(separate.abs().max())
                tolerance = max(tolerance, 4 * float((padded - separate).abs().max()), ulp)
            difference = float((packed - separate).abs().max())
            if not difference <= tolerance:  # nan too
                return (
                    f"{model_type} scores packed rows {difference:.2g} off separate sequences "
                    f"(tolerance {tolerance:.0e})"
                )
            leak = packed_sequences_leak(score, input_ids, labels, mask, vocab)
    except Exception as error:  # noqa: BLE001 - any failure of the packed forward means: do not pack
        return f"{model_type}'s forward fails on packed rows ({type(error).__name__}: {str(error)[:100]})"
    finally:
        model.train(was_training)
    return None if leak is None else f"{model_type} {leak}"


def packed_sequences_leak(
    score: Score, input_ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, vocab: int
) -> str | None:
    """Whether packed sequences see each other, by an exact test instead of a tolerance: change one sequence's
    tokens (same length, every token another one), score packed again, and require every other sequence's
    log-probs to be bitwise unchanged; each sequence in turn, so a leak shows in whichever direction it runs and
    whichever rows the scoring path packs the sequences into. Under a block-diagonal mask another sequence's tokens
    reach a score only as a masked attention weight, exactly 0, so equal shapes give equal bits. A model whose
    matmul shapes follow the tokens (a mixture of experts runs each expert on the tokens routed to it) can round a
    sequence differently when another one changes; that is refused too, and the reason names both causes.

    A control comes first: the same input scored twice must match bitwise, with torch's deterministic algorithms
    on (warn_only: an op without a deterministic version warns instead of raising, and the control sees whether
    it actually repeats); the previous setting is restored after. A device whose kernels do not repeat bitwise
    cannot run the test, and says so instead of passing.

    Args: `score` as in :func:`packing_problem`; a right-padded batch of one sequence per row (input_ids, labels,
    mask: (B, T), mask True at the scored positions, from position 1 up to each sequence's length); `vocab`,
    the token ids to draw from (1..vocab-1). Returns a clause (after the model's name) or None. Call it without
    grad, in eval mode."""
    if vocab < 3:
        return "has fewer than 3 token ids, too few for the packing leak test (it changes every token)"
    lengths = sequence_lengths(mask)
    # Each row's share of score()'s (N,) output, in its row-major order.
    ends = mask.sum(dim=1).cumsum(dim=0).tolist()
    starts = [0, *ends[:-1]]
    with deterministic_algorithms():
        first = score(input_ids, labels, mask, True)
        second = score(input_ids, labels, mask, True)
        if not torch.equal(first, second):
            return (
                "scores the same packed rows differently on a second run with torch's deterministic algorithms "
                f"on (by {float((first.float() - second.float()).abs().max()):.2g}; nondeterministic kernels on "
                f"{first.device.type}), so the packing leak test cannot run"
            )
        for changed, n in enumerate(lengths):
            if n == 0:
                continue
            tokens = torch.cat([input_ids[changed, :n], labels[changed, n - 1 : n]])  # the sequence's n + 1 ids
            other = tokens % (vocab - 1) + 1  # every id another one of 1..vocab-1 (k -> k + 1, the last -> 1)
            ids, targets = input_ids.clone(), labels.clone()
            ids[changed, :n], targets[changed, :n] = other[:-1], other[1:]
            moved = score(ids, targets, mask, True)
            for row, (start, end) in enumerate(zip(starts, ends, strict=True)):
                if row != changed and not torch.equal(moved[start:end], first[start:end]):
                    by = float((moved[start:end].float() - first[start:end].float()).abs().max())
                    # Both causes refuse: no test without a tolerance can tell them apart, and a tolerance is
                    # what a weak leak hides in (qwen2_moe's tiny fp32 model on CPU moves by one unit in the
                    # last place, through expert matmuls sized by the tokens routed to each expert).
                    return (
                        f"moved packed sequence {row}'s log-probs by {by:.2g} when sequence {changed}'s tokens "
                        "changed (packed sequences that see each other, or rounding that follows the batch's "
                        "other tokens, as mixture-of-experts routing does)"
                    )
    return None


@contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """torch's deterministic algorithms on (warn-only: an op without a deterministic version warns instead of
    raising, and a leak test's control sees whether it actually repeats), the previous setting restored after."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings():
            # torch's notices that an op (cuBLAS without CUBLAS_WORKSPACE_CONFIG, ...) may not repeat: the control
            # measures whether it does, so the notice would only be a line the user cannot act on.
            warnings.filterwarnings("ignore", message=".*deterministic", category=UserWarning)
            yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
