"""Sequence packing against padded micro-batches (issue 36 item 1): the fsdp train step on one GPU at a
DAPO-like length distribution, tokens per second of real tokens, both rows in the same run.

    python bench/packing_gpu.py [--model qwen2_1p5b[,smollm2_135m]] [--layers 0] [--seqs 256] [--max-new 3840]
        [--mbs 4|plan] [--steps 3] [--rows padded,packed] [--job dapo|smollm2] [--trainer fsdp|megatron]
        [--profile] [--out FILE]

The batch: ``--seqs`` sequences, prompts 100-300 tokens, completions long-tailed as DAPO's are (a
log-normal around a quarter of the limit, a tenth of them cut at ``--max-new``), in rollout order
(groups of similar prompts do not sort by length). ``padded`` is hpcrl's step without packing:
``--mbs`` rows a micro-batch, each padded to its longest row. ``packed`` is ``trainer.packing=true``
with its default budget, ``--mbs`` x the longest possible sequence (the padded micro-batch's memory).
``--mbs plan``: the planner's micro-batch (``trainer.micro_batch_size=null``, the most rows whose memory fits
this GPU) and the budget it derives from it. Several ``--model``s: each shape's rows, one table at the end
(real tokens / s and the ratio to that shape's padded row); the JSON then holds them under ``shapes``.
A row ``padded:N`` or ``packed:N`` uses N rows a micro-batch instead of ``--mbs``; ``+ac`` after it turns on
activation checkpointing. A row that runs out of memory is recorded as such; ``best`` names the fastest row
and its overrides. ``--job smollm2`` is the SmolLM2 chain_sum recipe's batch instead: prompts 180-224 tokens
(the few-shot chat), completions 8-64. ``--trainer megatron``: the megatron backend's step instead (one
rank, its local spec; packed rows attend by their bounds, ``hpcrl/trainer/megatron/attention.py``).
Each row: a first step (compiles) and ``--steps`` timed steps; real tokens / s, the padded tokens the
forward ran, peak memory. Random weights; the numbers are speeds. ``--profile``: one more step of each
row under torch.profiler: the GPU's busy time against the step's wall time (a step far longer than its
kernels waits on the host: launches, Python, synchronizations) and the ops that take the most of each.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import make_model_dir, released

from hpcrl.config.compose import compose_config
from hpcrl.trainer import make_trainer
from hpcrl.trainer.batch import build_batch
from hpcrl.trainer.process_group import free_port

PROMPT_MAX = 300
GPU = torch.cuda.is_available()
"""Without one (a dry run here: ``--model tiny --seqs 16 --max-new 64``) the rows run on the CPU."""


def sync() -> None:
    if GPU:
        torch.cuda.synchronize()


def lengths(n: int, max_new: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, completion) lengths: prompts uniform in 100-300; completions log-normal with median
    max_new / 4, clipped to [16, max_new] (the clip puts about a tenth at the limit)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(100, PROMPT_MAX + 1, (n,), generator=gen)
    comps = (torch.randn(n, generator=gen) * 0.8).exp() * (max_new / 4)
    comps = comps.clamp(16, max_new).long()
    return list(zip(prompts.tolist(), comps.tolist(), strict=True))


def smollm2_lengths(n: int, max_new: int, seed: int = 0) -> list[tuple[int, int]]:
    """The SmolLM2 chain_sum recipe's shape: prompts 180-224 tokens, completions uniform in 8..max_new."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(180, 225, (n,), generator=gen)
    comps = torch.randint(8, max_new + 1, (n,), generator=gen)
    return list(zip(prompts.tolist(), comps.tolist(), strict=True))


def make_batch(shape: list[tuple[int, int]], vocab: int):
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (p,), generator=gen).tolist() for p, _ in shape]
    comps = [torch.randint(0, vocab, (c,), generator=gen).tolist() for _, c in shape]
    adv = [1.0 if i % 2 else -1.0 for i in range(len(shape))]
    return build_batch(prompts, comps, [[-1.0] * len(c) for c in comps], adv, [1.0] * len(shape), 0)


