"""Evaluation statistics: pass@k, maj@k and a paired bootstrap for before/after differences.

Pure functions over per-problem verdicts (no torch, no engines), used by ``hpcrl eval``
(``hpcrl/tools/evaluate.py``).

- pass@k: the unbiased estimator of Chen et al. (2021, the Codex paper) from ``n`` samples of which
  ``c`` are correct: ``1 - C(n-c, k) / C(n, k)``, the chance that k samples drawn without replacement
  from the n hold at least one correct one. Computed as a product (``1 - prod(1 - k/i)`` over
  ``i = n-c+1 .. n``) so that n in the hundreds neither overflows nor loses precision.
- maj@k: majority vote over the parsed answers of k samples. Ties split the credit: with t answers
  tied for the most votes, the problem scores (correct answers among them) / t, the expected score of
  breaking the tie uniformly at random (so the score does not depend on sample order). Samples
  without a parsed answer do not vote; a block with no votes scores 0. With n samples, maj@k is the
  mean over the n // k disjoint blocks of k consecutive samples (k = n: one vote over all of them).
- The before/after difference of a metric: a paired bootstrap over problems (both models answered the
  same problems, so problems are resampled together), percentile interval.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct (``1 <= k <= n``, ``0 <= c <= n``)."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n (got n={n}, c={c}, k={k})")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    miss = 1.0  # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i)
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def majority_score(answers: Sequence[str | None], correct: Sequence[bool]) -> float:
    """One vote: the score of the most frequent parsed answer (``None``: no answer, no vote).

    An answer counts as correct when any of its samples was verified correct (its samples carry the
    same answer; one may have timed out in the verifier). Ties split the credit (module docstring)."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    tied = [a for a, count in votes.items() if count == top]
    right = {a for a, ok in zip(answers, correct, strict=True) if ok and a is not None}
    return sum(a in right for a in tied) / len(tied)


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """Mean majority-vote score over the ``len(answers) // k`` disjoint blocks of k samples."""
    n = len(answers)
    if not 1 <= k <= n:
        raise ValueError(f"maj@k needs 1 <= k <= n (got n={n}, k={k})")
    blocks = n // k
    return (
        sum(majority_score(answers[b * k : (b + 1) * k], correct[b * k : (b + 1) * k]) for b in range(blocks))
        / blocks
    )


@dataclass(frozen=True)
class Difference:
    """``after - before`` of a per-problem metric's mean, with a percentile bootstrap interval."""

    before: float
    after: float
    delta: float
    low: float
    high: float
    level: float
    resamples: int
    improved: int
    """Problems whose score rose (for 0/1 metrics: fixed by training)."""
    worsened: int
    """Problems whose score fell (for 0/1 metrics: broken by training)."""


def paired_bootstrap(
    before: Sequence[float],
    after: Sequence[float],
    *,
    resamples: int = 10_000,
    level: float = 0.95,
    seed: int = 0,
) -> Difference:
    """Paired bootstrap of ``mean(after) - mean(before)``: resample problems with replacement (the same
    problems for both), take the difference of means each time, report the central ``level`` interval.

    Paired rather than two independent samples: both models answered the same problems, and most of
    a score's variance is which problems are easy; pairing removes it from the interval."""
    if len(before) != len(after) or not before:
        raise ValueError(f"paired scores need equal, non-zero lengths (got {len(before)} and {len(after)})")
    import numpy as np

    n = len(before)
    diffs = np.asarray(after, dtype=np.float64) - np.asarray(before, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = np.concatenate(
        [  # in chunks: resamples x n indices at once would be 40 MB for MATH-500
            diffs[rng.integers(0, n, size=(min(1000, resamples - done), n))].mean(axis=1)
            for done in range(0, resamples, 1000)
        ]
    )
    tail = (1.0 - level) / 2
    low, high = (float(q) for q in np.quantile(means, [tail, 1.0 - tail]))
    mean_b, mean_a = sum(before) / n, sum(after) / n
    return Difference(
        before=mean_b,
        after=mean_a,
        delta=mean_a - mean_b,
        low=low,
        high=high,
        level=level,
        resamples=resamples,
        improved=int((diffs > 0).sum()),
        worsened=int((diffs < 0).sum()),
    )


_BOXED = "\\boxed{"
_ANSWER_LINE = re.compile(r"Answer:\s*(.+?)\s*$", re.MULTILINE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def vote_key(completion: str) -> str | None:
    """The answer a completion votes for in maj@k: the last ``\\boxed{...}`` (braces balanced), else
    the last ``Answer: ...`` line (the dapo template), else the last number; None when there is none.
    Whitespace is dropped and a trailing period too, so ``\\boxed{ 1/2 }`` and ``\\boxed{1/2}.`` agree."""
    start = completion.rfind(_BOXED)
    if start >= 0:
        inner = _balanced(completion, start + len(_BOXED))
        if inner is not None:
            return _normalize(inner)
    lines = _ANSWER_LINE.findall(completion)
    if lines:
        return _normalize(lines[-1])
    numbers = _NUMBER.findall(completion)
    return _normalize(numbers[-1]) if numbers else None


def _balanced(text: str, start: int) -> str | None:
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None  # cut off before the box closed


def _normalize(answer: str) -> str | None:
    key = "".join(answer.split()).rstrip(".").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return key or None
