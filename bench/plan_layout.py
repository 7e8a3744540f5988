"""Cold start of `hpcrl plan` with auto layout and of a 1,152-node GB200 plan/render (issue 21 items 3
and 5), against the default `hpcrl plan` measured in the same run; then the in-process search time of
every catalog model on every catalog cluster (both trainer backends).

    .venv/bin/python bench/plan_layout.py [--runs 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HPCRL = str(Path(sys.executable).with_name("hpcrl"))
SITE = ["cluster.slurm.account=a", "cluster.container.image=i", "model.fetch=job"]
"""Site keys; and the job downloads the model (this machine's cache has none: plan refuses that, as
submit does)."""
BIG = [
    "+experiment=dapo-nemotron-super-5n4g-megatron",
    *SITE,
    "layout.train_nodes=1008",
    "layout.rollout_nodes=144",
    "trainer.tp=4",
    "trainer.ep=64",
]


def timed(cmd: list[str], runs: int) -> float:
    """Median wall time of a cold ``cmd`` (composition cache off), whatever its exit status."""
    env = {**os.environ, "HPCRL_COMPOSE_CACHE": "0"}
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, capture_output=True, env=env)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def matrix() -> list[tuple[str, float]]:
    from hpcrl.errors import HpcrlError
    from hpcrl.plan.planner import plan_from_overrides

    conf = ROOT / "conf"
    seconds = []
    for trainer in ("fsdp", "megatron"):
        for cluster in sorted(p.stem for p in (conf / "cluster").glob("*.yaml")):
            for model in sorted(p.stem for p in (conf / "model").glob("*.yaml")):
                overrides = [f"+cluster={cluster}", f"+model={model}", f"trainer={trainer}", *SITE]
                start = time.perf_counter()
                with contextlib.suppress(HpcrlError):  # fits nowhere: the one line is the result
                    plan_from_overrides(overrides)
                seconds.append((f"{trainer} {cluster} {model}", time.perf_counter() - start))
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="hpcrl-bench-")
    hf = f"+cluster.env.HF_HOME={tempfile.mkdtemp(prefix='hpcrl-bench-hf-')}"  # mounted: it must exist
    cases = {
        "plan (default, baseline)": [HPCRL, "plan"],
        "plan gb200 nemotron_super (auto)": [HPCRL, "plan", "+cluster=gb200", "+model=nemotron_super", *SITE],
        "plan 1152-node gb200, segment 16": [HPCRL, "plan", *BIG, "cluster.slurm.segment=16"],
        "plan 1152-node gb200, segment 18 (refused)": [
            HPCRL,
            "plan",
            *BIG,
            "cluster.slurm.segment=18",
            "layout.auto=false",
        ],
        "render 1152-node gb200, segment 16": [
            HPCRL,
            "render",
            *BIG,
            "cluster.slurm.segment=16",
            hf,
            "--out",
            out,
        ],
    }
    results = {name: timed(cmd, args.runs) for name, cmd in cases.items()}
    base = results["plan (default, baseline)"]
    print(f"{'command (cold, cache off)':46s} {'median s':>9s} {'x baseline':>11s}")
    for name, seconds in results.items():
        print(f"{name:46s} {seconds:9.3f} {seconds / base:11.2f}")
    times = matrix()
    values = [s for _, s in times]
    worst = max(times, key=lambda t: t[1])
    print(
        f"in-process plan + auto layout over {len(times)} (trainer, cluster, model) cases: "
        f"median {statistics.median(values) * 1000:.0f} ms, max {worst[1] * 1000:.0f} ms ({worst[0]}), "
        f"total {sum(values):.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
