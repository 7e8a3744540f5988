"""Checkpoint cost on one GPU: how long a training step is blocked by a save, sync vs async, with the
project's own trainer and writer (FSDPTrainer.save_checkpoint -> trainer/shards.py -> DCP files).

For each model shape (random weights): two warm-up train steps; a sync save (the step is blocked for
the whole write); an async save followed at once by the next train step (blocked only while the shards
are copied to host memory; the write runs beside the step) and the wait for the write's end; the
step's time alone vs with a write beside it. The checkpoint is deleted after each save (disk).

    python bench/checkpoint_gpu.py [--models qwen2_1p5b:28,qwen3_8b:8] [--batch 4] [--seq 1024]
    python bench/checkpoint_gpu.py --device cpu --models tiny:2       # dry run of the same code
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def random_batch(batch: int, seq: int, vocab: int):  # type: ignore[no-untyped-def]
    import torch

    from hpcrl.trainer.batch import build_batch

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (seq // 4,), generator=gen).tolist() for _ in range(batch)]
    comps = [torch.randint(3, vocab, (seq - seq // 4,), generator=gen).tolist() for _ in range(batch)]
    logps = [[-1.0] * len(c) for c in comps]
    return build_batch(prompts, comps, logps, [1.0, -1.0] * (batch // 2), [1.0] * batch, pad_id=0)


def timed(fn, device: str) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


def bench_model(name: str, layers: int, args: argparse.Namespace) -> dict:
    import torch
    from gpu_bench import make_model_dir

    from hpcrl.config.compose import compose_config
    from hpcrl.trainer.fsdp import FSDPTrainer
    from hpcrl.trainer.process_group import free_port

    overrides = [f"model={name}", "algo.kl_coef=0", f"trainer.micro_batch_size={args.batch}", "rollout=hf"]
    if name != "tiny":
        overrides += [f"model.num_layers={layers}", "cluster=h200", "cluster.slurm.account=x",
                      "cluster.container.image=x"]  # fmt: skip
    cfg = compose_config(overrides)
    model_dir = make_model_dir(cfg) if name != "tiny" else _tiny(cfg)
    trainer = FSDPTrainer(model_dir, cfg, device=args.device, master=f"127.0.0.1:{free_port()}")
    params = sum(p.numel() for p in trainer.model.parameters())
    batch = random_batch(args.batch, args.seq, cfg.model.vocab_size)

    def step() -> object:
        return trainer.train_step(batch, None)

    for _ in range(2):
        step()
    alone, _ = timed(step, args.device)
    work = Path(args.dir) / f"{name}-ckpt"
    row: dict = {"model": name, "layers": layers, "params": params, "step_alone_s": alone}
    sync_s, _ = timed(partial(trainer.save_checkpoint, str(work), async_save=False), args.device)
    row["checkpoint_gb"] = sum(f.stat().st_size for f in work.iterdir()) / 1e9
    row["sync_blocked_s"] = sync_s
    shutil.rmtree(work)
    for save in ("first", "second"):  # the first allocates the host buffers, the second reuses them
        start = time.perf_counter()
        row[f"async_{save}_blocked_s"] = trainer.save_checkpoint(str(work), async_save=True)
        row[f"step_beside_{save}_write_s"], _ = timed(step, args.device)
        row[f"async_{save}_wait_after_step_s"] = trainer.finish_checkpoint()
        row[f"async_{save}_write_total_s"] = time.perf_counter() - start
        shutil.rmtree(work)
    row["async_blocked_s"] = row["async_second_blocked_s"]
    row["async_wait_after_step_s"] = row["async_second_wait_after_step_s"]
    row["async_write_total_s"] = row["async_second_write_total_s"]
    row["write_gb_per_s"] = row["checkpoint_gb"] / max(
        row["async_write_total_s"] - row["async_blocked_s"], 1e-9
    )
    if args.device.startswith("cuda"):
        row["peak_gpu_gb"] = torch.cuda.max_memory_allocated() / 1e9
    print(json.dumps(row), flush=True)
    trainer.model = trainer.optimizer = trainer.writer = None  # free GPU and pinned host memory
    shutil.rmtree(model_dir, ignore_errors=True)
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def _tiny(cfg) -> Path:  # type: ignore[no-untyped-def]
    from hpcrl.run.tiny_model import ensure_tiny_model

    return ensure_tiny_model(cfg.model, Path(tempfile.mkdtemp()), sft_steps=0, seed=0, log=lambda _: None)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="qwen2_1p5b:28,qwen3_8b:8", help="name:layers,...")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints are written")
    args = p.parse_args()
    rows = []
    for spec in args.models.split(","):
        name, layers = spec.split(":")
        rows.append(bench_model(name, int(layers), args))
        out = os.environ.get("OUT")
        if out:
            Path(out, "checkpoint_gpu.json").write_text(json.dumps(rows, indent=1))
    print(f"{'model':12} {'params':>8} {'ckpt GB':>8} {'step s':>7} {'sync blocked':>13} "
          f"{'async 1st':>10} {'async 2nd':>10} {'ratio':>6} {'write s':>8} {'write GB/s':>10}")  # fmt: skip
    for r in rows:
        print(f"{r['model']:12} {r['params'] / 1e9:7.2f}B {r['checkpoint_gb']:8.1f} {r['step_alone_s']:7.2f} "
              f"{r['sync_blocked_s']:13.2f} {r['async_first_blocked_s']:10.2f} {r['async_blocked_s']:10.2f} "
              f"{r['sync_blocked_s'] / r['async_blocked_s']:6.1f} {r['async_write_total_s']:8.1f} "
              f"{r['write_gb_per_s']:10.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
