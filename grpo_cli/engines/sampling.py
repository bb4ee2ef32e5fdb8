"""The project's one sampling function: temperature, top-p, and a Gumbel-max draw from per-completion streams.

Every completion owns a random stream seeded from (step seed, prompt index within the step, completion index)
alone (`completion_seed`). Which other prompts share the batch, how prompts are chunked or split across
data-parallel ranks, and how rows are padded do not change which random numbers a completion sees, so the same
seed samples the same completions for a prompt whatever the world size (up to floating-point differences in the
logits themselves). The transformers engine draws from one `torch.Generator` per row (`row_generators`); vLLM gets
the same seed as a per-request seed.

The draw is exact Gumbel-max (`argmax(logits / T + G)`, G i.i.d. Gumbel(0, 1), is a sample of softmax(logits / T))
done in two stages, so that a step needs a few hundred random numbers per row instead of one per vocabulary entry:
a vocabulary block is drawn by Gumbel-max over the blocks' log-masses (logsumexp), then a token inside it by
Gumbel-max over its logits. P(token) = P(block) * P(token | block) = softmax(logits / T)[token], exactly.

Shapes: B rows (completions), V vocabulary entries.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1
# Vocabulary block of the two-stage draw: 49152 entries (SmolLM2) are 192 blocks of 256, so a row draws 192 + 256
# Gumbel variables per token instead of 49152.
BLOCK = 256


def _splitmix64(x: int) -> int:
    """One round of SplitMix64: a bijective 64-bit mix, so nearby inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def completion_seed(seed: int, prompt_index: int, completion_index: int) -> int:
    """The seed of one completion's random stream: a hash of (seed, prompt index, completion index) only.

    Hashed rather than added (seed + i * n + j), so that streams of neighbouring steps or prompts never coincide.
    63 bits: vLLM serializes seeds as int64, torch.Generator takes any of them.
    """
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (prompt_index & _MASK64))
    h = _splitmix64(h ^ (completion_index & _MASK64))
    return h >> 1


def turn_seed(seed: int, turn: int) -> int:
    """The seed of a multi-turn episode's `turn`-th model turn (0-based) in a batch sampled with `seed`: each turn
    draws from fresh streams (seeded by this and the episode's index), unrelated to any other turn's or step's."""
    return completion_seed(seed, _TURN_STREAMS, turn)


# Salts turn seeds away from completion seeds: no (prompt index) of a step comes near it.
_TURN_STREAMS = 1 << 62


def row_generators(
    seed: int,
    first_prompt_index: int,
    n_prompts: int,
    n: int,
    device: torch.device | str = "cpu",
    prompt_indices: Sequence[int] | None = None,
) -> list[torch.Generator]:
    """One generator per row, rows in prompt-major order (prompt 0's n completions, then prompt 1's, ...).

    first_prompt_index: the index of this batch's first prompt within the step's whole prompt list;
    prompt_indices: each prompt's index given explicitly instead (n_prompts of them; `SamplingSettings`).
    """
    if prompt_indices is not None and len(prompt_indices) != n_prompts:
        raise ValueError(f"{len(prompt_indices)} prompt indices for {n_prompts} prompts")
    indices = range(first_prompt_index, first_prompt_index + n_prompts) if prompt_indices is None else prompt_indices
    generators = []
    for prompt in indices:
        for completion in range(n):
            generator = torch.Generator(device=device)
            generator.manual_seed(completion_seed(seed, prompt, completion))
            generators.append(generator)
    return generators


def suppress_tokens_(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """logits (B, V): set the given token ids to -inf in every row, in place (EOS before min_tokens)."""
    logits.index_fill_(-1, token_ids, float("-inf"))
    return logits


def top_p_mask_(logits: torch.Tensor, top_p: float, candidates: int = 1024) -> torch.Tensor:
    """Keep the nucleus of each row of logits (B, V), in place: the fewest most likely tokens whose probability
    reaches top_p (a token is kept when the mass of the tokens ranked above it is below top_p, as in transformers
    and vLLM); the rest become -inf.

    The nucleus is looked for among the `candidates` most likely tokens (a top-k, not a sort of the whole
    vocabulary); a row whose nucleus is larger falls back to a full sort.
    """
    if top_p >= 1.0:
        return logits
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (B, V)
    k = min(candidates, logits.shape[-1])
    top, order = torch.topk(probs, k, dim=-1)  # (B, k), descending
    if k < logits.shape[-1] and bool(((top.cumsum(-1) - top)[:, -1] < top_p).any()):
        top, order = torch.sort(probs, dim=-1, descending=True)  # some nucleus is wider than k
    keep = (top.cumsum(-1) - top) < top_p  # (B, k): mass ranked above each candidate
    kept_logits = torch.where(keep, logits.gather(-1, order), float("-inf"))
    logits.fill_(float("-inf")).scatter_(-1, order, kept_logits)
    return logits


def _gumbel(rows: int, width: int, generators: Sequence[torch.Generator], device: torch.device) -> torch.Tensor:
    """(rows, width) Gumbel(0, 1) noise, row r from generators[r] (float64: -log E never meets E == 0)."""
    noise = torch.empty(rows, width, dtype=torch.float64, device=device)
    for row, generator in enumerate(generators):
        noise[row].exponential_(generator=generator)
    return noise.log_().neg_()


def gumbel_max_(logits: torch.Tensor, generators: Sequence[torch.Generator], block: int = BLOCK) -> torch.Tensor:
    """One token per row of logits (B, V), sampled from softmax(logits): (B,) int64.

    Two-stage Gumbel-max (module docstring): each row draws ceil(V / block) + block Gumbel variables from its own
    generator per call, the same count whatever the row's values, so a stream advances identically in any batch.
    `logits` may be overwritten (padded copy or not).
    """
    rows, vocab = logits.shape
    blocks = -(-vocab // block)
    if blocks * block != vocab:  # pad with -inf: a padded entry has probability 0
        logits = torch.nn.functional.pad(logits, (0, blocks * block - vocab), value=float("-inf"))
    by_block = logits.view(rows, blocks, block)  # (B, blocks, block)
    block_log_mass = torch.logsumexp(by_block, dim=-1)  # (B, blocks)
    block_noise = _gumbel(rows, blocks, generators, logits.device)  # drawn before the in-block noise, always
    chosen = (block_log_mass + block_noise).argmax(-1)  # (B,)
    inside = by_block[torch.arange(rows, device=logits.device), chosen]  # (B, block)
    inside_noise = _gumbel(rows, block, generators, logits.device)
    return chosen * block + (inside + inside_noise).argmax(-1)


def sample_next_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """The next token of every row: logits (B, V) of the last position -> (B,) int64 token ids.

    temperature 0 is greedy (argmax, no random numbers drawn); otherwise a sample of softmax(logits / T) restricted
    to the top-p nucleus, row r drawn from generators[r]. `logits` is modified in place (scaled, masked).
    """
    if temperature == 0:
        return logits.argmax(-1)
    if logits.dtype != torch.float32:
        logits = logits.float()  # bf16 logits under autocast: sample in fp32
    if temperature != 1.0:
        logits.div_(temperature)
    top_p_mask_(logits, top_p)
    return gumbel_max_(logits, generators)


def sampler_log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) over the whole vocabulary in float32, (B, V) -> (B, V): the distribution
    `sample_next_tokens` draws from before top-p truncation (temperature 0, greedy: log softmax(logits))."""
    logits = logits.float()
    return torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)