def profiled(trainer, batch) -> dict:
    """One step under torch.profiler: kernel time against wall time, and the top ops of each side."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if GPU else [])
    with profile(activities=acts) as prof:
        start = time.perf_counter()
        trainer.train_step(batch, None)
        sync()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    on_gpu = [e for e in prof.events() if e.device_type.name == "CUDA"]  # kernels and copies
    busy = sum(e.time_range.elapsed_us() for e in on_gpu) / 1e6
    kernels = len(on_gpu)
    print(events.table(sort_by="self_cuda_time_total" if GPU else "self_cpu_time_total", row_limit=12))
    print(events.table(sort_by="cpu_time_total", row_limit=12))
    return {"wall_s": wall, "gpu_busy_s": busy, "gpu_busy_fraction": busy / wall, "kernels": kernels}


@released
def row(cfg, model_dir: Path, batch, steps: int, profile: bool = False) -> dict:
    device = "cuda" if GPU else "cpu"
    trainer = make_trainer(model_dir, cfg, 0, 1, f"127.0.0.1:{free_port()}", device)
    if GPU:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train_step(batch, None)
    sync()
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step(batch, None)
        sync()
        times.append(time.perf_counter() - start)
    real = int(batch.attention_mask.sum())
    lens = batch.attention_mask.sum(1)
    if cfg.trainer.packing:
        groups = trainer.step.cut(lens)
        ran = sum(int(lens[g].sum()) for g in groups)
    else:
        groups = list(torch.arange(len(lens)).split(cfg.trainer.micro_batch_size))
        ran = sum(len(g) * int(lens[g].max()) for g in groups)
    step = sorted(times)[len(times) // 2]
    prof = {"profile": profiled(trainer, batch)} if profile else {}
    return prof | {
        "step_s": step,
        "first_step_s": first,
        "real_tokens": real,
        "forward_tokens": ran,
        "micro_batches": len(groups),
        "recompute": cfg.trainer.activation_checkpointing,  # megatron's default: on; fsdp's: off
        "tokens_per_s": real / step,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if GPU else None,
    }


def row_overrides(name: str) -> list[str]:
    """A row's settings: ``padded`` or ``packed``, ``:N`` rows a micro-batch, ``+ac`` activation checkpointing."""
    name, _, flags = name.partition("+")
    kind, _, mbs = name.partition(":")
    out = [f"trainer.packing={str(kind == 'packed').lower()}"]
    out += [f"trainer.micro_batch_size={mbs}"] if mbs else []
    return out + (["trainer.activation_checkpointing=true"] if flags == "ac" else [])


def planned(common: list[str], seqs: int) -> tuple[int, int]:
    """The planner's padded micro-batch (``trainer.micro_batch_size=null``: the most rows whose memory fits
    this GPU) and the packing budget it derives from it, for a step of ``seqs`` sequences."""
    from hpcrl.plan.planner import make_plan

    groups = 8 if seqs % 8 == 0 else 1  # num_generations: the planner's rows a step are prompts x this
    cfg = compose_config(
        [*common, "trainer.micro_batch_size=null", "trainer.packing=true", "algo.num_generations=" + str(groups),
         f"algo.num_prompts_per_step={seqs // groups}"]
    )  # fmt: skip
    trainer = make_plan(cfg).cfg.trainer
    assert trainer.micro_batch_size is not None and trainer.micro_batch_tokens is not None
    return trainer.micro_batch_size, trainer.micro_batch_tokens


