"""A packed row's attention under context parallel (megatron), every CP rank played in one process:
per sequence (``varlen.attend_packed_chunks``, what runs now) against the rows of the row's dense
block mask (what ran before: each chunk's queries against every key up to its end under its slice of
the [L, L] mask).

    python bench/packed_cp_attention.py [--cp 2 --window 512 --out result.json]

Session 25's ``check_kernel`` shape (4,096 tokens in sequences of 300, 17, 1,200, 64 and 2,515, 12
heads over 2 KV heads of 128; fp32 on a CPU, bf16 on a GPU): both ways' forward + backward over every
rank's queries against the gathered keys (the all-gather itself is the same either way and left out),
the fastest of 5, and the largest differences of outputs and input gradients.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from packing_gpu import GPU, fastest

from hpcrl.trainer.context_parallel import rank_positions, sdpa, window_mask
from hpcrl.trainer.packing import Packed
from hpcrl.trainer.varlen import RowBounds, attend_packed_chunks

LENGTHS, HEADS, KV, DIM = [300, 17, 1200, 64, 2515], 12, 2, 128


def masked_chunks(q, k, v, rank, cp, window, allowed, attend):
    """The code before this branch (``attend_chunks`` with the row's mask): each chunk's queries against
    the keys up to its end (or its window's reach) under that slice of the [L, L] mask."""
    chunk, outs = q.shape[2] // 2, []
    for j, g in enumerate((rank, 2 * cp - 1 - rank)):
        seen = (g + 1) * chunk
        first = 0 if window is None else max(0, g * chunk - window + 1)
        rows = allowed[g * chunk : seen, first:seen]
        if window is not None:
            rows = rows & window_mask(chunk, window, q.device, g * chunk, first, seen - first)
        outs.append(
            attend(q[:, :, j * chunk : (j + 1) * chunk], k[:, :, first:seen], v[:, :, first:seen], rows)
        )
    return torch.cat(outs, dim=2)


def run(cp: int, window: int | None) -> dict:
    device, dtype = ("cuda", torch.bfloat16) if GPU else ("cpu", torch.float32)
    n = sum(LENGTHS)
    chunk = -(-n // (2 * cp))
    width = 2 * cp * chunk
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, h, width, DIM, generator=gen).to(device, dtype).requires_grad_()
        for h in (HEADS, KV, KV)
    )
    ranks = [rank_positions(r, cp, chunk).to(device) for r in range(cp)]
    row = RowBounds.of(LENGTHS, device)
    attend = functools.partial(sdpa, scale=DIM**-0.5)
    ids = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long, device=device)
    real = torch.arange(max(LENGTHS), device=device)[None] < torch.tensor(LENGTHS, device=device)[:, None]
    allowed = ~Packed.of(ids, real.long()).padded(width).attention_mask()[0, 0]

    def every_rank(per_rank) -> torch.Tensor:
        out = torch.zeros(1, HEADS, width, DIM, device=device, dtype=dtype)
        for r, mine in enumerate(ranks):
            out = out.index_copy(2, mine, per_rank(q[:, :, mine], r))
        return out[:, :, :n]

    def packed() -> torch.Tensor:
        return every_rank(lambda qs, r: attend_packed_chunks(qs, k, v, r, cp, window, row, attend))

    def masked() -> torch.Tensor:
        return every_rank(lambda qs, r: masked_chunks(qs, k, v, r, cp, window, allowed, attend))

    got, want = packed(), masked()
    grads = [torch.autograd.grad(t.float().square().sum(), (q, k, v)) for t in (got, want)]
    result = {
        "cp": cp,
        "window": window,
        "tokens": n,
        "width": width,
        "device": torch.cuda.get_device_name() if GPU else "cpu",
        "out_max_diff": float((got - want).detach().abs().max()),
        "grad_max_diff": max(float((g - w).abs().max()) for g, w in zip(*grads, strict=True)),
        "per_sequence_fwd_bwd_ms": fastest(lambda: torch.autograd.grad(packed().sum(), (q, k, v))) * 1e3,
        "masked_fwd_bwd_ms": fastest(lambda: torch.autograd.grad(masked().sum(), (q, k, v))) * 1e3,
    }
    print(json.dumps(result), flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--window", type=int, help="a sliding-window layer of this many keys")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    result = run(args.cp, args.window)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
