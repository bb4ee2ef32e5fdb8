"""The shared-prompt forward without padding: each distinct prompt once, followed in the same packed row by every
one of its completions, a mask letting each completion see its prompt and its own earlier tokens only.

The two-pass shared forward (core/prompt_sharing.py) runs the completions as a (rows x longest completion) batch on
top of the prompts' cache, so every completion shorter than the longest is padded: 27-38% of the positions it
computed on the keyword task's steps (completions of 1 to 48 tokens; docs/results/2026-12-07-prompt-tree.md). Here
a group is one segment, ``[prompt, completion 1 inputs, completion 2 inputs, ...]``, position ids restarting at the
prompt's length for every completion, and the segments are packed into rows by core.packing's first-fit (rows as
wide as core.packing.row_width finds cheapest for masked attention). The model gets a custom 4D mask:
transformers' mask builders pass a 4D mask through unchanged (`masking_utils`, 4.57.1 to 5.x), and sdpa and eager
attention apply it as given, so query position q of a completion attends to key k exactly when k is its prompt's
or an earlier position of its own completion: the same keys, values and positions as the plain forward gives
that completion, hence the same log-probs (up to float rounding) and, through the one prompt pass, the gradients
of all its completions summed into the prompt, as the two-pass forward does.

What it serves (:func:`prompt_tree_refusal`): what the two-pass forward serves, with sdpa or eager attention (a
flash or flex kernel takes no dense mask) and full attention in every layer: a sliding window or a chunk is
measured in mask columns that transformers builds itself, and a custom mask replaces that. Everything else keeps
the two-pass forward. The probe (:func:`prompt_tree_problem`) compares the tree against the plain forward on the
model itself before training and checks that no completion's log-probs move by a bit when a sibling's tokens
change, so a model that reads the mask otherwise is never trained on a wrong number.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_cli.core.causal_lm import as_causal_lm
from grpo_cli.core.packing import assign_rows, deterministic_algorithms
from grpo_cli.core.prompt_sharing import distinct_prompts, prompt_sharing_problem

# The attention implementations that apply a dense 4D mask as given (a bool one for sdpa, an additive one for
# eager: eager adds the mask to the scores).
MASKED_ATTENTION = frozenset({"sdpa", "eager"})
_FULL_ATTENTION_KINDS = frozenset({"full_attention", "attention"})
_WINDOW_KEYS = ("sliding_window", "attention_chunk_size", "attention_window_size", "chunk_size")


@dataclass(frozen=True)
class PromptTreeRows:
    """A right-padded (B, T) batch's groups (a prompt and its completions) as (R, L) packed rows."""

    input_ids: torch.Tensor  # (R, L) long; padding after the row's last segment
    position_ids: torch.Tensor  # (R, L) long: a prompt 0..P-1, each of its completions from P on; padding 0
    attends: torch.Tensor  # (R, 1, L, L) bool: query l attends to key m (padding attends to itself only)
    # (N,) long: for each response token of the padded batch, in the row-major order of its response mask, the
    # flat position r * L + l whose hidden state predicts it (the prompt's last one for a completion's first token)
    index: torch.Tensor


def segment_lengths(prompt_lengths: list[int], completion_lengths: list[list[int]]) -> list[int]:
    """Positions of each group's segment: its prompt, then every completion's tokens but the last (only a label).

    Args: per distinct prompt, its length and its completions' lengths."""
    return [
        p + sum(max(n - 1, 0) for n in lengths) for p, lengths in zip(prompt_lengths, completion_lengths, strict=True)
    ]


