"""Issue 7: the megatron backend's GRPO train step on the Qwen2-1.5B shape under torchrun (NCCL),
TP/PP from the command line, beside the same shape on one GPU in the same run.

    python bench/megatron_parallel_bench.py [--batch 8 --seq 2048] [--variant trainer.compile=true]

Each layout runs with the defaults and once more per ``--variant`` (space-separated overrides).

MFU = tokens/s x (6N + 12 L h s) / (989 TFLOP/s x GPUs). Recompute off, fp32 master + bf16 autocast.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_bench import DATASHEET_TFLOPS, make_model_dir, portable, timed, train_flops_per_token
from megatron_bench import grpo_batch

from hpcrl.config.compose import compose_config


def worker(model_dir: str, tp: int, pp: int, batch: int, seq: int, extra: list[str], cp: int = 1) -> None:
    from hpcrl.trainer.megatron import MegatronTrainer

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = compose_config(["model=qwen2_1p5b", "trainer=megatron", f"trainer.tp={tp}", f"trainer.pp={pp}", f"trainer.cp={cp}",
                          f"trainer.micro_batch_size={batch // max(1, pp * 2) if pp > 1 else batch}",
                          "trainer.activation_checkpointing=false", "algo.kl_coef=0", *extra])  # fmt: skip
    master = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    trainer = MegatronTrainer(Path(model_dir), cfg, rank=rank, world=world, master=master, device="cuda")
    b = grpo_batch(batch, seq)
    torch.cuda.reset_peak_memory_stats()
    t = timed(lambda: trainer.train_step(b, None), 2, 5)
    peak = torch.cuda.max_memory_allocated() / 1e9
    if rank == 0:
        print(
            "RESULT " + json.dumps({"tokens_per_s": batch * seq / t, "peak_mem_gb_rank0": peak}), flush=True
        )


def launch(
    model_dir: Path, tp: int, pp: int, batch: int, seq: int, port: int, variant: str, cp: int = 1
) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={tp * pp * cp}", f"--master_port={port}",
           __file__, "--worker", str(model_dir), str(tp), str(pp), "--batch", str(batch), "--seq", str(seq),
           "--overrides", variant, "--cp", str(cp)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]))
    return {"error": portable(done.stderr)[-2500:]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--worker", nargs=3, metavar=("MODEL_DIR", "TP", "PP"))
    p.add_argument("--overrides", default="", help=argparse.SUPPRESS)
    p.add_argument("--cp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--layouts", default="1,1,1 2,1,1 1,2,1", help="space-separated TP,PP,CP triples")
    p.add_argument("--variant", action="append", default=[], help="extra row per layout with these overrides")
    args = p.parse_args()
    if args.worker:
        worker(
            args.worker[0],
            int(args.worker[1]),
            int(args.worker[2]),
            args.batch,
            args.seq,
            args.overrides.split(),
            args.cp,
        )
        return 0
    cfg = compose_config(["model=qwen2_1p5b"])
    model_dir = make_model_dir(cfg)
    flops = train_flops_per_token(cfg, args.seq)
    rows = {}
    port = 29801
    for tp, pp, cp in (tuple(int(x) for x in layout.split(",")) for layout in args.layouts.split()):
        gpus = tp * pp * cp
        if gpus > torch.cuda.device_count():
            continue
        for variant in ("", *args.variant):
            port += 1
            row = launch(model_dir, tp, pp, args.batch, args.seq, port, variant, cp)
            if "tokens_per_s" in row:
                row["mfu_datasheet"] = row["tokens_per_s"] * flops / (DATASHEET_TFLOPS * 1e12 * gpus)
            name = (
                f"TP{tp} PP{pp}"
                + (f" CP{cp}" if cp > 1 else "")
                + f" ({gpus} GPU)"
                + (f" {variant}" if variant else "")
            )
            rows[name] = row
            print(name, json.dumps(row), file=sys.stderr, flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "shape": f"{args.batch}x{args.seq}", "rows": rows}
    print(json.dumps(result, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "megatron_parallel.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
