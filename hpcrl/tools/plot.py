"""``hpcrl plot RUN_DIR [RUN_DIR ...] [--out DIR]``: the curves a person looks at, one line per run.

Reads each run's ``metrics.jsonl`` (``run/metrics.py``) and writes ``curves.png`` (matplotlib, Agg)
and ``curves.html``: the same panels as inline SVG with the data inlined as JSON, so the page opens
anywhere without a network. A sweep directory (``sweep.json``, from ``hpcrl submit -m``) stands for
all its points, labelled by their overrides; any other directory without ``metrics.jsonl`` stands for
the runs directly under it.

Panels: reward, validation accuracy and length, loss, KL to the reference, the generator/trainer KL
error (log scale), entropy, generated lengths, clip fraction, learning rate, then every ``time/*``
phase and ``async/*`` staleness figure that a run logged, and each run's time split stacked in one panel
(``tools/timesplit.py``). A panel that tells nothing is left out: no
run has a value for it, every value of every run is the same (a clip fraction of 0 with one
minibatch, a constant learning rate), or a phase never took ``MIN_PHASE_S``. Noisy training curves
(``SMOOTHED`` keys, at least ``SMOOTH_FROM`` points) are drawn faint under their running average. The
figure is titled with the run's name and key settings (its ``config.yaml``).
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path

from hpcrl.errors import HpcrlError
from hpcrl.run.metrics import read_metrics
from hpcrl.tools import timesplit


@dataclass(frozen=True)
class Panel:
    key: str
    title: str
    log: bool = False
    stack: tuple[str, ...] = ()
    """A time-split panel's phases (tools/timesplit.py), of run ``run``; empty: one curve a run."""
    run: str = ""


PANELS = (
    Panel("train/reward", "reward (train)"),
    Panel("val/accuracy", "accuracy (validation, greedy)"),
    Panel("val/mean_gen_tokens", "generated tokens (validation, mean)"),
    Panel("train/loss", "loss"),
    Panel("train/kl", "KL to the reference"),
    Panel("train/gen_kl_error", "gen_kl_error (engine vs trainer)", log=True),
    Panel("train/entropy", "entropy"),
    Panel("train/mean_gen_tokens", "generated tokens (mean)"),
    Panel("train/clip_fraction", "clip fraction"),
    Panel("train/lr", "learning rate"),
)
SMOOTHED = frozenset({"train/reward", "train/loss", "train/kl", "train/entropy", "train/mean_gen_tokens"})
SMOOTH_FROM = 20
"""Points from which a ``SMOOTHED`` curve gets its running average (fewer: drawn as they are)."""
SMOOTHING = 0.8
"""Weight of the past in that average (an exponential moving average, debiased at the start)."""
MIN_PHASE_S = 0.01
"""A ``time/*`` phase whose every value is below this is left out."""
TITLE_KEYS = ("model.name", "algo.name", "algo.lr", "algo.num_prompts_per_step", "algo.num_generations")
"""The settings in a single run's title."""
EXTRA_PREFIXES = ("time/", "async/")
"""Every key under these gets a panel of its own (seconds per phase; staleness in steps)."""

COLUMNS = 3
PANEL_PX = (420, 280)
"""One panel's size in the PNG (at DPI) and the HTML."""
DPI = 100


@dataclass
class Run:
    label: str
    path: Path
    series: dict[str, list[tuple[int, float]]]
    """metric -> (step, value) in step order."""


def find_runs(paths: list[Path]) -> list[tuple[str, Path]]:
    """(label, run directory) for each path: a run, a sweep's points or the runs in a directory."""
    found: list[tuple[str, Path]] = []
    for path in paths:
        if (path / "metrics.jsonl").exists():
            found.append((path.name, path))
        elif (path / "sweep.json").exists():
            for point in json.loads((path / "sweep.json").read_text())["points"]:
                label = f"p{point['point']} {' '.join(point['overrides'])}".strip()
                found.append((label, Path(point["run_dir"])))
        elif path.is_dir() and (runs := sorted(p for p in path.iterdir() if (p / "metrics.jsonl").exists())):
            found += [(p.name, p) for p in runs]
        else:
            raise HpcrlError(f"{path}: no metrics.jsonl there (nor a sweep.json, nor runs under it)")
    return found


