"""GPU figures for issue 4: the fsdp backend's training throughput/MFU on a Qwen2-1.5B-shaped model,
and the hf rollout's decode throughput against the memory-bandwidth roofline, each beside a plain
baseline measured in the same run (HF + SDPA training loop; HF ``generate``).

    python bench/gpu_bench.py [--part train|rollout|all] [--batch 8 --seq 2048 --gen-batch 256 --gen-tokens 256]

Training rows: the HF + SDPA loop, then the fsdp backend with its GPU defaults (compiled layers, chunked
log-prob head) and with each switched off; the default row also gets a CUDA-time profile by kernel family
(top kernels to $OUT/profile_fsdp_default.txt). Rollout rows: the hf engine's static-cache compiled step
with the grouped decode attention (default) and with stock sdpa, its dynamic loop, and HF generate.

MFU = tokens/s x (6 N + 12 L h s) / peak, with N the parameter count, L layers, h hidden, s sequence
length, and peak the bf16 dense peak measured here by a large matmul (and the 989 TFLOP/s datasheet).
Decode roofline = bandwidth / bytes read per step (weights + mean KV cache), bandwidth measured by a copy.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcrl.config.compose import compose_config
from hpcrl.rollout.base import SamplingSettings
from hpcrl.rollout.hf_engine import HFEngine
from hpcrl.trainer.batch import build_batch
from hpcrl.trainer.fsdp import FSDPTrainer
from hpcrl.trainer.process_group import free_port

DATASHEET_TFLOPS = 989.0


def released(fn):
    """Call ``fn`` and give its GPU memory back before the next row (each row builds its own model)."""

    def run(*args, **kwargs):
        import gc

        out = fn(*args, **kwargs)
        gc.collect()
        torch.cuda.empty_cache()
        return out

    return run


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


MODEL_OVERRIDES = os.environ.get("HPCRL_BENCH_MODEL_OVERRIDES", "").split()
"""Catalog-model overrides every benchmark applies, e.g. ``model.num_layers=4`` to fit a slice of a
large model on one GPU (the parameter count and FLOPs follow)."""
REPO = Path(__file__).resolve().parents[1]


def portable(text: str) -> str:
    """A captured stderr with this machine's paths taken out (results are committed): the repository's
    own files relative to it, installed packages from ``site-packages/`` on."""
    return re.sub(r"[^\s\"']*/site-packages/", "site-packages/", text.replace(f"{REPO}/", ""))


DEVICE = os.environ.get("HPCRL_BENCH_DEVICE", "cuda")
"""Where the correctness benches run (gemma_gpu_parity.py, moe_experts_reference.py): "cpu" tries them here."""


def make_model_dir(cfg) -> Path:
    """Random weights in the catalog model's shape: Qwen2 (default), Qwen3, Gemma 3 (text), Gemma 4's
    dense decoder, Qwen3-MoE or Nemotron-H."""
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    m = cfg.model
    common = dict(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
                  num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                  num_key_value_heads=m.num_kv_heads, max_position_embeddings=32768,
                  tie_word_embeddings=m.tie_embeddings)  # fmt: skip
    if m.family == "gemma3":
        kinds = [
            "full_attention" if (i + 1) % m.global_every == 0 else "sliding_attention"
            for i in range(m.num_layers)
        ]
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, head_dim=m.head_dim, query_pre_attn_scalar=m.head_dim,
                                                   sliding_window=m.sliding_window, layer_types=kinds))  # fmt: skip
    elif m.family == "gemma4":  # 31B / 26B-A4B: global layers 512 x global_kv_heads, K=V; 26B's MoE block
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig

        moe = dict(enable_moe_block=True, num_experts=m.num_experts, top_k_experts=m.experts_per_token,
                   moe_intermediate_size=m.moe_ffn_hidden_size) if m.num_experts else {}  # fmt: skip

        kinds = [
            "full_attention"
            if (i + 1) % m.global_every == 0 or i == m.num_layers - 1
            else "sliding_attention"
            for i in range(m.num_layers)
        ]
        model = Gemma4ForCausalLM(Gemma4TextConfig(**common, head_dim=m.head_dim, global_head_dim=m.global_head_dim,
                                                   num_global_key_value_heads=m.global_kv_heads, attention_k_eq_v=True,
                                                   sliding_window=m.sliding_window, layer_types=kinds,
                                                   hidden_size_per_layer_input=0, **moe))  # fmt: skip
    elif m.family == "qwen3_moe":  # Qwen3-30B-A3B's routing: top-k weights renormalised
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, head_dim=m.head_dim, num_experts=m.num_experts,
                                                   num_experts_per_tok=m.experts_per_token,
                                                   moe_intermediate_size=m.moe_ffn_hidden_size, norm_topk_prob=True))  # fmt: skip
    elif m.family == "nemotron_h":  # hpcrl's tiny-model builder at the catalog's widths, Super's chunk
        from unittest import mock

        from hpcrl.run import tiny_model

        with (
            mock.patch.dict(tiny_model.NEMOTRON_H_FIXED, chunk_size=128),
            torch.device("cuda" if torch.cuda.is_available() else "cpu"),
        ):  # random init of billions of parameters: on the GPU when there is one
            model = tiny_model.build_model(m, seed=0)
    elif m.family == "qwen3":  # Qwen2's layout with q/k RMSNorm, no q/k/v bias, explicit head_dim
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=m.head_dim))
    elif m.family == "llama":  # SmolLM2, Llama 3: no q/k/v bias
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**common, head_dim=m.head_dim))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    out = Path(tempfile.mkdtemp()) / f"{m.name}-random"
    model.to(torch.bfloat16).save_pretrained(out)
    from hpcrl.run.tiny_model import build_tokenizer  # any tokenizer: the benchmark feeds token ids

    build_tokenizer(out, m.vocab_size)
    return out


def train_flops_per_token(cfg, seq: int) -> float:
    """6N + 12 L h s, N the parameters a token passes through (an MoE's active ones; a VLM's frozen
    towers, absent from the text-only benchmark model, left out), L the attention layers (all of
    them, but for a hybrid model's Mamba and MoE layers)."""
    m = cfg.model
    counts = m.param_counts()
    return 6 * (counts.active - counts.frozen) + 12 * m.attention_layers * m.hidden_size * seq


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


def fsdp_batch(batch: int, seq: int):
    half = seq // 2
    prompts = [torch.randint(0, 1000, (half,)).tolist() for _ in range(batch)]
    comps = [torch.randint(0, 1000, (seq - half,)).tolist() for _ in range(batch)]
    b = build_batch(
        prompts, comps, [[-1.0] * len(c) for c in comps], [1.0, -1.0] * (batch // 2), [1.0] * batch, 0
    )
    return type(b)(
        *(t.cuda() for t in (b.input_ids, b.attention_mask, b.loss_mask, b.advantages, b.rollout_logp))
    )


@released
def bench_train_fsdp(cfg, model_dir: Path, batch: int, seq: int, *, compile_layers: bool = True,
                     fused_logprob: bool = True, sdpa_backends: list | None = None,
                     profile: str | None = None) -> dict:  # fmt: skip
    """One fsdp-backend configuration: tokens/s and peak memory of ``train_step``; with ``profile``
    (a file path) also the CUDA time per kernel family of one step."""
    import contextlib

    cfg.trainer.compile = compile_layers
    cfg.trainer.fused_logprob = fused_logprob
    trainer = FSDPTrainer(model_dir, cfg, master=f"127.0.0.1:{free_port()}", device="cuda")
    b = fsdp_batch(batch, seq)
    ctx = contextlib.nullcontext()
    if sdpa_backends:
        from torch.nn.attention import sdpa_kernel

        ctx = sdpa_kernel(sdpa_backends, set_priority=True)
    torch.cuda.reset_peak_memory_stats()
    with ctx:
        start = time.perf_counter()
        trainer.train_step(b, None)
        torch.cuda.synchronize()
        first = time.perf_counter() - start  # includes compilation when compiling
        t = timed(lambda: trainer.train_step(b, None), 1, 5)
        families = profile_step(lambda: trainer.train_step(b, None), profile) if profile else None
    out = {"tokens_per_s": batch * seq / t, "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9,
           "first_step_s": first}  # fmt: skip
    if families:
        out["cuda_ms_by_kernel_family"] = families
    return out


KERNEL_FAMILIES = (("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")),
                   ("attention", ("flash", "fmha", "attention", "cudnn")),
                   ("optimizer", ("adam",)),
                   ("copy/cast", ("copy", "cast", "memcpy", "memset", "fill")),
                   ("reduction (softmax, norms, logsumexp)", ("reduce", "softmax", "logsumexp", "norm")),
                   ("elementwise", ("elementwise", "vectorized", "triton", "pointwise")))  # fmt: skip


def profile_step(step, path: str) -> dict:
    """CUDA time of one step grouped by kernel family (by kernel name), the top kernels to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    families: dict[str, float] = {}
    rows = []
    for e in prof.key_averages():
        ms = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 1e3
        if ms <= 0:
            continue
        name = e.key.lower()
        family = next((f for f, keys in KERNEL_FAMILIES if any(k in name for k in keys)), "other")
        families[family] = families.get(family, 0.0) + ms
        rows.append((ms, e.count, e.key[:140]))
    rows.sort(reverse=True)
    Path(path).write_text("\n".join(f"{ms:9.2f} ms {n:6d}x {k}" for ms, n, k in rows[:60]) + "\n")
    families["total"] = sum(families.values())
    return {k: round(v, 2) for k, v in sorted(families.items(), key=lambda kv: -kv[1])}


class _IdsOnly:
    """Benchmark-only stand-in for the tokenizer (throughput does not depend on the text)."""

    def decode(self, ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
        return ""


def rollout_roofline(cfg, gen_batch: int, gen_tokens: int, bandwidth: float) -> float:
    m = cfg.model
    weights = 2 * m.param_counts().total
    mean_ctx = 128 + gen_tokens / 2
    kv = gen_batch * mean_ctx * 2 * m.num_layers * m.num_kv_heads * m.head_dim * 2
    return gen_batch * bandwidth / (weights + kv)


@released
def bench_rollout(cfg, model_dir: Path, gen_batch: int, gen_tokens: int, *, static: bool = True,
                  attn: str | None = None, baseline: bool = False) -> dict:  # fmt: skip
    """The engine's tokens/s (static cache + compiled step, or the dynamic loop), with transformers'
    stock ``sdpa`` attention when ``attn="sdpa"``; with ``baseline`` also HF ``generate`` (stock sdpa)."""
    cfg.rollout.static_cache = static
    engine = HFEngine(model_dir, cfg.rollout, device="cuda")
    if attn:
        engine.model.set_attn_implementation(attn)
    prompts = [torch.randint(3, 1000, (128,)).tolist() for _ in range(gen_batch)]
    settings = SamplingSettings(1, 1.0, 1.0, gen_tokens, 0)
    engine.eos_id = -1  # never stop early: every row decodes gen_tokens tokens
    engine.tok = _IdsOnly()  # random weights emit ids outside the stand-in tokenizer: skip detokenising
    tok = gen_batch * gen_tokens
    start = time.perf_counter()
    out = {"tokens_per_s": tok / timed(lambda: engine.generate(prompts, settings), 1, 2)}
    out["wall_s_incl_compile"] = time.perf_counter() - start
    if baseline:
        engine.model.set_attn_implementation("sdpa")
        x = torch.tensor(prompts, device="cuda")

        def hf_generate():
            engine.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=gen_tokens,
                                  min_new_tokens=gen_tokens, do_sample=True, pad_token_id=0)  # fmt: skip

        out["hf_generate_tokens_per_s"] = tok / timed(hf_generate, 1, 2)
    return out


def rollout_part(cfg, model_dir: Path, args, bandwidth: float) -> dict:
    """hf rollout rows in one run: static cache + compiled step with the grouped decode attention
    (the GPU default) and with stock sdpa, the dynamic loop, and HF generate."""
    roof = rollout_roofline(cfg, args.gen_batch, args.gen_tokens, bandwidth)
    rows = {
        "static cache + compiled, hpcrl_sdpa (default)": bench_rollout(cfg, model_dir, args.gen_batch, args.gen_tokens, baseline=True),
        "static cache + compiled, stock sdpa": bench_rollout(cfg, model_dir, args.gen_batch, args.gen_tokens, attn="sdpa"),
        "dynamic cache, hpcrl_sdpa": bench_rollout(cfg, model_dir, args.gen_batch, args.gen_tokens, static=False),
    }  # fmt: skip
    rows["HF generate (baseline)"] = {
        "tokens_per_s": rows["static cache + compiled, hpcrl_sdpa (default)"].pop("hf_generate_tokens_per_s")
    }
    base = rows["HF generate (baseline)"]["tokens_per_s"]
    print(
        f"\n{'rollout ' + f'{args.gen_batch} x (128 + {args.gen_tokens})':48s} {'tok/s':>9s} {'% roofline':>11s} {'x HF generate':>14s}"
    )
    for name, r in rows.items():
        r["pct_roofline"] = 100 * r["tokens_per_s"] / roof
        print(
            f"{name:48s} {r['tokens_per_s']:9.0f} {r['pct_roofline']:10.1f}% {r['tokens_per_s'] / base:14.2f}"
        )
    return {"rollout_shape": f"{args.gen_batch} x (128 prompt + {args.gen_tokens} new)",
            "roofline_tokens_per_s": roof, "rows": rows}  # fmt: skip


def train_part(cfg, model_dir: Path, args) -> dict:
    """fsdp-backend rows beside the HF + SDPA loop, one GRPO step of batch x seq tokens each."""
    from torch.nn.attention import SDPBackend

    flops = train_flops_per_token(cfg, args.seq)
    b, s = args.batch, args.seq
    out_dir = os.environ.get("OUT", tempfile.gettempdir())
    rows = {"HF + SDPA loop (baseline)": bench_train_baseline(model_dir, b, s)}
    torch.cuda.empty_cache()
    rows["fsdp, trainer.compile=false fused_logprob=false"] = bench_train_fsdp(
        cfg, model_dir, b, s, compile_layers=False, fused_logprob=False
    )
    rows["fsdp, trainer.compile=false"] = bench_train_fsdp(cfg, model_dir, b, s, compile_layers=False)
    rows["fsdp, trainer.fused_logprob=false"] = bench_train_fsdp(cfg, model_dir, b, s, fused_logprob=False)
    rows["fsdp, default (compiled layers, chunked log-prob head)"] = bench_train_fsdp(
        cfg, model_dir, b, s, profile=str(Path(out_dir, "profile_fsdp_default.txt"))
    )
    rows["fsdp, default + cuDNN attention first"] = bench_train_fsdp(
        cfg, model_dir, b, s, sdpa_backends=[SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])  # fmt: skip
    base = rows["HF + SDPA loop (baseline)"]["tokens_per_s"]
    print(f"\n{'train ' + f'{b}x{s}':50s} {'tok/s':>8s} {'MFU':>6s} {'peak GB':>8s} {'x HF':>6s}")
    for name, r in rows.items():
        r["mfu_datasheet"] = r["tokens_per_s"] * flops / DATASHEET_TFLOPS / 1e12
        print(f"{name:50s} {r['tokens_per_s']:8.0f} {100 * r['mfu_datasheet']:5.1f}% {r['peak_mem_gb']:8.1f} "
              f"{r['tokens_per_s'] / base:6.2f}")  # fmt: skip
        if "cuda_ms_by_kernel_family" in r:
            print("    CUDA ms by kernel family:", r["cuda_ms_by_kernel_family"])
    return {"train_shape": f"{b}x{s}", "flops_per_token": flops, "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--gen-batch", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=256)
    p.add_argument("--part", choices=["train", "rollout", "all"], default="all")
    args = p.parse_args()
    cfg = compose_config(["model=qwen2_1p5b", "cluster=h200", "cluster.slurm.account=x", "cluster.container.image=x",
                          f"trainer.micro_batch_size={args.batch}", "algo.kl_coef=0", "rollout=hf",
                          f"rollout.max_num_seqs={args.gen_batch}"])  # fmt: skip
    tflops, bandwidth = measure_peaks()
    results: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "measured_bf16_tflops": tflops, "measured_bandwidth_tb_s": bandwidth / 1e12}  # fmt: skip
    model_dir = make_model_dir(cfg)
    out = os.environ.get("OUT")
    for part, fn in (("train", lambda: train_part(cfg, model_dir, args)),
                     ("rollout", lambda: rollout_part(cfg, model_dir, args, bandwidth))):  # fmt: skip
        if args.part in (part, "all"):
            results[part] = fn()
            if out:  # after each part: a later part running out of time keeps the earlier figures
                Path(out, f"gpu_bench_{args.part}.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
