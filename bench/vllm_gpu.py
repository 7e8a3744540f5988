"""GPU vLLM figures for issue 19 (items 2, 4, 6), all in one run on one GPU: rollout tok/s of hpcrl's
``VLLMEngine`` against the hf engine measured in the same run and the decode roofline; sleep/wake; a
colocated refit through CUDA IPC from another process beside today's safetensors-bytes path.

    python bench/vllm_gpu.py [--gen-batch 256 --gen-tokens 256] [--out results.json]

Rows, on a random Qwen2-1.5B-shaped checkpoint, 256 prompts x (128 + 256 new tokens):
- hf engine (static cache + compiled step): the baseline;
- VLLMEngine "old": the generate of before this change (``logprobs=0`` as a dict + ``Logprob`` per token,
  vLLM's incremental detokenizer), with and without the logprob;
- VLLMEngine new default (``rollout.logprobs=true``: flat logprobs, no per-token detokenize, one
  ``batch_decode`` per call), and ``rollout.logprobs=false``; the default once more as 32 prompts x n=8.
Then ``sleep()`` (freed bytes, seconds), ``wake_up(["weights"])``, an IPC refit of every weight from a
child process that owns the buffers (the trainer's side: packs the HF state dict into 1-D bf16 buckets
and shares them with ``reduce_tensor``), ``wake_up(["kv_cache"])``, and greedy tokens/logprobs after it
against before the sleep (level 2 discards the weights: equal output shows buffers and weights came
back). Then the refit repeated while awake (per-refit seconds) and today's path once (``load_weights``:
safetensors bytes through ``collective_rpc``).

Every part runs in try/except and the JSON is rewritten after each, so one failure keeps the rest.
The engine start runs under an alarm (``--start-timeout``): one first start on the H200 hung.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcrl.config.compose import compose_config
from hpcrl.rollout.base import Completion, SamplingSettings

OVERRIDES = ["model=qwen2_1p5b", "cluster=h200", "cluster.slurm.account=x", "cluster.container.image=x"]


class Alarm(Exception):
    pass


def _alarm(signum, frame):  # type: ignore[no-untyped-def]
    raise Alarm("timed out")


def pack_buckets(state: dict, bucket_bytes: int, device: str = "cuda") -> list[tuple[torch.Tensor, list]]:
    """The trainer's side: 1-D bf16 CUDA buffers of about ``bucket_bytes``, with (name, shape, offset)."""
    buckets: list[tuple[torch.Tensor, list]] = []
    group: list[tuple[str, torch.Tensor]] = []
    size = 0

    def flush() -> None:
        nonlocal group, size
        if not group:
            return
        entries, offset = [], 0
        for name, t in group:
            entries.append((name, tuple(t.shape), offset))
            offset += -(-t.numel() // 64) * 64  # 128-byte aligned starts
        buf = torch.empty(offset, dtype=next(iter(group))[1].dtype, device=device)
        for (_, t), (_, _, off) in zip(group, entries, strict=True):
            buf[off : off + t.numel()].copy_(t.reshape(-1))
        buckets.append((buf, entries))
        group, size = [], 0

    for name, t in state.items():
        if size and size + t.numel() * 2 > bucket_bytes:
            flush()
        group.append((name, t))
        size += t.numel() * 2
    flush()
    return buckets


def sender(model_dir: str, bucket_bytes: int, to_engine, from_engine) -> None:  # type: ignore[no-untyped-def]
    """Child process (the trainer on the same GPU): owns the buffers, shares them, waits for 'done'."""
    from safetensors.torch import load_file
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.set_device(0)
    state = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(f, device="cuda"))
    start = time.perf_counter()
    buckets = pack_buckets(state, bucket_bytes)
    torch.cuda.synchronize()
    pack_s = time.perf_counter() - start
    to_engine.put(
        {
            "pack_s": pack_s,
            "bytes": sum(b.numel() * 2 for b, _ in buckets),
            "buckets": [(reduce_tensor(b)[1], entries) for b, entries in buckets],
        }
    )
    from_engine.get()  # keep the buffers alive until the engine is done with them