def read_run(label: str, path: Path) -> Run:
    """A run's numeric series from metrics.jsonl; a missing file (a sweep point not started) is empty."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in read_metrics(path):
        for key, value in row.items():
            if key not in ("step", "time") and isinstance(value, int | float):
                series.setdefault(key, []).append((int(row["step"]), float(value)))
    for points in series.values():
        points.sort()
    return Run(label, path, series)


def panels_for(runs: list[Run]) -> list[Panel]:
    every = {k for r in runs for k in r.series}
    keys = {k for k in every if informative(k, [v for r in runs for _, v in r.series.get(k, [])])}
    chosen = [p for p in PANELS if p.key in keys]
    extra = [k for prefix in EXTRA_PREFIXES for k in sorted(keys) if k.startswith(prefix)]
    split = [
        Panel(
            f"{timesplit.KEY}: {r.label}",
            f"time split (s): {r.label}" if len(runs) > 1 else "time split (s)",
            stack=stack,
            run=r.label,
        )
        for r in runs
        if len(stack := timesplit.phases(k for k in r.series if k in keys)) > 1
    ]
    return chosen + split + [Panel(k, f"{k} (s)" if k.startswith("time/") else k) for k in extra]


def informative(key: str, values: list[float]) -> bool:
    """Whether a panel of these values (every run's) shows anything. A phase: if it took ``MIN_PHASE_S``
    at least once (its steady seconds are the news); any other metric: if it is not one flat value."""
    if not values:
        return False
    if key.startswith("time/"):
        return max(values) >= MIN_PHASE_S
    return len(values) == 1 or max(values) != min(values)


def smoothed(values: list[float]) -> list[float]:
    """The debiased exponential moving average of ``values`` (``SMOOTHING``)."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = SMOOTHING * avg + (1 - SMOOTHING) * v
        out.append(avg / (1 - SMOOTHING**i))
    return out


def title_of(runs: list[Run]) -> str:
    """One run: its name and key settings (``TITLE_KEYS``, from its ``config.yaml``); several: how many."""
    if len(runs) != 1:
        return f"hpcrl curves: {len(runs)} runs"
    import yaml

    run = runs[0]
    try:
        cfg = yaml.safe_load((run.path / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return run.label
    parts = []
    for key in TITLE_KEYS:
        node = cfg
        for name in key.split("."):
            node = node.get(name) if isinstance(node, dict) else None
        if node is not None:
            group, name = key.split(".")
            parts.append(f"{group if name == 'name' else name}={node}")
    return f"{run.label}: " + ", ".join(parts)


def plot_runs(paths: list[Path], out: Path | None = None) -> list[Path]:
    """Write curves.png and curves.html into ``out`` (default: the sweep or the first run directory)."""
    runs = [read_run(label, path) for label, path in find_runs(paths)]
    panels = panels_for(runs)
    if not panels:
        raise HpcrlError(
            f"no metric to plot in {', '.join(str(r.path) for r in runs)} (metrics.jsonl is empty)"
        )
    out = out or paths[0]
    out.mkdir(parents=True, exist_ok=True)
    png, page = out / "curves.png", out / "curves.html"
    write_png(runs, panels, png)
    page.write_text(render_html(runs, panels))
    return [png, page]


# -- PNG -----------------------------------------------------------------------------------------------
def write_png(runs: list[Run], panels: list[Panel], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on a login node
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = -(-len(panels) // COLUMNS)
    w, h = PANEL_PX
    fig, axes = plt.subplots(
        rows, COLUMNS, figsize=(COLUMNS * w / DPI, rows * h / DPI), dpi=DPI, squeeze=False
    )
    for ax, panel in zip(axes.flat, panels, strict=False):
        if panel.stack:
            timesplit.draw(ax, _run(runs, panel).series, panel.stack, list(PALETTE))
        for i, run in enumerate(runs):
            points = run.series.get(panel.key, [])
            if points:
                steps, values = zip(*points, strict=True)
                smooth = panel.key in SMOOTHED and len(points) >= SMOOTH_FROM
                marker = "." if len(points) < 30 else None
                raw = {"alpha": 0.3, "label": None} if smooth else {"label": run.label}
                ax.plot(steps, values, marker=marker, color=_color(i), **raw)
                if smooth:
                    ax.plot(steps, smoothed(list(values)), label=run.label, color=_color(i))
        if panel.log and all(v > 0 for r in runs for _, v in r.series.get(panel.key, [])):
            ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.set_title(panel.title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title_of(runs), fontsize=10)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(runs)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05 if rows > 1 else 0.1, 1, 0.96))
    fig.savefig(path, dpi=DPI)  # the figure's size: no bbox_inches="tight", which would change it
    plt.close(fig)


PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def _color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def _run(runs: list[Run], panel: Panel) -> Run:
    return next(r for r in runs if r.label == panel.run)


# -- HTML: inline SVG, no scripts from anywhere -----------------------------------------------------------
def render_html(runs: list[Run], panels: list[Panel]) -> str:
    legend = "".join(
        f'<span style="color:{_color(i)}">&#9632; {html.escape(r.label)}</span> ' for i, r in enumerate(runs)
    )
    svgs = "".join(svg_panel(runs, p) for p in panels)
    data = {r.label: {p.key: r.series.get(p.key, []) for p in panels} for r in runs}
    blob = json.dumps(data).replace("</", "<\\/")  # no "</script>" inside the data
    sources = "".join(f"<li>{html.escape(r.label)}: {html.escape(str(r.path))}</li>" for r in runs)
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>hpcrl curves</title>"
        "<style>body{font-family:sans-serif;margin:16px}svg{margin:4px;background:#fff}"
        ".legend span{margin-right:14px}td,th{padding:2px 10px;text-align:right}</style></head><body>"
        f"<h3>{html.escape(title_of(runs))}</h3>{summary_table(runs)}<div class='legend'>{legend}</div><div>{svgs}</div>"
        f"<details><summary>runs</summary><ul>{sources}</ul></details>"
        f'<script type="application/json" id="hpcrl-series">{blob}</script>'
        "</body></html>\n"
    )


def summary_table(runs: list[Run]) -> str:
    """At a glance: each run's last step, its best and last validation accuracy, its last reward."""

    def fmt(points: list[tuple[int, float]], best: bool = False) -> str:
        if not points:
            return "-"
        step, value = max(points, key=lambda p: (p[1], -p[0])) if best else points[-1]
        return f"{value:.3f} (step {step})"

    head = "<tr><th>run</th><th>steps</th><th>best val/accuracy</th><th>last val/accuracy</th><th>last reward</th></tr>"
    rows = "".join(
        f"<tr><td style='text-align:left'>{html.escape(r.label)}</td>"
        f"<td>{max((s for pts in r.series.values() for s, _ in pts), default=0)}</td>"
        f"<td>{fmt(r.series.get('val/accuracy', []), best=True)}</td>"
        f"<td>{fmt(r.series.get('val/accuracy', []))}</td><td>{fmt(r.series.get('train/reward', []))}</td></tr>"
        for r in runs
    )
    return f"<table class='summary'>{head}{rows}</table>"


def svg_panel(runs: list[Run], panel: Panel) -> str:
    """One panel as an SVG: a polyline per run (hover: the run and its last value), axis ranges."""
    import math

    if panel.stack:
        return timesplit.svg_panel(
            panel.title, panel.key, _run(runs, panel).series, panel.stack, list(PALETTE), PANEL_PX
        )
    w, h = PANEL_PX
    left, right, top, bottom = 56, 12, 24, 30
    every = [(s, v) for r in runs for s, v in r.series.get(panel.key, [])]
    log = panel.log and all(v > 0 for _, v in every)

    def y_of(v: float) -> float:
        return math.log10(v) if log else v

    xs, ys = [s for s, _ in every], [y_of(v) for _, v in every]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1

    def px(s: float, v: float) -> str:
        x = left + (s - x0) / (x1 - x0) * (w - left - right)
        y = top + (1 - (y_of(v) - y0) / (y1 - y0)) * (h - top - bottom)
        return f"{x:.1f},{y:.1f}"

    lines = []
    for i, r in enumerate(runs):
        points = r.series.get(panel.key, [])
        if points:
            tip = f"{r.label}: {points[-1][1]:.4g} at step {points[-1][0]}"
            lines.append(
                f'<polyline fill="none" stroke="{_color(i)}" stroke-width="1.5" '
                f'points="{" ".join(px(s, v) for s, v in points)}"><title>{html.escape(tip)}</title></polyline>'
            )
    label = "10^{:.2g}" if log else "{:.4g}"
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" data-key="{html.escape(panel.key)}">'
        f'<text x="{w / 2}" y="15" text-anchor="middle" font-size="12">{html.escape(panel.title)}</text>'
        f'<rect x="{left}" y="{top}" width="{w - left - right}" height="{h - top - bottom}" fill="none" stroke="#ccc"/>'
        f'<text x="{left - 4}" y="{top + 8}" text-anchor="end" font-size="9">{label.format(y1)}</text>'
        f'<text x="{left - 4}" y="{h - bottom}" text-anchor="end" font-size="9">{label.format(y0)}</text>'
        f'<text x="{left}" y="{h - 12}" font-size="9">{x0:g}</text>'
        f'<text x="{w - right}" y="{h - 12}" text-anchor="end" font-size="9">step {x1:g}</text>'
        f"{''.join(lines)}</svg>"
    )
