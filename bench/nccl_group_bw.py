"""Bandwidth of one broadcast over hpcrl.sync.broadcast's directly-built process group, between two
processes on two GPUs (or gloo on CPU): the transport a refit runs on, without any model code.

    python bench/nccl_group_bw.py [--gb 1] [--device cuda]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def worker(rank: int, port: int, gb: float, device: str) -> None:
    import torch

    from hpcrl.sync.broadcast import new_group

    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    group = new_group(
        "nccl" if device == "cuda" else "gloo", f"127.0.0.1:{port}", rank, 2, local_ip="127.0.0.1"
    )
    buf = torch.ones(int(gb * 1e9 / 2), dtype=torch.bfloat16, device=dev)
    for i in range(6):
        group.barrier(buf.device)
        start = time.perf_counter()
        group.broadcast(buf)
        group.barrier(buf.device)  # the receiver has the data (a broadcast alone does not hold the root)
        took = time.perf_counter() - start
        if rank == 1 and i:
            print(f"broadcast {gb:.1f} GB: {took * 1e3:.1f} ms = {gb / took:.1f} GB/s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--port", type=int)
    args = parser.parse_args()
    if args.rank is not None:
        worker(args.rank, args.port, args.gb, args.device)
        return 0
    from hpcrl.trainer.process_group import free_port

    port = free_port()
    argv = [sys.executable, __file__, "--gb", str(args.gb), "--device", args.device, "--port", str(port)]
    procs = [subprocess.Popen([*argv, "--rank", str(r)]) for r in range(2)]
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
