"""Per-phase step times of a run's metrics.jsonl (medians over steps 2.., validation steps apart),
validation accuracy by step, sampled training accuracy: the table bench/results/README.md records.

    python bench/phase_table.py RUN_DIR/metrics.jsonl [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

KEYS = ["time/step", "time/rollout", "time/train", "time/weight_sync", "time/validation", "refit/total_s",
        "refit/wake_s", "time/checkpoint_blocked", "perf/gen_tokens_per_s", "train/mean_gen_tokens"]  # fmt: skip


def table(rows: list[dict]) -> dict[str, dict[str, float]]:
    steps = [r for r in rows if r.get("step", 0) > 0 and "time/step" in r]
    plain = [r for r in steps[1:] if "val/accuracy" not in r] or steps[1:] or steps
    out = {}
    for k in KEYS:
        vals = [r[k] for r in plain if k in r]
        if k == "time/validation":
            vals = [r[k] for r in steps if k in r]
        if vals:
            out[k] = {
                "median": statistics.median(vals),
                "step1": steps[0].get(k, float("nan")),
                "n": len(vals),
            }
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("metrics", type=Path)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    rows = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]
    t = table(rows)
    print("| metric | median over steps 2.. | step 1 | steps |")
    print("|---|---|---|---|")
    for k, v in t.items():
        print(f"| {k} | {v['median']:.3f} | {v['step1']:.3f} | {v['n']} |")
    print("val:", [(r["step"], round(r["val/accuracy"], 3)) for r in rows if "val/accuracy" in r])
    print("train acc:", [round(r["train/accuracy"], 2) for r in rows if "train/accuracy" in r])
    if args.json:
        args.json.write_text(json.dumps(t, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
