"""Issue 20 item 6: the split tiny recipe (1 rollout node + 1 train node) on the namespace-node Slurm
test cluster with ``algo.max_staleness`` 0 and 1, the same steps and the same algorithm otherwise
(TIS correction in both), one job after the other: step time, its ratio, and validation before/after.

    tools/slurm-cluster up 3 && export SLURM_CONF=/tmp/hpcrl-slurm/etc/slurm.conf
    .venv/bin/python bench/async_overlap.py [--steps 30 --lags 0,1 --out bench/results/async_overlap.json]

Step time is the median of ``time/step`` over steps 2..S (step 1 fills the pipeline); the wall time of
steps 1..S comes from the job log's step lines. Both namespace nodes share this machine's cores: the
rollout node's vLLM and the train node's gloo trainer overlap only as far as the cores allow.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpcrl.launch import lifecycle  # noqa: E402

HPCRL = str(Path(sys.executable).with_name("hpcrl"))


def run_job(root: Path, steps: int, lag: int, extra: list[str]) -> dict[str, object]:
    args = [
        "+experiment=grpo-tiny-2n1g-fsdp-split",
        f"run.output_root={root}",
        f"algo.max_steps={steps}",
        f"algo.max_staleness={lag}",
        "algo.is_correction=tis",
        "checkpoint.enabled=false",
        *extra,
    ]
    out = subprocess.run([HPCRL, "submit", *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    if out.returncode:
        raise SystemExit(out.stderr)
    job = re.search(r"^job\s+(\d+)", out.stdout, re.M).group(1)  # type: ignore[union-attr]
    run_dir = lifecycle.run_dir_of(job, root)
    t0 = time.perf_counter()
    state = lifecycle.wait(job, run_dir, timeout_s=3600)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if state != "COMPLETED":
        raise SystemExit(f"job {job} (max_staleness={lag}) ended {state}")
    trained = [r for r in rows if "time/step" in r]
    vals = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    return {
        "max_staleness": lag,
        "job": job,
        "steps": len(trained),
        "step_s_median": statistics.median(r["time/step"] for r in trained[1:]),
        "steps_s_total": sum(r["time/step"] for r in trained),
        "rollout_wait_s_median": statistics.median(r["time/rollout"] for r in trained[1:]),
        "train_s_median": statistics.median(r["time/train"] for r in trained[1:]),
        "val_first": vals[0],
        "val_last": vals[-1],
        "reward_first5": statistics.mean(r["train/reward"] for r in trained[:5]),
        "reward_last10": statistics.mean(r["train/reward"] for r in trained[-10:]),
        "staleness_last": trained[-1].get("async/staleness", 0.0),
        "job_wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lags", default="0,1")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("extra", nargs="*", help="more overrides for both jobs")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hpcrl-async-bench-", dir="/tmp"))
    results = [run_job(root, a.steps, int(lag), a.extra) for lag in a.lags.split(",")]
    base = results[0]["step_s_median"]
    print(f"\nsplit tiny recipe, {a.steps} steps, 1 rollout + 1 train node (slurmtest)")
    print(
        f"{'max_staleness':>13} {'step s':>8} {'x':>6} {'total s':>8} {'wait s':>7} {'train s':>8} {'val':>13}"
    )
    for r in results:
        print(
            f"{r['max_staleness']:>13} {r['step_s_median']:>8.2f} {base / r['step_s_median']:>6.2f} "  # type: ignore[operator]
            f"{r['steps_s_total']:>8.1f} {r['rollout_wait_s_median']:>7.2f} {r['train_s_median']:>8.2f} "
            f"{r['val_first']:.3f} -> {r['val_last']:.3f}"
        )
    if a.out:
        a.out.write_text(json.dumps({"steps": a.steps, "extra": a.extra, "results": results}, indent=1))


if __name__ == "__main__":
    main()
