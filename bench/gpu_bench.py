"""GPU figures for issue 4: the fsdp backend's training throughput/MFU on a Qwen2-1.5B-shaped model,
and the hf rollout's decode throughput against the memory-bandwidth roofline, each beside a plain
baseline measured in the same run (HF + SDPA training loop; HF ``generate``).

    python bench/gpu_bench.py [--batch 8 --seq 2048 --gen-batch 256 --gen-tokens 256] > results

MFU = tokens/s x (6 N + 12 L h s) / peak, with N the parameter count, L layers, h hidden, s sequence
length, and peak the bf16 dense peak measured here by a large matmul (and the 989 TFLOP/s datasheet).
Decode roofline = bandwidth / bytes read per step (weights + mean KV cache), bandwidth measured by a copy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcrl.config import compose_config
from hpcrl.rollout.base import SamplingSettings
from hpcrl.rollout.hf_engine import HFEngine
from hpcrl.trainer.batch import build_batch
from hpcrl.trainer.fsdp import FSDPTrainer, free_port

DATASHEET_TFLOPS = 989.0


def timed(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def measure_peaks() -> tuple[float, float]:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = timed(lambda: a @ a, 3, 20)
    tflops = 2 * 8192**3 / t / 1e12
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = timed(lambda: y.copy_(x), 3, 20)
    bandwidth = 2 * x.numel() / t  # read + write
    return tflops, bandwidth


def make_model_dir(cfg) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    m = cfg.model
    conf = Qwen2Config(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
                       num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                       num_key_value_heads=m.num_kv_heads, max_position_embeddings=32768,
                       tie_word_embeddings=m.tie_embeddings)  # fmt: skip
    out = Path(tempfile.mkdtemp()) / "qwen2-1.5b-random"
    Qwen2ForCausalLM(conf).to(torch.bfloat16).save_pretrained(out)
    from hpcrl.tiny import build_tokenizer  # any tokenizer: the benchmark feeds token ids

    build_tokenizer(out, m.vocab_size)
    return out


def train_flops_per_token(cfg, seq: int) -> float:
    m = cfg.model
    return 6 * m.param_counts().total + 12 * m.num_layers * m.hidden_size * seq


def bench_train_baseline(model_dir: Path, batch: int, seq: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="sdpa"
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    x = torch.randint(0, 1000, (batch, seq), device="cuda")

    def step():
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    t = timed(step, 2, 5)
    return {"tokens_per_s": batch * seq / t, "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9}


def bench_train_fsdp(cfg, model_dir: Path, batch: int, seq: int, compile_layers: bool = False) -> dict:
    cfg.trainer.compile = compile_layers
    trainer = FSDPTrainer(model_dir, cfg, master=f"127.0.0.1:{free_port()}", device="cuda")
    half = seq // 2
    prompts = [torch.randint(0, 1000, (half,)).tolist() for _ in range(batch)]
    comps = [torch.randint(0, 1000, (seq - half,)).tolist() for _ in range(batch)]
    b = build_batch(
        prompts, comps, [[-1.0] * len(c) for c in comps], [1.0, -1.0] * (batch // 2), [1.0] * batch, 0
    )
    b = type(b)(
        *(t.cuda() for t in (b.input_ids, b.attention_mask, b.loss_mask, b.advantages, b.rollout_logp))
    )
    torch.cuda.reset_peak_memory_stats()
    t = timed(lambda: trainer.train_step(b, None), 2, 5)
    return {"tokens_per_s": batch * seq / t, "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9}


class _IdsOnly:
    """Benchmark-only stand-in for the tokenizer (throughput does not depend on the text)."""

    def decode(self, ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
        return ""


def bench_rollout(cfg, model_dir: Path, gen_batch: int, gen_tokens: int, bandwidth: float) -> dict:
    engine = HFEngine(model_dir, cfg.rollout, device="cuda")
    prompts = [torch.randint(3, 1000, (128,)).tolist() for _ in range(gen_batch)]
    settings = SamplingSettings(1, 1.0, 1.0, gen_tokens, 0)
    engine.eos_id = -1  # never stop early: every row decodes gen_tokens tokens
    engine.tok = _IdsOnly()  # random weights emit ids outside the stand-in tokenizer: skip detokenising

    def ours():
        engine.generate(prompts, settings)

    def baseline():
        x = torch.tensor(prompts, device="cuda")
        engine.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=gen_tokens,
                              min_new_tokens=gen_tokens, do_sample=True, pad_token_id=0)  # fmt: skip

    t_ours = timed(ours, 1, 2)
    t_base = timed(baseline, 1, 2)
    m = cfg.model
    weights = 2 * m.param_counts().total
    mean_ctx = 128 + gen_tokens / 2
    kv = gen_batch * mean_ctx * 2 * m.num_layers * m.num_kv_heads * m.head_dim * 2
    roofline = gen_batch * bandwidth / (weights + kv)
    tok = gen_batch * gen_tokens
    return {
        "ours_tokens_per_s": tok / t_ours,
        "baseline_tokens_per_s": tok / t_base,
        "roofline_tokens_per_s": roofline,
    }


def rollout_only(cfg, model_dir: Path, args, bandwidth: float) -> int:
    """hf rollout with the static cache + compiled decode step (the GPU default) and with the dynamic
    cache loop, each beside HF generate, in one run."""
    t0 = time.perf_counter()
    static = bench_rollout(cfg, model_dir, args.gen_batch, args.gen_tokens, bandwidth)
    static_s = time.perf_counter() - t0
    cfg.rollout.static_cache = False
    torch.cuda.empty_cache()
    dynamic = bench_rollout(cfg, model_dir, args.gen_batch, args.gen_tokens, bandwidth)
    roof = static["roofline_tokens_per_s"]
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "rollout_shape": f"{args.gen_batch} x (128 prompt + {args.gen_tokens} new)",
               "static_cache_compiled": static, "dynamic_cache": dynamic,
               "static_bench_wall_s_incl_compile": static_s, "roofline_tokens_per_s": roof}  # fmt: skip
    print(json.dumps(results, indent=1))
    print(f"\n{'rollout':36s} {'tok/s':>9s} {'% roofline':>11s} {'x HF generate':>14s}")
    for name, r in (("hf engine, static cache + compiled", static), ("hf engine, dynamic cache", dynamic)):
        print(f"{name:36s} {r['ours_tokens_per_s']:9.0f} {100 * r['ours_tokens_per_s'] / roof:10.1f}% "
              f"{r['ours_tokens_per_s'] / r['baseline_tokens_per_s']:14.2f}")  # fmt: skip
    print(
        f"{'HF generate (baseline)':36s} {dynamic['baseline_tokens_per_s']:9.0f} {100 * dynamic['baseline_tokens_per_s'] / roof:10.1f}%"
    )
    out = os.environ.get("OUT")
    if out:
        Path(out, "rollout_bench.json").write_text(json.dumps(results, indent=1))
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--gen-batch", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=256)
    p.add_argument(
        "--rollout-only", action="store_true", help="only the hf rollout: static-cache path vs dynamic"
    )
    args = p.parse_args()
    cfg = compose_config(["model=qwen2_1p5b", "cluster=h200", "cluster.slurm.account=x", "cluster.container.image=x",
                          f"trainer.micro_batch_size={args.batch}", "algo.kl_coef=0", "rollout=hf",
                          f"rollout.max_num_seqs={args.gen_batch}"])  # fmt: skip
    tflops, bandwidth = measure_peaks()
    model_dir = make_model_dir(cfg)
    if args.rollout_only:
        return rollout_only(cfg, model_dir, args, bandwidth)
    flops = train_flops_per_token(cfg, args.seq)
    base = bench_train_baseline(model_dir, args.batch, args.seq)
    torch.cuda.empty_cache()
    ours = bench_train_fsdp(cfg, model_dir, args.batch, args.seq)
    torch.cuda.empty_cache()
    compiled = bench_train_fsdp(cfg, model_dir, args.batch, args.seq, compile_layers=True)
    torch.cuda.empty_cache()
    roll = bench_rollout(cfg, model_dir, args.gen_batch, args.gen_tokens, bandwidth)
    results = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "measured_bf16_tflops": tflops, "measured_bandwidth_tb_s": bandwidth / 1e12,
        "train_shape": f"{args.batch}x{args.seq}", "flops_per_token": flops,
        "train_baseline_hf_sdpa": {**base, "mfu_datasheet": base["tokens_per_s"] * flops / DATASHEET_TFLOPS / 1e12},
        "train_fsdp_backend": {**ours, "mfu_datasheet": ours["tokens_per_s"] * flops / DATASHEET_TFLOPS / 1e12},
        "train_fsdp_backend_compiled": {
            **compiled, "mfu_datasheet": compiled["tokens_per_s"] * flops / DATASHEET_TFLOPS / 1e12,
        },
        "rollout_shape": f"{args.gen_batch} x (128 prompt + {args.gen_tokens} new)",
        "rollout": {**roll, "ours_pct_roofline": 100 * roll["ours_tokens_per_s"] / roll["roofline_tokens_per_s"],
                    "baseline_pct_roofline": 100 * roll["baseline_tokens_per_s"] / roll["roofline_tokens_per_s"]},
    }  # fmt: skip
    print(json.dumps(results, indent=1))
    t, r = results["train_fsdp_backend"], results["rollout"]
    b = results["train_baseline_hf_sdpa"]
    print(f"\n{'figure':44s} {'ours':>12s} {'baseline':>12s} {'ratio':>7s}")
    print(
        f"{'train tokens/s (' + results['train_shape'] + ')':44s} {t['tokens_per_s']:12.0f} {b['tokens_per_s']:12.0f} {t['tokens_per_s'] / b['tokens_per_s']:7.2f}"
    )
    print(
        f"{'train MFU (989 TFLOP/s datasheet)':44s} {100 * t['mfu_datasheet']:11.1f}% {100 * b['mfu_datasheet']:11.1f}%"
    )
    c = results["train_fsdp_backend_compiled"]
    print(
        f"{'train tokens/s, trainer.compile=true':44s} {c['tokens_per_s']:12.0f} {b['tokens_per_s']:12.0f} {c['tokens_per_s'] / b['tokens_per_s']:7.2f}"
    )
    print(f"{'train MFU, trainer.compile=true':44s} {100 * c['mfu_datasheet']:11.1f}%")
    print(f"{'train peak memory GB':44s} {t['peak_mem_gb']:12.1f} {b['peak_mem_gb']:12.1f}")
    print(
        f"{'rollout tokens/s':44s} {r['ours_tokens_per_s']:12.0f} {r['baseline_tokens_per_s']:12.0f} {r['ours_tokens_per_s'] / r['baseline_tokens_per_s']:7.2f}"
    )
    print(
        f"{'rollout % of decode roofline':44s} {r['ours_pct_roofline']:11.1f}% {r['baseline_pct_roofline']:11.1f}%"
    )
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_bench.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