def shape_rows(args: argparse.Namespace, model_name: str) -> dict:
    """Every row of one model shape; the planner's micro-batch and budget where ``--mbs plan``."""
    model = [f"model={model_name}"] + ([f"model.num_layers={args.layers}"] if args.layers else [])
    base = compose_config(model)
    model_dir = args.model_dir
    if model_dir is None:
        with torch.device("cuda" if GPU else "cpu"):  # billions of random weights: on the GPU in seconds
            model_dir = make_model_dir(base)
    common = [
        *model,
        f"trainer={args.trainer}",
        f"model.hf_id={model_dir}",
        "algo.kl_coef=0",
        "algo.num_minibatches=1",
        f"data.max_prompt_tokens={PROMPT_MAX}",
        f"rollout.max_new_tokens={args.max_new}",
        *args.set,
    ]
    out: dict = {}
    if args.mbs == "plan":
        mbs, budget = planned(common, args.seqs)
        common.append(f"trainer.micro_batch_size={mbs}")
        out["plan"] = {"micro_batch_size": mbs, "micro_batch_tokens": budget}
        print(f"{model_name}: planner micro_batch_size={mbs} micro_batch_tokens={budget}", flush=True)
    else:
        common.append(f"trainer.micro_batch_size={args.mbs}")
        budget = None
    shape = (smollm2_lengths if args.job == "smollm2" else lengths)(args.seqs, args.max_new)
    batch = make_batch(shape, min(base.model.vocab_size, 32000))
    out["lengths"] = {
        "sequences": len(shape),
        "mean_completion": sum(c for _, c in shape) / len(shape),
        "at_limit": sum(c == args.max_new for _, c in shape),
    }
    print(f"batch: {out['lengths']}", flush=True)
    for name in args.rows.split(","):
        extra = row_overrides(name)
        if budget is not None and name.startswith("packed") and ":" not in name:
            extra.append(f"trainer.micro_batch_tokens={budget}")  # the planner's (the same as the default)
        cfg = compose_config([*common, *extra])
        try:
            out[name] = row(cfg, model_dir, batch, args.steps, args.profile)
        except torch.OutOfMemoryError as exc:  # a row too large for this GPU: said, and the others still run
            out[name] = {"error": f"out of memory: {str(exc)[:200]}"}
        print(f"{name}: {json.dumps(out[name])}", flush=True)
    timed = {k: v for k, v in out.items() if isinstance(v, dict) and "tokens_per_s" in v}
    if timed:
        best = max(timed, key=lambda k: timed[k]["tokens_per_s"])
        out["best"] = {"row": best, "overrides": row_overrides(best)}
        print(f"best: {best} {' '.join(out['best']['overrides'])}", flush=True)
    if "tokens_per_s" in out.get("padded", {}) and "tokens_per_s" in out.get("packed", {}):
        out["packed_over_padded"] = out["packed"]["tokens_per_s"] / out["padded"]["tokens_per_s"]
        print(f"packed / padded tokens/s: {out['packed_over_padded']:.2f}x", flush=True)
    return out