def prompt_tree_rows(
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    response_mask: torch.Tensor,
    row_tokens: Callable[[list[int]], int | None],
    pad_id: int = 0,
) -> PromptTreeRows:
    """The packed rows of a right-padded (input_ids, labels, response_mask) batch ((B, T) each, as make_microbatch
    builds them), its groups' segments in rows of `row_tokens(segment lengths)` positions at most (None: one row).
    Built on the CPU in Python (a few hundred positions per microbatch) and moved to the batch's device."""
    device = input_ids.device
    mask = response_mask.bool().cpu()
    prompts, row_to_prompt, _ = distinct_prompts(input_ids.cpu(), mask)
    completion_lengths = mask.sum(dim=1).tolist()
    members: list[list[int]] = [[] for _ in prompts]
    for batch_row, group in enumerate(row_to_prompt):
        members[group].append(batch_row)
    lengths = segment_lengths([len(p) for p in prompts], [[completion_lengths[r] for r in m] for m in members])
    rows = assign_rows(lengths, row_tokens(lengths))
    width = max(sum(lengths[g] for g in row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    # Per position: its segment id (a prompt's: its group; a completion's: len(prompts) + its batch row; a padding
    # position's: one of its own) and the group whose prompt it may see (-1: none, padding).
    segment = torch.arange(len(rows) * width).view(len(rows), width) + len(prompts) + len(completion_lengths)
    prompt_of = torch.full((len(rows), width), -1, dtype=torch.long)
    predicting: dict[int, list[int]] = {}  # batch row -> flat index of the position predicting each response token
    labels_cpu = labels.cpu()
    for r, row in enumerate(rows):
        offset = 0
        for group in row:
            prompt = prompts[group]
            p = len(prompt)
            ids[r, offset : offset + p] = torch.tensor(prompt)
            positions[r, offset : offset + p] = torch.arange(p)
            segment[r, offset : offset + p] = group
            prompt_of[r, offset : offset + p] = group
            last_prompt = r * width + offset + p - 1
            start = offset + p
            for member in members[group]:
                n = completion_lengths[member]
                inputs = max(n - 1, 0)
                ids[r, start : start + inputs] = labels_cpu[member][mask[member]][:inputs]
                positions[r, start : start + inputs] = p + torch.arange(inputs)
                segment[r, start : start + inputs] = len(prompts) + member
                prompt_of[r, start : start + inputs] = group
                predicting[member] = [last_prompt, *range(r * width + start, r * width + start + inputs)][:n]
                start += inputs
            offset = start
    # The (R, L, L) mask is built where it is used: only the (R, L) ids cross to the device.
    segment, prompt_of = segment.to(device), prompt_of.to(device)
    causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
    same_segment = segment[:, :, None] == segment[:, None, :]  # (R, L, L)
    own_prompt = prompt_of[:, :, None] == segment[:, None, :]  # key m is in query l's prompt (ids < len(prompts))
    attends = (same_segment | own_prompt) & causal
    index = torch.tensor([i for batch_row in range(len(completion_lengths)) for i in predicting.get(batch_row, [])])
    return PromptTreeRows(ids.to(device), positions.to(device), attends[:, None], index.to(device, torch.long))


def model_mask(attends: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """The 4D mask as the attention `implementation` applies it: sdpa takes the bool mask (True: attend), eager adds
    the mask to its scores (0 where attended, the dtype's most negative value elsewhere)."""
    if implementation == "sdpa":
        return attends
    return torch.zeros(attends.shape, dtype=dtype, device=attends.device).masked_fill_(~attends, torch.finfo(dtype).min)


def attention_implementation(model: torch.nn.Module) -> str:
    """The attention implementation transformers runs `model` with (its config's; eager where it names none)."""
    config = as_causal_lm(model).config
    return str(getattr(config, "_attn_implementation", None) or "eager")


def prompt_tree_hidden(
    model: torch.nn.Module,
    decoder: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    response_mask: torch.Tensor,
    row_tokens: Callable[[list[int]], int | None],
) -> torch.Tensor:
    """Hidden states at the response label positions, (N, H) in row-major order of `response_mask`: equal (up to
    float rounding) to `decoder(input_ids).last_hidden_state[response_mask]`, each distinct prompt computed once.
    `model` is the causal LM `decoder` belongs to (its config names the attention)."""
    tree = prompt_tree_rows(input_ids, labels, response_mask, row_tokens)
    dtype = next(model.parameters()).dtype
    dtype = dtype if dtype.is_floating_point else torch.float32  # quantized weights: the scores are float
    mask = model_mask(tree.attends, attention_implementation(model), dtype)
    hidden = decoder(
        input_ids=tree.input_ids, position_ids=tree.position_ids, attention_mask=mask, use_cache=False
    ).last_hidden_state  # (R, L, H)
    return hidden.flatten(0, 1)[tree.index]


def _text_config(model: torch.nn.Module) -> tuple[object, str]:
    """The model's (text) config and the model type its messages name."""
    config = as_causal_lm(model).config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return text, getattr(text, "model_type", None) or type(model).__name__


def prompt_tree_refusal(model: torch.nn.Module) -> str | None:
    """Why the tree cannot score `model` by its config alone (one clause naming the model type), or None: the
    two-pass shared forward's refusals, an attention implementation outside MASKED_ATTENTION, and any layer that
    is not full attention (a sliding window, a chunk: their masks are the model's own)."""
    problem = prompt_sharing_problem(model)
    if problem is not None:
        return problem
    text, model_type = _text_config(model)
    implementation = attention_implementation(model)
    if implementation not in MASKED_ATTENTION:
        return f"{model_type} runs {implementation} attention, which takes no dense mask"
    kinds = getattr(text, "layer_types", None)
    if isinstance(kinds, list | tuple) and kinds:
        others = sorted({str(kind) for kind in kinds} - _FULL_ATTENTION_KINDS)
        if others:
            return f"{model_type} has {'/'.join(others)} layers"
        return None
    windowed = getattr(text, "use_sliding_window", True) is not False
    windows = [key for key in _WINDOW_KEYS if isinstance(getattr(text, key, None), int) and getattr(text, key) > 0]
    if windowed and windows:
        return f"{model_type} declares {windows[0]}={getattr(text, windows[0])}"
    return None


# score(input_ids, labels, mask, layout) -> the (N,) response log-probs of the scoring path, `layout` one of LAYOUTS.
Score = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, str], torch.Tensor]
LAYOUTS = ("plain", "shared", "tree")  # the padded forward, the two-pass shared-prompt forward, the prompt tree


def prompt_tree_problem(model: torch.nn.Module, score: Score, tolerance: float = 1e-5) -> str | None:
    """Why `model` cannot be scored through the tree (one clause), or None when it can: the config refusals
    (:func:`prompt_tree_refusal`), then on a short synthetic batch (two prompts of 5 and 9 tokens, three and two
    completions of 1 to 7 tokens) the response log-probs `score` gives (the scoring path's own computation; eval
    mode, no grad) must

    1. equal one unpadded forward per row to `tolerance`, or to 4 x what the padded and the two-pass shared
       forwards differ from those by, or one unit in the last place of the largest log-prob, whichever is largest
       (the rounding of a deep model follows the batch's shape; a wrong mask is off by tenths, not ulps);
    2. stay bitwise the same for every other completion when each prompt's first completion's tokens change
       (:func:`_sibling_leak`: a mask that leaks between completions shows however small, since masked keys weigh
       exactly 0; under the causal mask only the positions after that completion could see it)."""
    refusal = prompt_tree_refusal(model)
    if refusal is not None:
        return refusal
    text, model_type = _text_config(model)
    parameter = next(model.parameters())
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    if vocab < 3:
        return f"{model_type} has fewer than 3 token ids, too few for the prompt tree's probe"
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (n,), generator=generator) for n in (5, 9)]
    rows = [(0, 4), (0, 1), (1, 7), (0, 6), (1, 3)]  # (prompt, completion length)
    ends = [len(prompts[p]) + n - 1 for p, n in rows]  # each row's input positions
    input_ids = torch.zeros((len(rows), max(ends)), dtype=torch.long)
    labels, mask = torch.zeros_like(input_ids), torch.zeros_like(input_ids, dtype=torch.bool)
    for row, (p, n) in enumerate(rows):
        sequence = torch.cat([prompts[p], torch.randint(1, vocab, (n,), generator=generator)])
        input_ids[row, : ends[row]], labels[row, : ends[row]] = sequence[:-1], sequence[1:]
        mask[row, len(prompts[p]) - 1 : ends[row]] = True
    input_ids, labels, mask = (t.to(parameter.device) for t in (input_ids, labels, mask))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            separate = torch.cat(
                [
                    score(input_ids[r : r + 1, :end], labels[r : r + 1, :end], mask[r : r + 1, :end], "plain")
                    for r, end in enumerate(ends)
                ]
            ).float()
            padded, shared, tree = (score(input_ids, labels, mask, layout).float() for layout in LAYOUTS)
            ulp = torch.finfo(parameter.dtype).eps * float(separate.abs().max())
            reference = max(float((padded - separate).abs().max()), float((shared - separate).abs().max()))
            tolerance = max(tolerance, 4 * reference, ulp)
            difference = float((tree - separate).abs().max())
            if not difference <= tolerance:  # nan too
                return (
                    f"{model_type} scores the prompt tree {difference:.2g} off the plain forward "
                    f"(tolerance {tolerance:.1g})"
                )
            # Each prompt's first completion: under a causal mask only later positions can see it, and every other
            # completion of its row (its siblings, the next prompt's) comes after it.
            firsts = [min(r for r, (p, _) in enumerate(rows) if p == prompt) for prompt in range(len(prompts))]
            leak = _sibling_leak(score, input_ids, labels, mask, vocab, firsts)
    except Exception as error:  # noqa: BLE001 - any failure of the tree's forward means: the two-pass forward
        return f"{model_type}'s forward fails on the prompt tree ({type(error).__name__}: {str(error)[:100]})"
    finally:
        model.train(was_training)
    return None if leak is None else f"{model_type} {leak}"


