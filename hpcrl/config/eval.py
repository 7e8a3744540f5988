"""``eval.*``: what ``hpcrl eval`` (``hpcrl/tools/evaluate.py``) generates and reports.

Every problem is answered once greedily (pass@1) and ``n`` times by sampling (pass@k and maj@k for
each of ``k``). Generation length, the engine and the verifier are the run's own: ``rollout.*``,
``data.verifier`` and ``rewards.*``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hpcrl.core.checks import in_range, non_negative, positive
from hpcrl.errors import ConfigError


@dataclass
class EvalConfig:
    n: int = 8
    """Sampled completions per problem for pass@k / maj@k; 0 answers greedily only."""
    k: list[int] = field(default_factory=lambda: [1, 4, 8])
    """The k of pass@k and maj@k, each at most ``n`` (empty with ``n: 0``)."""
    temperature: float = 1.0
    """Sampling temperature of the ``n`` samples (the greedy answer is always at 0)."""
    top_p: float = 1.0
    max_problems: int = 0
    """Evaluate the first this many problems only (0: all of them)."""
    bootstrap_resamples: int = 10_000
    """Resamples of the paired bootstrap behind ``--compare``'s confidence interval."""
    confidence: float = 0.95
    """Level of ``--compare``'s interval."""

    def check(self) -> None:
        non_negative("eval.n", self.n)
        bad = [k for k in self.k if not 1 <= k <= self.n]
        if bad:
            raise ConfigError(
                f"eval.k={self.k}: every k must be between 1 and eval.n={self.n} "
                f"(raise eval.n, or set eval.k=[{','.join(str(k) for k in self.k if 1 <= k <= self.n)}])"
            )
        non_negative("eval.temperature", self.temperature)
        in_range("eval.top_p", self.top_p, 1e-6, 1.0)
        non_negative("eval.max_problems", self.max_problems)
        positive("eval.bootstrap_resamples", self.bootstrap_resamples)
        in_range("eval.confidence", self.confidence, 0.5, 0.999)
