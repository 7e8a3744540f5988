"""``hpcrl plot``'s time-split panel: where each step's seconds went, one stacked area a phase
(generate, environment, judge, train, then the rest a run logged), so the parts' height is the step.
Phases that hold others (``time/step``; ``time/rollout``, which is generate + environment + judge;
``time/ref_logprobs``, inside train) are left out of the stack: they would count twice. With
``algo.max_staleness`` >= 1 the batch (generate, environment, judge) was made beside the training, so
there the stack is each phase's own seconds, more than the step's."""

from __future__ import annotations

from collections.abc import Iterable
from html import escape
from typing import Any

FIRST = ("time/generate", "time/environment", "time/judge", "time/train")
"""The split's own phases (run/timesplit.py), stacked first, bottom up."""
HOLDERS = frozenset({"time/step", "time/rollout", "time/ref_logprobs"})
"""Phases that contain others."""
KEY = "time split"
"""The panel's key (no metric has it)."""

Series = dict[str, list[tuple[int, float]]]


def phases(keys: Iterable[str]) -> tuple[str, ...]:
    """The stacked phases among ``keys``: ``FIRST`` in order, then every other ``time/*`` but the holders."""
    keys = set(keys)
    rest = sorted(k for k in keys if k.startswith("time/") and k not in HOLDERS and k not in FIRST)
    return tuple(k for k in FIRST if k in keys) + tuple(rest)


def stacked(series: Series, stack: tuple[str, ...]) -> tuple[list[int], list[list[float]]]:
    """The steps any phase was logged at, and each phase's seconds there (0 where it was not)."""
    steps = sorted({s for k in stack for s, _ in series.get(k, [])})
    rows = []
    for k in stack:
        at = dict(series.get(k, []))
        rows.append([at.get(s, 0.0) for s in steps])
    return steps, rows


def svg_panel(
    title: str, key: str, series: Series, stack: tuple[str, ...], colors: list[str], size: tuple[int, int]
) -> str:
    """The panel as an SVG of ``size``: the stack bottom up, a legend of its phases, the axis ranges."""
    w, h = size
    left, right, top, bottom = 56, 12, 24, 30
    steps, rows = stacked(series, stack)
    if not steps:
        return ""
    totals = [sum(col) for col in zip(*rows, strict=True)]
    x0, x1 = steps[0], steps[-1] if steps[-1] > steps[0] else steps[0] + 1
    y1 = max(totals) or 1.0

    def px(s: float, v: float) -> str:
        return f"{left + (s - x0) / (x1 - x0) * (w - left - right):.1f},{top + (1 - v / y1) * (h - top - bottom):.1f}"

    base, shapes = [0.0] * len(steps), []
    for k, row, color in zip(stack, rows, colors, strict=False):
        upper = [b + v for b, v in zip(base, row, strict=True)]
        ring = [px(s, t) for s, t in zip(steps, upper, strict=True)]
        ring += [px(s, b) for s, b in reversed(list(zip(steps, base, strict=True)))]
        shapes.append(
            f'<polygon fill="{color}" fill-opacity="0.7" points="{" ".join(ring)}"><title>{k}</title></polygon>'
        )
        base = upper
    legend = "".join(
        f'<text x="{w - right - 4}" y="{top + 10 + 10 * i}" text-anchor="end" font-size="9" fill="{c}">'
        f"{k.removeprefix('time/')}</text>"
        for i, (k, c) in enumerate(zip(stack, colors, strict=False))
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" data-key="{escape(key)}">'
        f'<text x="{w / 2}" y="15" text-anchor="middle" font-size="12">{escape(title)}</text>'
        f'<rect x="{left}" y="{top}" width="{w - left - right}" height="{h - top - bottom}" fill="none" stroke="#ccc"/>'
        f'<text x="{left - 4}" y="{top + 8}" text-anchor="end" font-size="9">{y1:.4g} s</text>'
        f'<text x="{left - 4}" y="{h - bottom}" text-anchor="end" font-size="9">0</text>'
        f'<text x="{left}" y="{h - 12}" font-size="9">{x0:g}</text>'
        f'<text x="{w - right}" y="{h - 12}" text-anchor="end" font-size="9">step {x1:g}</text>'
        f"{''.join(shapes)}{legend}</svg>"
    )


def draw(ax: Any, series: Series, stack: tuple[str, ...], colors: list[str]) -> None:
    """The panel on a matplotlib axis: stacked areas, their legend inside."""
    steps, rows = stacked(series, stack)
    labels = [k.removeprefix("time/") for k in stack]
    ax.stackplot(steps, *rows, labels=labels, colors=colors[: len(stack)], alpha=0.8)
    ax.legend(fontsize=6, loc="upper left", frameon=False)
    ax.set_ylabel("s", fontsize=8)
