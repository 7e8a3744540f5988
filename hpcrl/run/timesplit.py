"""The step's time split (``time/generate``, ``time/environment``, ``time/judge``, ``time/train``):
generation's share is what is left of making the batch once the environments' steps and the judges
are taken out, so the parts add up to the batch's time (``hpcrl plot`` stacks them)."""

from __future__ import annotations

PARTS_OF_THE_BATCH = ("time/environment", "time/judge")
"""Phases inside the making of a batch, logged by their owners (envs, rewards/judge.py)."""


def scorer_stats(scorer: object) -> dict[str, float]:
    """A scorer's own figures since it was last asked (the judge's, ``JudgedScorer.stats``); none
    for the verifiers' pool alone."""
    stats = getattr(scorer, "stats", None)
    return dict(stats()) if callable(stats) else {}


def generate_seconds(batch_seconds: float, metrics: dict[str, float]) -> float:
    """Generation's part of the ``batch_seconds`` it took to make the step's batch."""
    return max(0.0, batch_seconds - sum(metrics.get(k, 0.0) for k in PARTS_OF_THE_BATCH))


def own_stats(run: object) -> dict[str, float]:
    """The figures the scorer (``scorer_stats``) and the actors (multi-turn episodes' prefix-cache hit
    rate, ``Episodes.stats``) keep since they were last asked."""
    return scorer_stats(getattr(run, "pool", None)) | scorer_stats(getattr(run, "actors", None))