def old_generate(engine, prompts, settings, logprobs: bool) -> list[list[Completion]]:  # type: ignore[no-untyped-def]
    """VLLMEngine.generate as it was before this change (the 'old settings' rows)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(n=settings.n, temperature=settings.temperature, top_p=settings.top_p,
                            max_tokens=settings.max_tokens, seed=settings.seed,
                            logprobs=0 if logprobs else None)  # fmt: skip
    outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    groups = []
    for out in outputs:
        group = []
        for c in out.outputs:
            ids = list(c.token_ids)
            steps = c.logprobs if logprobs else []
            lps = [
                float(step[tok].logprob) if step else 0.0 for step, tok in zip(steps, ids, strict=logprobs)
            ]
            group.append(Completion(ids, lps, c.text, truncated=c.finish_reason == "length"))
        groups.append(group)
    return groups


def tok_per_s(fn, iters: int = 2) -> dict:  # type: ignore[no-untyped-def]
    fn()  # warm-up
    times, tokens = [], 0
    for _ in range(iters):
        start = time.perf_counter()
        groups = fn()
        times.append(time.perf_counter() - start)
        tokens = sum(len(c.token_ids) for g in groups for c in g)
    return {"tokens_per_s": tokens / (sum(times) / len(times)), "tokens": tokens, "seconds": times}


def free_bytes() -> int:
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gen-batch", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=256)
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--refits", type=int, default=5)
    p.add_argument("--start-timeout", type=int, default=420)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-legacy-refit", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    signal.signal(signal.SIGALRM, _alarm)
    out_path = Path(args.out) if args.out else None
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "errors": {}}

    def save() -> None:
        if out_path:
            out_path.write_text(json.dumps(res, indent=1, default=str))

    def part(name: str, fn) -> object:  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            value = fn()
        except Exception as e:  # one failure must not lose the rest
            res["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"
            print(f"[{name}] FAILED: {type(e).__name__}: {e}", flush=True)
            value = None
        print(f"[{name}] {time.perf_counter() - start:.1f} s", flush=True)
        save()
        return value

    from gpu_bench import bench_rollout, make_model_dir, measure_peaks, rollout_roofline

    B, T = args.gen_batch, args.gen_tokens
    cfg_hf = compose_config([*OVERRIDES, "rollout=hf", f"rollout.max_num_seqs={B}"])
    _, bandwidth = measure_peaks()
    roof = rollout_roofline(cfg_hf, B, T, bandwidth)
    res.update(measured_bandwidth_tb_s=bandwidth / 1e12, roofline_tokens_per_s=roof,
               shape=f"{B} x (128 prompt + {T} new)")  # fmt: skip
    with torch.device("cuda"):  # random init of 1.5B parameters: on the GPU
        model_dir = make_model_dir(cfg_hf)
    torch.cuda.empty_cache()
    rows: dict = {}
    res["rows"] = rows
    if not args.skip_hf:
        hf = part("hf engine", lambda: bench_rollout(cfg_hf, model_dir, B, T))
        if hf:
            rows["hf engine (static cache + compiled; baseline)"] = hf

    from hpcrl.rollout.vllm_engine import VLLMEngine  # imports no vllm: the engine sets its env first

    cfg = compose_config([*OVERRIDES, "rollout=vllm", f"rollout.max_num_seqs={B}", "rollout.sleep=true",
                          "rollout.load_format=auto"])  # fmt: skip

    def start():  # type: ignore[no-untyped-def]
        signal.alarm(args.start_timeout)
        try:
            t = time.perf_counter()
            eng = VLLMEngine(model_dir, cfg.rollout, seed=0, max_model_len=128 + T + 16, on_cpu=False,
                             scratch=Path(tempfile.mkdtemp()))  # fmt: skip
            res["engine_start_s"] = time.perf_counter() - t
            return eng
        finally:
            signal.alarm(0)

    engine = part("vllm engine start", start)
    if engine is None:
        return report(res, roof)
    import vllm

    res["vllm"] = vllm.__version__
    res["env"] = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}

    def engine_config() -> dict:
        vc = engine.llm.llm_engine.vllm_config
        sc, cc = vc.scheduler_config, vc.compilation_config
        return {"async_scheduling": sc.async_scheduling, "max_num_batched_tokens": sc.max_num_batched_tokens,
                "max_num_seqs": sc.max_num_seqs, "enable_prefix_caching": vc.cache_config.enable_prefix_caching,
                "cudagraph_capture_sizes": getattr(cc, "cudagraph_capture_sizes", None),
                "logprobs_mode": getattr(vc.model_config, "logprobs_mode", None)}  # fmt: skip

    res["engine_config"] = part("engine config", engine_config)

    def sleep_source() -> dict:
        from vllm.v1.worker.gpu_worker import Worker

        src = inspect.getsource(Worker.sleep) + inspect.getsource(Worker.wake_up)
        return {"level2_saves_buffers": "named_buffers" in src}

    res["sleep_source"] = part("sleep source", sleep_source)
    prompts = [torch.randint(3, 1000, (128,)).tolist() for _ in range(B)]
    s = SamplingSettings(1, 1.0, 1.0, T, 0)
    variants = {
        "vLLM old: logprobs=0 dicts + detokenize": lambda: old_generate(engine, prompts, s, True),
        "vLLM old, no logprobs: detokenize": lambda: old_generate(engine, prompts, s, False),
        "VLLMEngine default: flat logprobs, no detokenize": lambda: engine.generate(prompts, s),
    }
    for name, fn in variants.items():
        r = part(name, lambda fn=fn: tok_per_s(fn))
        if r:
            rows[name] = r

    def logprobs_off():  # type: ignore[no-untyped-def]
        engine.logprobs = False
        try:
            return tok_per_s(lambda: engine.generate(prompts, s))
        finally:
            engine.logprobs = True

    if r := part("logprobs off", logprobs_off):
        rows["VLLMEngine rollout.logprobs=false"] = r
    s8 = SamplingSettings(8, 1.0, 1.0, T, 0)
    if r := part("n=8", lambda: tok_per_s(lambda: engine.generate(prompts[: B // 8], s8))):
        rows[f"VLLMEngine default, {B // 8} prompts x n=8"] = r

    def same_answers() -> dict:
        old = old_generate(engine, prompts[:16], s, True)
        new = engine.generate(prompts[:16], s)
        same = all(
            a.token_ids == b.token_ids
            for ga, gb in zip(old, new, strict=True)
            for a, b in zip(ga, gb, strict=True)
        )
        gap = max(abs(x - y) for ga, gb in zip(old, new, strict=True) for a, b in zip(ga, gb, strict=True)
                  for x, y in zip(a.logprobs, b.logprobs, strict=True))  # fmt: skip
        return {"same_tokens": same, "max_logprob_diff": gap}

    res["old_vs_new"] = part("old vs new answers", same_answers)
    greedy = SamplingSettings(1, 0.0, 1.0, 32, 0)
    before = part("greedy before sleep", lambda: engine.generate(prompts[:8], greedy))
    sleep_row: dict = {}
    res["sleep"] = sleep_row

    def do_sleep() -> None:
        f0 = free_bytes()
        t = time.perf_counter()
        engine.sleep()
        sleep_row["sleep_s"] = time.perf_counter() - t
        f1 = free_bytes()
        sleep_row["freed_gb"] = (f1 - f0) / 1e9
        t = time.perf_counter()
        engine.wake_up(["weights"])
        sleep_row["wake_weights_s"] = time.perf_counter() - t
        sleep_row["free_gb_asleep"] = f1 / 1e9

    part("sleep", do_sleep)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    to_engine, from_engine = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=sender, args=(str(model_dir), args.bucket_mb << 20, to_engine, from_engine))
    child.start()
    ipc: dict = {}
    res["ipc"] = ipc

    def refit(msg) -> float:  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        for handle, entries in msg["buckets"]:
            engine.load_ipc(handle, entries)
        engine.finish_refit()
        return time.perf_counter() - t

    try:
        msg = to_engine.get(timeout=300)
        ipc.update(pack_s=msg["pack_s"], gb=msg["bytes"] / 1e9, buckets=len(msg["buckets"]))
        ipc["first_refit_s"] = part("ipc refit after sleep", lambda: refit(msg))

        def wake_kv() -> None:
            t = time.perf_counter()
            engine.wake_up(["kv_cache"])
            sleep_row["wake_kv_s"] = time.perf_counter() - t

        part("wake kv", wake_kv)

        def check() -> dict:
            assert before is not None
            after = engine.generate(prompts[:8], greedy)
            same = all(a[0].token_ids == b[0].token_ids for a, b in zip(before, after, strict=True))
            gap = max(abs(x - y) for a, b in zip(before, after, strict=True)
                      for x, y in zip(a[0].logprobs, b[0].logprobs, strict=True))  # fmt: skip
            return {"same_greedy_tokens": same, "max_logprob_diff": gap}

        ipc["after_sleep_refit"] = part("greedy after sleep + IPC refit", check)
        ipc["refit_s"] = part("ipc refits", lambda: [refit(msg) for _ in range(args.refits)])
        ipc["after_refits"] = part("greedy after refits", check)
    except Exception as e:
        res["errors"]["ipc"] = f"{type(e).__name__}: {e}"
    finally:
        from_engine.put("done")
        child.join(timeout=30)
        save()
    if not args.skip_legacy_refit:

        def legacy() -> float:
            from safetensors.torch import load_file

            state = {}
            for f in sorted(Path(model_dir).glob("*.safetensors")):
                state.update(load_file(f))
            t = time.perf_counter()
            engine.load_weights(state)
            return time.perf_counter() - t

        res["legacy_refit_s"] = part("legacy refit (safetensors bytes)", legacy)
    return report(res, roof)


def report(res: dict, roof: float) -> int:
    rows = res.get("rows", {})
    base = next((r["tokens_per_s"] for k, r in rows.items() if k.startswith("hf engine")), None)
    print(f"\n{'rollout ' + res.get('shape', ''):52s} {'tok/s':>9s} {'% roofline':>11s} {'x hf':>6s}")
    for name, r in rows.items():
        r["pct_roofline"] = 100 * r["tokens_per_s"] / roof
        x = f"{r['tokens_per_s'] / base:6.2f}" if base else "     -"
        print(f"{name:52s} {r['tokens_per_s']:9.0f} {r['pct_roofline']:10.1f}% {x}")
    for key in (
        "engine_start_s",
        "engine_config",
        "sleep_source",
        "old_vs_new",
        "sleep",
        "ipc",
        "legacy_refit_s",
    ):
        if key in res:
            print(f"{key}: {json.dumps(res[key], default=str)}")
    for name, err in res.get("errors", {}).items():
        print(f"ERROR {name}: {err.splitlines()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
