"""Sliding-window attention kernels for Gemma 3's local layers, forward + backward on one GPU.

    python bench/window_attention_bench.py [--batch 8 --seq 2048 --heads 4 --kv-heads 1 --dim 256 --window 512]

Rows (same shapes, bf16): SDPA causal (flash attention: the global layers' kernel and the speed a
window could at best beat), SDPA with a boolean sliding-window mask (what hpcrl's SDPAttention and
Hugging Face's sdpa path run today: the memory-efficient kernel, every key block computed), and
flex_attention with a sliding-window block mask (compiled; skips key blocks outside the window).
Prints ms per forward+backward and the ratio to the masked-SDPA row; the JSON goes to $OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import timed


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--window", type=int, default=512)
    a = p.parse_args()
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(a.batch, a.heads, a.seq, a.dim, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(a.batch, a.kv_heads, a.seq, a.dim, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(a.batch, a.kv_heads, a.seq, a.dim, device=dev, dtype=dt, requires_grad=True)
    grad = torch.randn(a.batch, a.heads, a.seq, a.dim, device=dev, dtype=dt)
    i = torch.arange(a.seq, device=dev)
    mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < a.window)
    gqa = a.heads != a.kv_heads

    def step(attn):
        def run():
            out = attn()
            out.backward(grad)
            q.grad = k.grad = v.grad = None
            return out

        return run

    rows: dict[str, dict] = {}
    outs = {}

    def sdpa_causal():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def sdpa_masked():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def window(b, h, qi, ki):
        return (qi >= ki) & (qi - ki < a.window)

    block = create_block_mask(window, None, None, a.seq, a.seq, device=dev)
    flex = torch.compile(flex_attention)

    def flex_window():
        return flex(q, k, v, block_mask=block, enable_gqa=gqa)

    for name, fn in (("sdpa_causal (no window)", sdpa_causal), ("sdpa_bool_window_mask", sdpa_masked),
                     ("flex_attention_window", flex_window)):  # fmt: skip
        try:
            rows[name] = {"ms_fwd_bwd": 1000 * timed(step(fn), 3, 10)}
            with torch.no_grad():
                outs[name] = fn().float()
        except Exception as exc:  # a kernel that does not run here is a result too
            rows[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    if "flex_attention_window" in outs:
        diff = (outs["flex_attention_window"] - outs["sdpa_bool_window_mask"]).abs().max()
        rows["flex_attention_window"]["max_diff_vs_masked_sdpa"] = float(diff)
        grads = {}
        for name, fn in (("flex", flex_window), ("sdpa", sdpa_masked)):
            grads[name] = [g.float() for g in torch.autograd.grad((fn().float() * grad).sum(), (q, k, v))]
        rows["flex_attention_window"]["max_grad_diff_vs_masked_sdpa"] = {
            n: float((a - b).abs().max()) for n, a, b in zip("qkv", grads["flex"], grads["sdpa"], strict=True)
        }
        rows["flex_attention_window"]["max_grad_abs"] = {
            n: float(b.abs().max()) for n, b in zip("qkv", grads["sdpa"], strict=True)
        }
    base = rows["sdpa_bool_window_mask"].get("ms_fwd_bwd")
    print(f"\n{'row':28s} {'ms fwd+bwd':>11s} {'x masked SDPA':>14s}")
    for name, row in rows.items():
        if "ms_fwd_bwd" in row:
            ratio = base / row["ms_fwd_bwd"] if base else float("nan")
            print(f"{name:28s} {row['ms_fwd_bwd']:11.2f} {ratio:14.2f}")
        else:
            print(f"{name:28s} {row['error']}")
    result = {"shape": vars(a), "torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "rows": rows}
    print(json.dumps(result, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "window_attention_bench.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