def table(shapes: dict) -> str:
    """One line a model and row: step, real tokens / s, the ratio to that model's padded row, peak memory."""
    lines = ["| model | row | micro-batches | tokens the forward ran | step | real tokens / s | vs padded | peak |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for model, out in shapes.items():
        padded = out.get("padded", {}).get("tokens_per_s")
        for name, r in out.items():
            if not isinstance(r, dict) or name in ("plan", "lengths", "best"):
                continue
            if "tokens_per_s" not in r:
                lines.append(f"| {model} | {name} | - | - | {r.get('error', '?')[:40]} | - | - | - |")
                continue
            ratio = f"{r['tokens_per_s'] / padded:.2f}x" if padded else "-"
            peak = f"{r['peak_mem_gb']:.1f} GB" if r["peak_mem_gb"] is not None else "-"
            lines.append(
                f"| {model} | {name} | {r['micro_batches']} | {r['forward_tokens']:,} | {r['step_s']:.2f} s "
                f"| {r['tokens_per_s']:,.0f} | {ratio} | {peak} |"
            )
    return "\n".join(lines)


def check_kernel(window: int | None = None) -> dict:
    """The packed attention (hpcrl/trainer/varlen.py, both backends') against SDPA under the dense
    block-causal mask, in this torch on this device: which path ran (``varlen_attn`` needs CUDA and half
    precision), the largest difference of outputs and of input gradients (bf16: ~1e-2 is agreement, a
    leak across sequences is ~1), and each one's forward + backward time (the fastest of 5). ``window``:
    a sliding-window layer's (Gemma 3 1B: 512 keys), the dense mask windowed too (transformers' mask)."""
    from hpcrl.trainer.context_parallel import window_mask
    from hpcrl.trainer.packing import Packed
    from hpcrl.trainer.varlen import _varlen, packed_attention, packed_sdpa

    device, dtype = ("cuda", torch.bfloat16) if GPU else ("cpu", torch.float32)
    lengths, heads, kv, dim = [300, 17, 1200, 64, 2515], 12, 2, 128
    gen = torch.Generator().manual_seed(0)
    n = sum(lengths)
    q, k, v = (
        torch.randn(1, h, n, dim, generator=gen).to(device, dtype).requires_grad_() for h in (heads, kv, kv)
    )
    positions = torch.cat([torch.arange(m) for m in lengths])[None].to(device)
    layer = argparse.Namespace(num_key_value_groups=heads // kv, is_causal=True, training=True)
    with packed_attention(positions):
        out, _ = packed_sdpa(layer, q, k, v, None, scaling=dim**-0.5, sliding_window=window)
    got = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    allowed = ~Packed(positions, positions, positions, [], []).attention_mask()[0]
    if window is not None:
        allowed = allowed & window_mask(n, window, allowed.device)
    rk, rv = (t.repeat_interleave(heads // kv, 1) for t in (k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    want_out = sdpa(q, rk, rv, attn_mask=allowed).transpose(1, 2)
    want = torch.autograd.grad(want_out.float().square().sum(), (q, k, v))
    sig = _varlen()

    def packed() -> None:
        with packed_attention(positions):
            attn = packed_sdpa(layer, q, k, v, None, scaling=dim**-0.5, sliding_window=window)[0]
            torch.autograd.grad(attn.sum(), (q, k, v))

    def masked() -> None:
        torch.autograd.grad(sdpa(q, rk, rv, attn_mask=allowed).sum(), (q, k, v))

    result = {
        "varlen_attn": None if sig is None else str(sig),
        "window": window,
        "path": "varlen_attn"
        if GPU and sig is not None and (window is None or "window_size" in sig.parameters)
        else "sdpa per sequence",
        "out_max_diff": float((out - want_out).detach().abs().max()),
        "grad_max_diff": max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True)),
        "tokens": n,
        "packed_fwd_bwd_ms": fastest(packed) * 1e3,
        "masked_fwd_bwd_ms": fastest(masked) * 1e3,
    }
    print(f"kernel check: {json.dumps(result)}", flush=True)
    return result


def fastest(fn, reps: int = 5) -> float:
    """The fastest of ``reps`` timed calls after one untimed (on a shared CPU the minimum is the figure
    least disturbed by other processes)."""
    fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2_1p5b", help="one model config or several, comma-separated")
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--model-dir", type=Path)
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--max-new", type=int, default=3840)
    p.add_argument("--mbs", default="4", help="rows a padded micro-batch, or plan: the planner's")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", default="padded,packed")
    p.add_argument("--job", choices=["dapo", "smollm2"], default="dapo")
    p.add_argument(
        "--trainer", choices=["fsdp", "megatron"], default="fsdp", help="the backend whose step runs"
    )
    p.add_argument("--profile", action="store_true", help="one more step of each row under torch.profiler")
    p.add_argument("--set", action="append", default=[], help="extra overrides for every row")
    p.add_argument("--check-kernel", action="store_true", help="first: the packed attention against the mask")
    p.add_argument(
        "--kernel-window", type=int, help="--check-kernel on a sliding-window layer of this many keys"
    )
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    models = args.model.split(",")
    out: dict = {
        "gpu": torch.cuda.get_device_name() if GPU else "cpu",
        "torch": torch.__version__,
        "args": vars(args) | {"model_dir": None, "out": None},
    }
    if args.check_kernel:
        out["kernel_check"] = check_kernel(args.kernel_window)
    shapes = {m: shape_rows(args, m) for m in models}
    # one model: its rows at the top level, as the session 21-23 tasks read them (train135's best)
    out |= shapes[models[0]] if len(models) == 1 else {"shapes": shapes}
    print(table(shapes), flush=True)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
