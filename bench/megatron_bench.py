"""Issue 5: the megatron backend on one GPU beside the fsdp backend, in the same run, on the
Qwen2-1.5B shape (or ``--model gemma3_1b``; random weights): tokens/s, MFU and peak memory of one
GRPO train step.

    python bench/megatron_bench.py [--model qwen2_1p5b --seq 2048 --batches 2,8] > results

Rows: megatron with hpcrl's SDPA core attention (the default without Transformer Engine), megatron
with Megatron's own local spec (unfused attention: the reference that ran out of memory at 8x2048),
the fsdp backend, and a plain HF + SDPA loop as the common baseline. MFU = tokens/s x (6N + 12 L h s)
/ 989 TFLOP/s. Activation recompute is off for every row (the 1.5B shape fits without it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_bench import (
    DATASHEET_TFLOPS,
    MODEL_OVERRIDES,
    bench_train_baseline,
    make_model_dir,
    portable,
    timed,
    train_flops_per_token,
)

from hpcrl.config.compose import compose_config
from hpcrl.trainer import make_trainer
from hpcrl.trainer.batch import build_batch
from hpcrl.trainer.process_group import free_port


def grpo_batch(batch: int, seq: int):
    half = seq // 2
    prompts = [torch.randint(0, 1000, (half,)).tolist() for _ in range(batch)]
    comps = [torch.randint(0, 1000, (seq - half,)).tolist() for _ in range(batch)]
    adv = ([1.0, -1.0] * batch)[:batch]
    return build_batch(prompts, comps, [[-1.0] * len(c) for c in comps], adv, [1.0] * batch, 0)


def bench_backend(backend: str, model_dir: Path, batch: int, seq: int, local_spec: bool = False,
                  overrides: tuple[str, ...] = (), model: str = "qwen2_1p5b", window_kernel: str = "flex",
                  experts_kernel: str = "grouped") -> dict:  # fmt: skip
    cfg = compose_config([f"model={model}", *MODEL_OVERRIDES, f"trainer={backend}", f"trainer.micro_batch_size={batch}",
                          "trainer.activation_checkpointing=false", "algo.kl_coef=0", *overrides])  # fmt: skip
    if backend == "megatron":
        from hpcrl.trainer.megatron import attention, spec

        attention.WINDOW_KERNEL = window_kernel
        from hpcrl.trainer.megatron import experts

        experts.KERNEL = experts_kernel

        if local_spec:  # Megatron's own unfused attention instead of hpcrl's SDPA slot
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

            spec.layer_spec = lambda config, fam: get_gpt_layer_local_spec(normalization="RMSNorm")  # type: ignore[assignment]
            import hpcrl.trainer.megatron.model as mm  # builds the GPTModel from the spec

            mm.layer_spec = spec.layer_spec
    trainer = make_trainer(model_dir, cfg, 0, 1, f"127.0.0.1:{free_port()}", "cuda")
    b = grpo_batch(batch, seq)
    torch.cuda.reset_peak_memory_stats()
    try:
        t = timed(lambda: trainer.train_step(b, None), 2, 5)
    except torch.OutOfMemoryError as exc:
        return {"error": f"out of memory: {str(exc).splitlines()[0]}"}
    peak = torch.cuda.max_memory_allocated() / 1e9
    return {"tokens_per_s": batch * seq / t, "peak_mem_gb": peak}


def run_isolated(name: str, args: list[str]) -> dict:
    """One configuration per process: Megatron's parallel state and the fsdp process group are global."""
    import subprocess

    done = subprocess.run([sys.executable, __file__, "--one", *args], capture_output=True, text=True)
    for line in done.stdout.splitlines()[::-1]:
        if line.startswith("{"):
            return json.loads(line)
    lines = portable(done.stderr).strip().splitlines()
    errors = [
        line for line in lines if "Error" in line and not line.startswith(" ")
    ]  # the exception, not NCCL's farewell
    return {
        "error": f"{name} failed: {(errors or lines or [str(done.returncode)])[-1]}",
        "stderr_tail": lines[-40:],
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2_1p5b", help="catalog model whose shape is benchmarked")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batches", default="2,8")
    p.add_argument("--one", nargs=4, metavar=("BACKEND", "MODEL_DIR", "BATCH", "LOCAL_SPEC"))
    p.add_argument("--override", action="append", default=[], help="config override for --one")
    p.add_argument("--window-kernel", default="flex", help="sliding-window layers: flex or sdpa (--one)")
    p.add_argument("--experts-kernel", default="grouped", help="MoE experts: grouped or sequential (--one)")
    p.add_argument("--rows", default="", help="comma-separated row names to run (default: all)")
    args = p.parse_args()
    if args.one:
        backend, model_dir, batch, local = args.one
        print(json.dumps(bench_backend(backend, Path(model_dir), int(batch), args.seq, local == "1",
                                       tuple(args.override), args.model, args.window_kernel, args.experts_kernel)))  # fmt: skip
        return 0
    cfg = compose_config([f"model={args.model}", *MODEL_OVERRIDES])
    model_dir = make_model_dir(cfg)
    flops = train_flops_per_token(cfg, args.seq)
    rows: dict[str, dict] = {}
    for batch in (int(b) for b in args.batches.split(",")):
        shape = f"{batch}x{args.seq}"
        rows[f"hf_sdpa_baseline {shape}"] = bench_train_baseline(model_dir, batch, args.seq)
        torch.cuda.empty_cache()
        for name, cmd in ((f"megatron_sdpa {shape}", ["megatron", str(model_dir), str(batch), "0"]),
                          (f"megatron_sdpa_logits_path {shape}", ["megatron", str(model_dir), str(batch), "0",
                                                                  "--override", "trainer.fused_logprob=false"]),
                          (f"megatron_sdpa_compiled {shape}", ["megatron", str(model_dir), str(batch), "0",
                                                               "--override", "trainer.compile=true"]),
                          (f"megatron_window_sdpa {shape}", ["megatron", str(model_dir), str(batch), "0",
                                                             "--window-kernel", "sdpa"]),
                          (f"megatron_sequential_experts {shape}", ["megatron", str(model_dir), str(batch), "0",
                                                                    "--experts-kernel", "sequential"]),
                          (f"megatron_local_spec {shape}", ["megatron", str(model_dir), str(batch), "1"]),
                          (f"fsdp {shape}", ["fsdp", str(model_dir), str(batch), "0"])):  # fmt: skip
            if not args.rows or name.split()[0] in args.rows.split(","):
                rows[name] = run_isolated(name, [*cmd, "--seq", str(args.seq), "--model", args.model])
    for row in rows.values():
        if "tokens_per_s" in row:
            row["mfu_datasheet"] = row["tokens_per_s"] * flops / DATASHEET_TFLOPS / 1e12
    from importlib.metadata import PackageNotFoundError, version

    try:
        megatron_version = version("megatron-core")
    except PackageNotFoundError:  # the rows then hold the import error
        megatron_version = "not installed"
    results = {"model": args.model, "model_overrides": MODEL_OVERRIDES, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "megatron_core": megatron_version, "flops_per_token": flops, "rows": rows}  # fmt: skip
    print(json.dumps(results, indent=1))
    print(f"\n{'row':36s} {'tok/s':>9s} {'MFU':>6s} {'peak GB':>8s} {'x HF':>6s}")
    for name, row in rows.items():
        base = rows.get(f"hf_sdpa_baseline {name.split()[-1]}", {}).get("tokens_per_s")
        if "tokens_per_s" not in row:
            print(f"{name:36s} {row.get('error', '?')[:80]}")
            continue
        ratio = row["tokens_per_s"] / base if base else float("nan")
        print(
            f"{name:36s} {row['tokens_per_s']:9.0f} {100 * row['mfu_datasheet']:5.1f}% {row['peak_mem_gb']:8.1f} {ratio:6.2f}"
        )
    out = os.environ.get("OUT")
    if out:
        Path(out, f"megatron_bench_{args.model}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
