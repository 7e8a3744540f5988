"""Cold-start time of `hpcrl plan` and `hpcrl render`, against a bare interpreter start measured
in the same run (and `import torch`, the cost the CLI avoids). Prints a table of medians and ratios,
each hpcrl command in three modes: a cold start (nothing cached: the first use of an override set, or
after an edit of conf/ or hpcrl/; composed by hpcrl.config.fastcompose), the same composed by Hydra (what a
cold start cost before fastcompose, and what overrides outside its subset still cost), and with the
composition cached (every later use). The site's keys come from the command line, except in the
"keys in site.yaml" case (a site file with the README's keys); no case reads the developer's own site.

    .venv/bin/python bench/plan_speed.py [--runs 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
HPCRL = str(Path(PY).with_name("hpcrl"))


MODES = {
    "cold": {"HPCRL_COMPOSE_CACHE": "0"},
    "cold, Hydra": {"HPCRL_COMPOSE_CACHE": "0", "HPCRL_FAST_COMPOSE": "0"},
    "cached": {"HPCRL_COMPOSE_CACHE": "1"},
}


def timed(cmd: list[str], runs: int, mode: str, site: str) -> float:
    """Median wall time of ``cmd`` in one of MODES, with ``site`` as HPCRL_CONFIG_DIR."""
    env = {**os.environ, **MODES[mode], "HPCRL_CONFIG_DIR": site}
    if mode == "cached":
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=env)  # fill the cache once
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=env)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


SITE_YAML = """\
clusters:
  gb200:
    slurm: {account: a, partition: gb200nvl72, qos: normal}
    container: {image: i, mounts: ["/lustre:/lustre"]}
    env: {HF_HOME: /lustre/hf}
"""
"""The site file of the README's example (with the command line's account and image)."""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="hpcrl-bench-")
    no_site = tempfile.mkdtemp(prefix="hpcrl-bench-nosite-")  # never the developer's own site file
    site = tempfile.mkdtemp(prefix="hpcrl-bench-site-")
    hf = tempfile.mkdtemp(prefix="hpcrl-bench-hf-")
    Path(site, "site.yaml").write_text(SITE_YAML.replace("/lustre/hf", hf))
    # submit's checks, which plan and render make too: the job downloads the model (this machine has
    # none in its cache) into an HF_HOME that exists
    fetch = ["model.fetch=job", f"+cluster.env.HF_HOME={hf}"]
    cases = {
        "python -c pass (baseline)": [PY, "-c", "pass"],
        "python -c 'import torch'": [PY, "-c", "import torch"],
        "hpcrl plan (default)": [HPCRL, "plan"],
        "hpcrl plan nemotron gb200 split": [
            HPCRL,
            "plan",
            "+experiment=dapo-nemotron-super-5n4g-megatron",
            "cluster.slurm.account=a",
            "cluster.container.image=i",
            *fetch,
        ],
        "hpcrl render nemotron gb200 split": [
            HPCRL,
            "render",
            "+experiment=dapo-nemotron-super-5n4g-megatron",
            "cluster.slurm.account=a",
            "cluster.container.image=i",
            *fetch,
            "--out",
            out,
        ],
        "hpcrl plan nemotron, keys in site.yaml": [
            HPCRL,
            "plan",
            "+experiment=dapo-nemotron-super-5n4g-megatron",
            "model.fetch=job",
        ],
    }
    results = {}
    for name, cmd in cases.items():
        for mode in MODES if name.startswith("hpcrl") else ["cold"]:
            results[(name, mode)] = timed(cmd, args.runs, mode, site if "site.yaml" in name else no_site)
    base = results[("python -c pass (baseline)", "cold")]
    print(f"{'command':36s} {'mode':12s} {'median s':>9s} {'x baseline':>11s} {'x Hydra':>8s}")
    for (name, mode), seconds in results.items():
        hydra = results.get((name, "cold, Hydra"))
        vs = f"{seconds / hydra:8.2f}" if hydra else " " * 8
        print(f"{name:36s} {mode:12s} {seconds:9.3f} {seconds / base:11.1f} {vs}")
    for mode in MODES:
        worst = max(v for (k, m), v in results.items() if k.startswith("hpcrl") and m == mode)
        print(f"slowest hpcrl command, {mode}: {worst:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
