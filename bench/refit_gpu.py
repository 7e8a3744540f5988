"""Refit time on two GPUs without Ray: the FSDP trainer on GPU 0 sends its weights to the HF rollout
engine on GPU 1, with the project's own code on both ends (FSDPTrainer.export_weights ->
WeightSender -> NCCL -> WeightReceiver -> HFEngine.load_weights), against the host-memory path the
object-store sync takes (export to CPU, safetensors bytes through /dev/shm, load, copy to GPU 1) in
the same run. Ray is left out because the device image has none; the vLLM engine because GPU vLLM
cannot be installed there — the HF engine's load is a plain parameter copy, so the figure is the
transfer plus a copy, as vLLM's in-place reload is.

    python bench/refit_gpu.py [--layers 28] [--repeats 5] [--json out.json]
    python bench/refit_gpu.py --device cpu --model tiny      # dry run of the same code with gloo
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _wait_for(path: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.05)


def worker(rank: int, args: argparse.Namespace, work: Path) -> None:
    import torch
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    from hpcrl.config.compose import compose_config
    from hpcrl.sync.broadcast import dtype_of, join_as_sender
    from hpcrl.trainer.process_group import free_port

    cfg = compose_config([f"model={args.model}", f"model.num_layers={args.layers}", "rollout=hf"])
    gpu = args.device == "cuda"
    device = f"cuda:{rank}" if gpu else "cpu"
    if gpu:
        torch.cuda.set_device(rank)
    model_dir = work / "model"
    wire = "bfloat16" if gpu else "float32"
    if rank == 0:
        from bench.gpu_bench import make_model_dir  # a random Qwen2 of the configured shape

        made = make_model_dir(cfg)
        shutil.move(made, model_dir)
        from hpcrl.trainer import make_trainer

        trainer = make_trainer(model_dir, cfg, 0, 1, f"127.0.0.1:{free_port()}", device)
        weights = trainer.export_weights()
        metas = [(n, list(t.shape)) for n, t in weights.items()]
        port = free_port()
        (work / "metas.json.tmp").write_text(json.dumps({"metas": metas, "port": port}))
        os.replace(work / "metas.json.tmp", work / "metas.json")
    else:
        _wait_for(work / "metas.json")
        from hpcrl.rollout.hf_engine import HFEngine

        engine = HFEngine(model_dir, cfg.rollout, device=device)
    info = json.loads((work / "metas.json").read_text())
    master = f"127.0.0.1:{info['port']}"
    bucket_numel = cfg.rollout.weight_sync_bucket_mb * 2**20 // dtype_of(wire).itemsize
    backend = "nccl" if gpu else "gloo"
    if rank == 0:
        sender = join_as_sender(backend, master, 2, info["metas"], bucket_numel, wire, device)
        group = sender.group
    else:
        engine.join_weight_group(master, 1, 2, info["metas"], bucket_numel, "127.0.0.1", backend)
        group = engine._receiver.group

    def barrier() -> None:
        _sync(device)
        group.barrier(torch.device(device))

    times: dict[str, list[float]] = {"collective": [], "host_memory": [], "export": []}
    shm = Path("/dev/shm" if Path("/dev/shm").is_dir() else work) / f"hpcrl-refit-{os.getpid()}.bin"
    for i in range(args.repeats + 1):  # the first round warms NCCL and the allocator up
        barrier()
        start = time.perf_counter()
        if rank == 0:
            weights = trainer.export_weights()
            _sync(device)
            exported = time.perf_counter()
            sender.send(weights)
            _sync(device)
            part = f"export {exported - start:.3f} s, send {time.perf_counter() - exported:.3f} s"
        else:  # engine.receive_weights(), in its two parts
            received = dict(engine._receiver.receive())
            _sync(device)
            got_at = time.perf_counter()
            engine.load_weights(received)
            _sync(device)
            part = f"receive {got_at - start:.3f} s, load {time.perf_counter() - got_at:.3f} s"
        print(f"round {i} rank {rank}: {part}", flush=True)
        barrier()
        if i:
            times["collective"].append(time.perf_counter() - start)
            if rank == 0:
                times["export"].append(exported - start)
        # The object-store path's copies: gathered to host, serialised, through shared memory, loaded.
        barrier()
        start = time.perf_counter()
        if rank == 0:
            cpu = {
                k: v.detach().to("cpu", dtype_of(wire), copy=True)
                for k, v in trainer.export_weights().items()
            }
            path = work / "host.path"
            blob = st_save(cpu)
            shm.write_bytes(blob)
            path.write_text(str(shm))
        barrier()
        if rank == 1:
            blob = Path((work / "host.path").read_text()).read_bytes()
            engine.load_weights({k: v.to(device) for k, v in st_load(blob).items()})
        _sync(device)
        barrier()
        if i:
            times["host_memory"].append(time.perf_counter() - start)
    if rank == 1:
        # The engine now holds what the trainer exported (cast to the wire dtype): compare one tensor.
        got = engine.model.state_dict()["model.embed_tokens.weight"].float().sum().item()
        (work / "check.json").write_text(json.dumps({"embed_sum": got}))
        return
    _wait_for(work / "check.json")
    want = weights["model.embed_tokens.weight"].to(dtype_of(wire)).float().sum().item()
    got = json.loads((work / "check.json").read_text())["embed_sum"]
    shm.unlink(missing_ok=True)
    sent = sum(t.numel() for t in weights.values()) * dtype_of(wire).itemsize
    med = {k: statistics.median(v) for k, v in times.items()}
    params = sum(t.numel() for t in weights.values())
    print(
        f"model {args.model} x{args.layers} layers: {params / 1e9:.2f}B parameters, {sent / 1e9:.2f} GB on the wire ({wire})"
    )
    print(f"{'path':34s} {'median s':>9s} {'GB/s':>7s} {'x host path':>12s}")
    for name, key in (
        ("collective (NCCL/gloo broadcast)", "collective"),
        ("host memory (object-store copies)", "host_memory"),
    ):
        print(
            f"{name:34s} {med[key]:9.3f} {sent / med[key] / 1e9:7.1f} {med[key] / med['host_memory']:12.3f}"
        )
    print(
        f"of which trainer export (gather): {med['export']:.3f} s; engine holds the sent weights: {abs(got - want) < 1e-3 * max(1, abs(want))}"
    )
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "layers": args.layers, "params": params,
                                         "bytes": sent, "wire_dtype": wire, "device": args.device,
                                         "samples": times, "median_s": med, "weights_match": abs(got - want) < 1e-3 * max(1, abs(want))}, indent=1))  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2_1p5b")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        worker(args.rank, args, args.work)
        return 0
    import subprocess

    work = Path(tempfile.mkdtemp(prefix="hpcrl-refit-"))
    argv = [sys.executable, __file__, *sys.argv[1:], "--work", str(work)]
    procs = [subprocess.Popen([*argv, "--rank", str(r)]) for r in range(2)]
    codes = [p.wait() for p in procs]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