def _sibling_leak(
    score: Score, input_ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, vocab: int, changed: list[int]
) -> str | None:
    """Whether a completion's log-probs move when the tokens of a completion of `changed` change (every response
    token but the prompt's to another id), bitwise, under torch's deterministic algorithms (a control first: the
    same batch scored twice must repeat)."""
    ends = mask.sum(dim=1).cumsum(dim=0).tolist()
    starts = [0, *ends[:-1]]
    with deterministic_algorithms():
        first = score(input_ids, labels, mask, "tree")
        if not torch.equal(first, score(input_ids, labels, mask, "tree")):
            return "scores the same prompt tree differently on a second run, so the sibling leak test cannot run"
        for changed_row in changed:
            ids, targets = input_ids.clone(), labels.clone()
            response = mask[changed_row].clone()
            targets[changed_row][response] = targets[changed_row][response] % (vocab - 1) + 1
            inputs = response.roll(1)
            inputs[0] = False
            inputs &= response  # the input positions holding response tokens (all but the first)
            ids[changed_row][inputs] = ids[changed_row][inputs] % (vocab - 1) + 1
            moved = score(ids, targets, mask, "tree")
            for row, (start, end) in enumerate(zip(starts, ends, strict=True)):
                if row != changed_row and not torch.equal(moved[start:end], first[start:end]):
                    by = float((moved[start:end].float() - first[start:end].float()).abs().max())
                    return (
                        f"moved completion {row}'s log-probs by {by:.2g} under the prompt tree when completion "
                        f"{changed_row}'s tokens changed (completions that see each other)"
                    )
    return None
