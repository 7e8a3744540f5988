"""The fsdp optimizer options on one GPU (trainer/fsdp/optim.py): where the state lives, what the GPU
holds between and during steps, and the step's time, for AdamW resident / offloaded / bf16 and
Adafactor, on an FSDP2 stack of square layers (NCCL, one rank).

    python3 bench/optimizer_gpu.py [--hidden 4096 --layers 8 --steps 3]

Prints one row per option and checks what the options promise: offloaded state on pinned host
memory, bf16 state in bf16, the offloaded fp32 step equal to the resident one.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from hpcrl.trainer.config import Optimizer, Precision
from hpcrl.trainer.fsdp.optim import StateStore, make_optimizer

MB = 2**20
OPTIONS = {
    "adamw": (Optimizer.adamw, Precision.float32, False),
    "adamw-offload": (Optimizer.adamw, Precision.float32, True),
    "adamw-bf16": (Optimizer.adamw, Precision.bfloat16, False),
    "adamw-bf16-offload": (Optimizer.adamw, Precision.bfloat16, True),
    "adafactor": (Optimizer.adafactor, Precision.float32, False),
    "adafactor-offload": (Optimizer.adafactor, Precision.float32, True),
}


def model(hidden: int, layers: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden, bias=True) for _ in range(layers)]).cuda()
    for layer in net:
        fully_shard(layer)
    return fully_shard(net)


def run(name: str, hidden: int, layers: int, steps: int) -> tuple[dict[str, object], list[torch.Tensor]]:
    optimizer, dtype, offload = OPTIONS[name]
    trainer = SimpleNamespace(
        optimizer=optimizer, optimizer_dtype=dtype, optimizer_offload=offload, weight_decay=0.0
    )
    trainer.adamw_betas = lambda: (0.9, 0.999)
    cfg = SimpleNamespace(trainer=trainer, algo=SimpleNamespace(lr=1e-4), run=SimpleNamespace(seed=0))
    gc.collect()
    start_mb = torch.cuda.memory_allocated()
    net = model(hidden, layers)
    opt = make_optimizer(list(net.parameters()), cfg, "cuda")  # type: ignore[arg-type]
    store = StateStore(opt, cfg, "cuda", 0)  # type: ignore[arg-type]
    x = torch.randn(64, hidden, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    times = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        net(x).square().mean().backward()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        store.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        during = torch.cuda.max_memory_allocated() - before
    opt.zero_grad(set_to_none=True)
    weights = torch.cuda.memory_allocated() - start_mb  # the parameters and the state on the GPU
    kept = [v.to_local() for s in opt.state.values() for v in s.values() if v.dim() > 0]
    load_extra = resume(net, opt, store, hidden, layers, cfg) if offload else None
    row = {
        "option": name,
        "gpu_load_extra_MB": load_extra,
        "state_MB": round(sum(v.numel() * v.element_size() for v in kept) / MB, 1),
        "state_dtype": sorted({str(v.dtype) for v in kept}),
        "state_device": sorted({v.device.type for v in kept}),
        "pinned": all(v.is_pinned() for v in kept),
        "gpu_between_steps_MB": round(weights / MB, 1),
        "gpu_step_extra_MB": round(during / MB, 1),
        "step_s": round(min(times), 4),
    }
    return row, [p.full_tensor().detach().cpu() for p in net.parameters()]


def resume(net, opt, store, hidden: int, layers: int, cfg) -> float:  # type: ignore[no-untyped-def]
    """Save, then load into a fresh model and optimizer as ``FSDPTrainer.load_checkpoint`` does; the GPU
    memory the load takes beyond the fresh model's (MB), after checking the state came back whole."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict

    path = tempfile.mkdtemp()
    model_sd, optim_sd = get_state_dict(net, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    fresh = model(hidden, layers)
    fresh_opt = make_optimizer(list(fresh.parameters()), cfg, "cuda")
    fresh_store = StateStore(fresh_opt, cfg, "cuda", 0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fresh_store.create()
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(fresh, state["model"])
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - before) / MB
    ours = [v.to_local() for s in opt.state.values() for v in s.values() if v.dim() > 0]
    theirs = [v.to_local() for s in fresh_opt.state.values() for v in s.values() if v.dim() > 0]
    assert all(torch.equal(a, b) and b.is_pinned() for a, b in zip(ours, theirs, strict=True))
    return round(extra, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    rows, weights = [], {}
    for name in OPTIONS:
        row, weights[name] = run(name, args.hidden, args.layers, args.steps)
        rows.append(row)
        print(json.dumps(row), flush=True)
    same = all(torch.equal(a, b) for a, b in zip(weights["adamw"], weights["adamw-offload"], strict=True))
    print(f"offloaded AdamW step equals the resident one: {same}")
    assert same
    for row in rows:
        offload = str(row["option"]).endswith("offload")
        assert row["state_device"] == (["cpu"] if offload else ["cuda"]) and row["pinned"] == offload, row
        assert ("bf16" in str(row["option"])) == (row["state_dtype"] == ["torch.bfloat16"]), row
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
