"""Cold-start time of `hpcrl plan` and `hpcrl render`, against a bare interpreter start measured
in the same run (and `import torch`, the cost the CLI avoids). Prints a table of medians and ratios:
each hpcrl command composing with Hydra (first use of an override set, or after an edit of conf/ or
hpcrl/) and with its composition cached (every later use).

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


def timed(cmd: list[str], runs: int, cache: bool) -> float:
    """Median wall time; ``cache`` False composes with Hydra every time (HPCRL_COMPOSE_CACHE=0)."""
    env = {**os.environ, "HPCRL_COMPOSE_CACHE": "1" if cache else "0"}
    if cache:
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=env)  # fill the cache once
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=env)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="hpcrl-bench-")
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
        ],
        "hpcrl render nemotron gb200 split": [
            HPCRL,
            "render",
            "+experiment=dapo-nemotron-super-5n4g-megatron",
            "cluster.slurm.account=a",
            "cluster.container.image=i",
            "--out",
            out,
        ],
    }
    results = {name: timed(cmd, args.runs, cache=False) for name, cmd in cases.items()}
    for name, cmd in cases.items():
        if name.startswith("hpcrl"):
            results[name + ", composition cached"] = timed(cmd, args.runs, cache=True)
    base = results["python -c pass (baseline)"]
    print(f"{'command':40s} {'median s':>9s} {'x baseline':>11s}")
    for name, seconds in results.items():
        print(f"{name:40s} {seconds:9.3f} {seconds / base:11.1f}")
    cold = max(v for k, v in results.items() if k.startswith("hpcrl") and "cached" not in k)
    warm = max(v for k, v in results.items() if "cached" in k)
    print(
        f"slowest hpcrl command: {cold:.3f} s composing with Hydra, {warm:.3f} s with the composition cached"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
