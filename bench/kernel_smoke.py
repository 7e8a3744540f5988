"""mamba_ssm's Triton SSD scan and causal_conv1d's CUDA conv against hpcrl's torch paths
(``hpcrl/trainer/ssd.py``): largest difference and milliseconds forward+backward at a Nemotron-H Super
Mamba layer's widths, packed (``seq_idx``) and not. Runs where the kernels are installed (the device
script ``bench/device_runs/kernel_wheels.sh`` builds them)."""

from __future__ import annotations

import time

import torch
from causal_conv1d import causal_conv1d_fn
from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

from hpcrl.trainer.ssd import causal_conv, ssd_scan

# Super's Mamba mixer: 128 heads x 64 head dim, 8 groups, state 128, conv 4, chunk 128
H, P, G, N, K, CHUNK = 128, 64, 8, 128, 4, 128


def timed(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def inputs(b: int, length: int, dev: str = "cuda"):
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=dev, generator=g)  # noqa: E731
    x = r(b, length, H, P).bfloat16().requires_grad_()
    dt = torch.nn.functional.softplus(r(b, length, H) - 3).requires_grad_()
    a = -torch.rand(H, device=dev, generator=g).add(0.5)
    bb, cc = r(b, length, G, N).bfloat16().requires_grad_(), r(b, length, G, N).bfloat16().requires_grad_()
    return x, dt, a, bb, cc


def seq_idx_for(b: int, length: int, pieces: int) -> torch.Tensor:
    cuts = torch.linspace(0, length, pieces + 1).long()
    idx = torch.zeros(length, dtype=torch.int32)
    for i in range(pieces):
        idx[cuts[i] : cuts[i + 1]] = i
    return idx.cuda()[None].expand(b, length).contiguous()


def scan_case(b: int, length: int, pieces: int) -> dict:
    x, dt, a, bb, cc = inputs(b, length)
    seq = seq_idx_for(b, length, pieces) if pieces > 1 else None
    kern = lambda: mamba_chunk_scan_combined(x, dt, a, bb, cc, CHUNK, seq_idx=seq)  # noqa: E731
    ref = lambda: ssd_scan(x.float(), dt, a, bb.float(), cc.float(), CHUNK, seq_idx=seq)  # noqa: E731
    yk, yr = kern().float(), ref()
    diff = (yk - yr).abs().max().item() / yr.abs().max().item()
    step = lambda f: lambda: f().float().square().mean().backward()  # noqa: E731
    return {
        "case": f"scan b{b} L{length} seqs{pieces}",
        "rel_max_diff": diff,
        "kernel_ms": timed(step(kern)),
        "torch_ms": timed(step(ref)),
    }


def conv_case(b: int, length: int, pieces: int) -> dict:
    ch = H * P + 2 * G * N
    g = torch.Generator(device="cuda").manual_seed(1)
    # channel-last, as the Mamba mixer hands it over (the kernel needs it with seq_idx)
    xl = torch.randn(b, length, ch, device="cuda", generator=g).bfloat16().requires_grad_()
    w = torch.randn(ch, K, device="cuda", generator=g).bfloat16().requires_grad_()
    bias = torch.randn(ch, device="cuda", generator=g).bfloat16()
    seq = seq_idx_for(b, length, pieces) if pieces > 1 else None
    kern = lambda: causal_conv1d_fn(xl.transpose(1, 2), w, bias, seq_idx=seq)  # noqa: E731
    ref = lambda: causal_conv(xl.transpose(1, 2).float(), w.float()[:, None], bias.float(), seq)  # noqa: E731
    yk, yr = kern().float(), ref()
    diff = (yk - yr).abs().max().item() / yr.abs().max().item()
    step = lambda f: lambda: f().float().square().mean().backward()  # noqa: E731
    return {
        "case": f"conv b{b} L{length} seqs{pieces}",
        "rel_max_diff": diff,
        "kernel_ms": timed(step(kern)),
        "torch_ms": timed(step(ref)),
    }


def main() -> None:
    print(torch.__version__, torch.cuda.get_device_name())
    rows = [
        f(b, L, p) for f in (scan_case, conv_case) for b, L, p in ((1, 4096, 1), (1, 4096, 8), (4, 2048, 1))
    ]
    print(f"{'case':28} {'rel max diff':>12} {'kernel ms':>10} {'torch ms':>10} {'speed-up':>9}")
    for r in rows:
        print(
            f"{r['case']:28} {r['rel_max_diff']:12.2e} {r['kernel_ms']:10.2f} {r['torch_ms']:10.2f} "
            f"{r['torch_ms'] / r['kernel_ms']:8.1f}x"
        )


if __name__ == "__main__":
    main()
