"""Metrics of n sampled answers per held-out prompt (docs/evaluation.md): mean@n, pass@k, maj@n. Pure Python.

    mean@n   the fraction of correct samples, averaged over prompts
    pass@k   the chance that at least one of k samples drawn without replacement from the n is correct: the
             unbiased estimator 1 - C(n - c, k) / C(n, k) of Chen et al. 2021 (c correct of n), averaged
    maj@n    whether the answer most samples agree on is correct, averaged; agreeing is the task's
             (math: equivalent under math-verify), and a response with no answer does not vote

"Correct" is the task's own reward (the correctness component) being 1, whatever `task.reward_weights` say:
shaping terms change what is trained, not whether an answer is right.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with `c` correct among `n` samples (Chen et al. 2021, eq. 1).

    1 - C(n-c, k) / C(n, k): one minus the chance that k samples drawn without replacement are all wrong.
    Exact integer binomials (math.comb), so no overflow and no product-form rounding for the n of an eval.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"the number of correct samples must be in 0..n={n}, got {c}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def normalized_text(response: str) -> str:
    """What a task without an extracted answer votes with: the response, lower-cased, whitespace collapsed."""
    return " ".join(response.lower().split())


def answer_groups(answers: Sequence[str | None], same: Callable[[str, str], bool] | None = None) -> list[list[int]]:
    """Indices of agreeing answers, grouped: each answer joins the first group whose first member it agrees with
    (`same(a, b)`, default equal strings), so an equivalence that is not transitive still puts each answer in
    one group. None answers abstain."""
    agree = same or (lambda a, b: a == b)
    groups: list[list[int]] = []
    firsts: list[str] = []  # each group's first answer
    for index, answer in enumerate(answers):
        if answer is None:
            continue
        for first, group in zip(firsts, groups, strict=True):
            if agree(first, answer):
                group.append(index)
                break
        else:
            groups.append([index])
            firsts.append(answer)
    return groups


def majority_group(answers: Sequence[str | None], same: Callable[[str, str], bool] | None = None) -> list[int]:
    """The largest group of agreeing answers (answer_groups); ties go to the group seen first (sample order),
    which keeps the vote deterministic. Empty when no answer voted."""
    groups = answer_groups(answers, same)
    return max(groups, key=len) if groups else []  # max keeps the first of equally large groups


def majority_vote(answers: Sequence[str | None], same: Callable[[str, str], bool] | None = None) -> int | None:
    """Index of the first answer of the majority group: the one that is graded; None when no answer voted."""
    group = majority_group(answers, same)
    return group[0] if group else None


def default_pass_ks(n: int, ks: Sequence[int] | None = None) -> list[int]:
    """The k of pass@k to report: `ks` (eval.pass_k) or 1 and n, each once, in increasing order."""
    return sorted(set(ks)) if ks else sorted({1, n})


def multi_sample_metrics(
    correct: Sequence[Sequence[bool]], votes: Sequence[int | None], ks: Sequence[int], prefix: str = "eval"
) -> dict[str, float]:
    """`<prefix>/mean@n`, `<prefix>/pass@k` for each k, `<prefix>/maj@n`, averaged over prompts.

    correct[i][j]: whether sample j of prompt i is correct (n samples for every prompt); votes[i]: the index of
    prompt i's majority answer (majority_vote), None when none voted (scores 0).
    """
    if not correct or len(correct) != len(votes):
        raise ValueError("need one vote per prompt and at least one prompt")
    n = len(correct[0])
    if any(len(row) != n for row in correct):
        raise ValueError("every prompt needs the same number of samples")
    counts = [sum(map(bool, row)) for row in correct]
    metrics = {f"{prefix}/mean@{n}": sum(c / n for c in counts) / len(counts)}
    for k in ks:
        metrics[f"{prefix}/pass@{k}"] = sum(pass_at_k(n, c, k) for c in counts) / len(counts)
    metrics[f"{prefix}/maj@{n}"] = sum(
        bool(row[vote]) if vote is not None else False for row, vote in zip(correct, votes, strict=True)
    ) / len(correct)
    return metrics
