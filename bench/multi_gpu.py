"""Issue 7, part 1: the megatron backend with NCCL on 2 GPUs. TP=2 (sequence parallel), PP=2 and CP=2
against TP=1 on the same batch (tiny model, fp32): max differences of log-probs, loss, gradients; wall time of each run.

    python bench/multi_gpu.py [--override trainer.compile=true] [--timeout 240]   (>= 2 GPUs)

Each run has a deadline; a run that fails or passes it is recorded with the tail of its stderr (with
``HPCRL_PARITY_DUMP_S`` set a few seconds before the deadline, that tail holds every thread's stack).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpcrl.config.compose import compose_config  # noqa: E402
from hpcrl.run.tiny_model import ensure_tiny_model  # noqa: E402
from tests.harness.megatron_parity import parity_batch  # noqa: E402


class Failed(RuntimeError):
    pass


def run(model_dir: Path, out: Path, tp: int, pp: int, port: int, overrides: list[str],
        timeout: float, cp: int = 1) -> tuple[dict, float]:  # fmt: skip
    env = {**os.environ, "HPCRL_PARITY_DEVICE": "cuda", "HPCRL_PARITY_OVERRIDES": " ".join([f"trainer.cp={cp}", *overrides]),
           "HPCRL_PARITY_DUMP_S": str(max(timeout - 15, 5))}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={tp * pp * cp}", f"--master_port={port}",
           str(ROOT / "tests" / "harness" / "megatron_parity.py"), str(model_dir), str(out), str(tp), str(pp)]  # fmt: skip
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise Failed(f"timed out after {timeout:.0f} s\n{err[-6000:]}") from None
    if done.returncode != 0:
        raise Failed(done.stderr[-6000:])
    return torch.load(out), time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--override", action="append", default=[], help="config override for every run")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--layouts", default="2,1,1 1,2,1 1,1,2", help="space-separated TP,PP,CP triples")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    cfg = compose_config(["model=tiny"])
    model_dir = ensure_tiny_model(cfg.model, tmp / "cache", sft_steps=0, seed=0, log=lambda _: None)
    mask = parity_batch().loss_mask.bool()
    try:
        base, t1 = run(model_dir, tmp / "tp1.pt", 1, 1, 29701, args.override, args.timeout)
    except Failed as e:
        print("TP1 FAILED:", str(e), file=sys.stderr, flush=True)
        return 1
    rows: dict[str, dict] = {"TP1 (1 GPU)": {"wall_s": t1}}
    for n, (tp, pp, cp) in enumerate(
        tuple(int(x) for x in layout.split(",")) for layout in args.layouts.split()
    ):
        name = f"TP{tp} PP{pp} CP{cp} (2 GPUs, NCCL)"
        try:
            got, t = run(
                model_dir, tmp / f"tp{tp}pp{pp}cp{cp}.pt", tp, pp, 29711 + n, args.override, args.timeout, cp
            )
        except Failed as e:
            rows[name] = {"failed": str(e)}
            print(name, "FAILED:", str(e)[-3000:], file=sys.stderr, flush=True)
            continue
        rows[name] = {
            "wall_s": t,
            "layout": got.get("layout"),
            "max_logp_diff": float((got["logp"][mask] - base["logp"][mask]).abs().max()),
            "loss_diff": abs(got["metrics"]["loss"] - base["metrics"]["loss"]),
            "grad_norm": [got["metrics"]["grad_norm"], base["metrics"]["grad_norm"]],
            "max_grad_diff": max(float((got["grads"][n] - g).abs().max()) for n, g in base["grads"].items()),
            "max_weight_diff": max(
                float((got["weights"][n] - w).abs().max()) for n, w in base["weights"].items()
            ),
        }
    result = {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
              "torch": torch.__version__, "overrides": args.override, "base_loss": base["metrics"]["loss"], "rows": rows}  # fmt: skip
    print(json.dumps(result, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "multi_gpu.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
