"""``hpcrl plot``: curves.png and a self-contained curves.html from runs' metrics.jsonl files."""

from __future__ import annotations

import json
import math
import re

import pytest

from hpcrl.cli import main
from hpcrl.tools.plot import COLUMNS, DPI, PANEL_PX, PANELS

KEYS = [p.key for p in PANELS] + ["time/rollout", "time/train", "time/weight_sync", "async/staleness"]


def write_run(path, shift: float, steps: int = 12, keys=KEYS):
    """A metrics.jsonl as the loop writes it: one row a step, validation every 4 steps."""
    path.mkdir(parents=True)
    rows = []
    for step in range(steps + 1):
        row = {"step": step, "time": 1.8e9 + step}
        for i, key in enumerate(keys):
            if (key == "val/accuracy" and step % 4) or (key != "val/accuracy" and step == 0):
                continue  # validation every 4 steps (and before training); the rest from step 1
            row[key] = (0.1 + shift) * (i + 1) + 0.01 * step + (1e-4 if key == "train/gen_kl_error" else 0)
        rows.append(json.dumps(row))
    (path / "metrics.jsonl").write_text("\n".join(rows) + "\n")


def test_plot_writes_a_png_and_an_html_with_every_series(tmp_path, capsys):
    from PIL import Image

    write_run(tmp_path / "run-a", 0.0)
    write_run(tmp_path / "run-b", 0.2, steps=8, keys=KEYS[:-1])  # no async/* in this one
    out = tmp_path / "out"
    assert main(["plot", str(tmp_path / "run-a"), str(tmp_path / "run-b"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.split() == [str(out / "curves.png"), str(out / "curves.html")]

    image = Image.open(out / "curves.png").convert("RGB")
    rows = math.ceil((len(KEYS) + 2) / COLUMNS)  # and each run's time split
    assert image.size == (COLUMNS * PANEL_PX[0] * 100 // DPI, rows * PANEL_PX[1] * 100 // DPI)
    colors = image.getcolors(maxcolors=1 << 20)
    white = dict((c, n) for n, c in colors).get((255, 255, 255), 0)
    assert white < 0.9 * image.size[0] * image.size[1]  # not blank
    counts = {c: n for n, c in colors}
    assert counts.get((31, 119, 180), 0) > 500 and counts.get((214, 39, 40), 0) > 500  # both runs' lines

    page = (out / "curves.html").read_text()
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in page
    blob = re.search(r'<script type="application/json" id="hpcrl-series">(.*?)</script>', page).group(1)
    data = json.loads(blob)
    for label, path in (("run-a", tmp_path / "run-a"), ("run-b", tmp_path / "run-b")):
        rows_ = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
        for key in KEYS:
            want = [[r["step"], pytest.approx(r[key])] for r in rows_ if key in r]
            assert data[label][key] == want, (label, key)
    # the summary table: run-a validates at steps 0, 4, 8, 12 with values 0.02 + 0.01 * step
    row = re.search(r"<tr><td[^>]*>run-a</td>(.*?)</tr>", page).group(1)
    assert re.findall(r"<td>(.*?)</td>", row) == [
        "12",
        "0.320 (step 12)",
        "0.320 (step 12)",
        "0.220 (step 12)",
    ]
    panels = re.findall(r'<svg [^>]*data-key="([^"]+)"', page)
    split = ["time split: run-a", "time split: run-b"]  # train and weight_sync stacked, each run's
    assert panels == [p.key for p in PANELS] + split + KEYS[len(PANELS) :]  # then time/* and async/*
    staleness = re.search(r'data-key="async/staleness".*?</svg>', page).group(0)
    assert staleness.count("<polyline") == 1  # only run-a logged it
    assert re.search(r'data-key="train/reward".*?</svg>', page).group(0).count("<polyline") == 2


def test_a_sweep_directory_plots_all_its_points(tmp_path):
    points = []
    for i, lr in enumerate(["1e-6", "3e-6"]):
        write_run(tmp_path / f"p{i}", 0.1 * i, keys=["train/reward", "val/accuracy"])
        points.append(
            {"point": i, "overrides": [f"algo.lr={lr}"], "job_id": str(i), "run_dir": str(tmp_path / f"p{i}")}
        )
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text(json.dumps({"points": points}))
    assert main(["plot", str(sweep)]) == 0  # written into the sweep directory
    page = (sweep / "curves.html").read_text()
    assert "p0 algo.lr=1e-6" in page and "p1 algo.lr=3e-6" in page
    assert (sweep / "curves.png").stat().st_size > 10_000


def test_plot_refuses_a_directory_without_metrics(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics.jsonl there" in capsys.readouterr().err


def test_panels_that_tell_nothing_are_left_out_and_a_run_is_titled_by_its_settings(tmp_path):
    from hpcrl.tools.plot import find_runs, panels_for, read_run, smoothed, title_of

    run = tmp_path / "grpo-x"
    run.mkdir()
    rows = [
        {
            "step": s,
            "train/reward": 0.1 * s,
            "train/clip_fraction": 0.0,
            "train/lr": 1e-6,
            "time/train": 1.5,
            "time/checkpoint_blocked": 0.001,
            "val/mean_gen_tokens": 40 + s,
        }
        for s in range(1, 25)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.yaml").write_text("model:\n  name: smollm2_135m\nalgo:\n  name: grpo\n  lr: 1.0e-05\n")
    runs = [read_run(label, path) for label, path in find_runs([run])]
    assert [p.key for p in panels_for(runs)] == ["train/reward", "val/mean_gen_tokens", "time/train"]
    assert title_of(runs) == "grpo-x: model=smollm2_135m, algo=grpo, lr=1e-05"
    # the running average: debiased (starts at the first value), lags a ramp, flat on a flat series
    assert smoothed([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
    ramp = smoothed([float(i) for i in range(10)])
    assert ramp[0] == 0.0 and all(r < i for i, r in enumerate(ramp) if i) and ramp == sorted(ramp)


def test_the_time_split_stacks_the_phases_that_hold_no_others(tmp_path):
    """generate, environment, judge and train bottom up, then the rest; time/step, time/rollout (the
    batch: generate + environment + judge) and time/ref_logprobs (inside train) are not stacked."""
    phases = {
        "time/train": 2.0,
        "time/judge": 0.5,
        "time/generate": 1.0,
        "time/environment": 0.25,
        "time/weight_sync": 0.125,
        "time/rollout": 1.75,
        "time/step": 3.875,
        "time/ref_logprobs": 0.3,
    }
    write_run(tmp_path / "run", 0.0, steps=3, keys=[])
    rows = [{"step": s, **{k: v * s for k, v in phases.items()}} for s in (1, 2, 3)]
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["plot", str(tmp_path / "run")]) == 0
    page = (tmp_path / "run" / "curves.html").read_text()
    split = re.search(r'data-key="time split: run".*?</svg>', page).group(0)
    stacked = ["time/generate", "time/environment", "time/judge", "time/train", "time/weight_sync"]
    assert re.findall(r"<title>(time/[a-z_]+)</title>", split) == stacked
    # the stack's top at the last step is the step (the parts add up), the axis says so
    assert f"{3 * 3.875:.4g} s" in split
