"""Issue 19 on one GPU: the colocated refit through CUDA IPC beside today's path, and one full
colocated GRPO step (vLLM engine and fsdp trainer on the same GPU: generate, rewards, sleep, train,
wake weights, refit, wake KV cache, generate again) with per-phase seconds and memory against the
plan's colocated phases.

    python bench/colocated_gpu.py [--model qwen2_1p5b --layers 28] [--prompts 64 --n 4 --prompt-len 128
                                   --gen 256] [--out results.json]

The trainer is this process (fsdp, world 1, on cuda:0); the engine is hpcrl's ``VLLMEngine`` (GPU
vLLM runs its worker in a child process, so the IPC path is the real one: this process packs a
bucket, the worker maps it). Refit rows: ``ipc`` (sync/packer.py buckets -> ``VLLMEngine.load_ipc``),
``safetensors`` (today's object-store path: the whole model as safetensors bytes through
``collective_rpc``). Memory: GPU used (all processes, from cudaMemGetInfo) at the end of each phase
and this process's peak allocation within it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def used_gb() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 1e9


class Phases:
    def __init__(self) -> None:
        self.rows: dict[str, dict[str, float]] = {}

    def run(self, name: str, fn):  # type: ignore[no-untyped-def]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        self.rows[name] = {
            "s": time.perf_counter() - start,
            "gpu_used_gb": used_gb(),
            "trainer_peak_gb": torch.cuda.max_memory_allocated() / 1e9,
        }
        print(f"{name:28s} {self.rows[name]['s']:8.3f} s  used {self.rows[name]['gpu_used_gb']:6.1f} GB  "
              f"trainer peak {self.rows[name]['trainer_peak_gb']:6.1f} GB", flush=True)  # fmt: skip
        return out


def refit_ipc(trainer, engine, layout) -> dict:  # type: ignore[no-untyped-def]
    from concurrent.futures import ThreadPoolExecutor

    from torch.multiprocessing.reductions import reduce_tensor

    from hpcrl.sync.packer import BucketPacker

    pool = ThreadPoolExecutor(1)  # as a Ray call is: the next bucket packs while the engine loads

    class Loading:
        def __init__(self, future) -> None:  # type: ignore[no-untyped-def]
            self.future = future

        def wait(self) -> None:
            self.future.result()

    def emit(buf, bucket):  # type: ignore[no-untyped-def]
        entries = [(m.name, m.shape, o) for m, o in bucket.entries]
        return Loading(pool.submit(engine.load_ipc, reduce_tensor(buf)[1], entries))

    packer = BucketPacker(layout.buckets(0), torch.bfloat16, torch.device("cuda"), emit)
    trainer.stream_weights(packer, torch.bfloat16)
    stats = packer.finish()
    engine.finish_refit()
    torch.cuda.ipc_collect()
    return {"pack_s": stats.pack_s, "load_s": stats.wait_s, "buckets": stats.buckets, "bytes": stats.bytes}


def main() -> int:
    from gpu_bench import make_model_dir

    from hpcrl.config.compose import compose_config
    from hpcrl.plan.planner import make_plan
    from hpcrl.rollout.base import SamplingSettings
    from hpcrl.rollout.vllm_engine import VLLMEngine
    from hpcrl.sync.broadcast import WeightLayout
    from hpcrl.trainer.batch import build_batch
    from hpcrl.trainer.fsdp import FSDPTrainer
    from hpcrl.trainer.process_group import free_port

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2_1p5b")
    p.add_argument("--layers", type=int, default=0, help="0: the catalog's")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen", type=int, default=256)
    p.add_argument("--share", type=float, default=0.5, help="rollout.gpu_memory_utilization")
    p.add_argument("--refits", type=int, default=5)
    p.add_argument("--skip-old", action="store_true", help="skip today's safetensors refit")
    p.add_argument("--steps", type=int, default=1, help="colocated steps; medians over steps 2..")
    p.add_argument("--model-dir", default="", help="a model directory of the shape (else random weights)")
    p.add_argument("--out", default="")
    args = p.parse_args()

    overrides = [f"model={args.model}", "trainer=fsdp", "rollout=vllm", "algo.kl_coef=0", "cluster=h200",
                 "cluster.slurm.account=x", "cluster.container.image=x", "rollout.sleep=true", "cluster.gpus_per_node=1",
                 f"rollout.gpu_memory_utilization={args.share}", "trainer.micro_batch_size=8",
                 f"rollout.max_new_tokens={args.gen}"]  # fmt: skip
    if args.layers:
        overrides.append(f"model.num_layers={args.layers}")
    cfg = compose_config(overrides)
    plan = make_plan(cfg)
    col = plan.memory.colocated
    result: dict = {"model": args.model, "layers": cfg.model.num_layers, "overrides": overrides,
                    "plan_gb": {"train": col.train, "refit": col.refit, "generate": col.generate} if col else {}}  # fmt: skip
    model_dir = Path(args.model_dir) if args.model_dir else make_model_dir(cfg)
    ph = Phases()
    trainer = ph.run(
        "trainer start", lambda: FSDPTrainer(model_dir, cfg, device="cuda", master=f"127.0.0.1:{free_port()}")
    )
    engine = ph.run("engine start", lambda: VLLMEngine(model_dir, cfg.rollout, seed=0, on_cpu=False,
                                                       max_model_len=args.prompt_len + args.gen + 8,
                                                       scratch=Path("/tmp/hpcrl-colocated")))  # fmt: skip
    metas = trainer.weight_metas()
    layout = WeightLayout.of([metas], "bfloat16", cfg.rollout.weight_sync_bucket_mb * 2**20 // 2)
    result["weights_gb"] = layout.numel * 2 / 1e9

    # -- refit: IPC (median of several) beside today's path ---------------------------------------------
    probe = [[5 + i, 17, 42, 99, 7 + i] for i in range(8)]
    greedy = SamplingSettings(n=1, temperature=0.0, top_p=1.0, max_tokens=16, seed=0)

    def answers():  # type: ignore[no-untyped-def]
        every, engine.logprob_every = engine.logprob_every, 1  # every probe's logprobs
        try:
            return [(g[0].token_ids, g[0].logprobs) for g in engine.generate(probe, greedy)]
        finally:
            engine.logprob_every = every

    def same(a, b) -> tuple[bool, float]:  # type: ignore[no-untyped-def]
        gap = max(abs(x - y) for p, q in zip(a, b, strict=True) for x, y in zip(p[1], q[1], strict=False))
        return [p[0] for p in a] == [q[0] for q in b], gap

    before, digest = answers(), engine.weights_digest()
    result["greedy_repeats"] = same(answers(), before)  # vLLM's own run-to-run determinism, no refit
    ipc = [ph.run(f"refit ipc #{i}", lambda: refit_ipc(trainer, engine, layout)) for i in range(args.refits)]
    times = [ph.rows[f"refit ipc #{i}"]["s"] for i in range(args.refits)]
    result["refit_ipc"] = {"median_s": statistics.median(times), "all_s": times, **ipc[-1]}
    # the same weights went in: the engine must hold the same bits, and give the same greedy tokens
    after = engine.weights_digest()
    result["refit_same_engine_bits"] = after == digest
    result["refit_changed_tensors"] = sorted(k for k in digest[0] if after[0].get(k) != digest[0][k])[:20]
    result["refit_same_greedy_tokens"], result["refit_max_logprob_diff"] = same(answers(), before)
    print("greedy repeats without a refit (tokens, max logprob gap):", result["greedy_repeats"])
    print("refit keeps the engine's bits:", result["refit_same_engine_bits"], result["refit_changed_tensors"])
    print("refit keeps greedy answers:", result["refit_same_greedy_tokens"], result["refit_max_logprob_diff"])
    if not args.skip_old:

        def old() -> None:
            engine.load_weights({k: v.to(torch.bfloat16) for k, v in trainer.export_weights().items()})

        ph.run("refit safetensors (today)", old)
        result["refit_safetensors_s"] = ph.rows["refit safetensors (today)"]["s"]

    # -- colocated GRPO steps (--steps; medians over steps 2.. when there are several) ----------------
    from hpcrl.algo.advantages import group_advantages
    from hpcrl.rewards.verifiers import exact_match  # math-verify is not on the device

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg.model.vocab_size, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.prompts)]  # fmt: skip
    settings = SamplingSettings(n=args.n, temperature=1.0, top_p=1.0, max_tokens=args.gen, seed=0)
    step = ["generate", "rewards", "sleep", "train step", "release cache", "wake weights", "refit ipc (step)",
            "release buckets", "wake kv cache"]  # fmt: skip
    per_step: list[dict[str, float]] = []
    for i in range(args.steps):
        groups = ph.run("generate", lambda: engine.generate(prompts, settings))
        tokens = sum(len(c.token_ids) for g in groups for c in g)
        result["generate_tok_s"] = tokens / ph.rows["generate"]["s"]
        rewards = ph.run(
            "rewards",
            lambda gs=groups: torch.tensor([[exact_match(c.text, "4").reward for c in g] for g in gs]),
        )
        jitter = torch.rand(rewards.shape, generator=gen) * 1e-3  # random text: all rewards equal
        adv = group_advantages(rewards + jitter)
        flat = [(prompts[j], c) for j, g in enumerate(groups) for c in g]
        batch = build_batch([p for p, _ in flat], [c.token_ids for _, c in flat], [c.logprobs for _, c in flat],
                            adv.flatten().tolist(), [1.0] * len(flat), pad_id=0)  # fmt: skip
        ph.run("sleep", engine.sleep)
        result["train_metrics"] = ph.run("train step", lambda b=batch: trainer.train_step(b, None))
        ph.run("release cache", torch.cuda.empty_cache)  # as Fleet.sync_weights has the trainers do
        ph.run("wake weights", lambda: engine.wake_up(["weights"]))
        result["step_refit"] = ph.run("refit ipc (step)", lambda: refit_ipc(trainer, engine, layout))
        ph.run("release buckets", torch.cuda.empty_cache)  # the refit's buffers, as Fleet.sync_weights
        ph.run("wake kv cache", lambda: engine.wake_up(["kv_cache"]))
        per_step.append({k: ph.rows[k]["s"] for k in step} | {"tokens": tokens})
        print(f"== step {i + 1}: {sum(per_step[-1][k] for k in step):.3f} s", flush=True)
    steady = per_step[1:] or per_step
    result["steps"] = per_step
    result["median_s"] = {k: statistics.median(r[k] for r in steady) for k in [*step, "tokens"]}
    result["phases"] = ph.rows
    result["step_s"] = sum(result["median_s"][k] for k in step)
    print(json.dumps({k: v for k, v in result.items() if k != "phases"}, indent=1, default=str), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
