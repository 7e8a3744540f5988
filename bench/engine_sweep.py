"""Issue 33 item 5: which rollout engine, how many per GPU and which ``max_num_seqs`` give the most
tokens per second on this GPU, at one model shape per call (random weights: every completion runs to
``--gen`` tokens, so the rows generate the same tokens).

    python bench/engine_sweep.py --model qwen2_1p5b --model-dir DIR [--layers 16] [--prompts 512
        --prompt-len 192 --gen 256 --seqs 64,128,256,512] [--out sweep.json] [--deadline-s 540]

Rows, all on ``--prompts`` prompts of ``--prompt-len`` random token ids, one completion each:
- ``hf``: hpcrl's hf engine (static KV cache, compiled decode step), ``max_num_seqs`` 64 and 256 (it
  generates in chunks of that many);
- ``vllm, S at once``: one ``VLLMEngine`` (block 64, log-probs for every 8th prompt: the plan's defaults
  without an IS correction), fed S prompts per call until all are done. With every completion of equal
  length, waves of S are what ``max_num_seqs=S`` makes of one call (one engine start serves all S);
- ``2 vllm engines``: a second engine on the GPU, each given half the prompts at once, in a thread each;
- ``--procs N``: N engines in N processes (as N rollout actors would be), each given 1/N of the prompts at
  once, started together after each one's warm-up; tok/s = all tokens / (last end - first start).
Each row: one warm-up call, then ``--iters`` timed; tok/s = generated tokens / seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(fn, iters: int) -> dict:  # type: ignore[no-untyped-def]
    fn()  # warm-up: compiles, graph captures, first-touch allocations
    times, tokens = [], 0
    for _ in range(iters):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        groups = fn()
        times.append(time.perf_counter() - start)
        tokens = sum(len(c.token_ids) for g in groups for c in g)
    return {"s": times, "tokens": tokens, "tok_s": tokens / statistics.median(times)}


def main() -> int:
    from hpcrl.config.compose import compose_config
    from hpcrl.rollout.base import SamplingSettings

    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=192)
    p.add_argument("--gen", type=int, default=256)
    p.add_argument("--seqs", default="64,128,256,512")
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--share", type=float, default=0.4, help="gpu_memory_utilization of each vLLM engine")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-two", action="store_true")
    p.add_argument("--out", default="")
    p.add_argument("--deadline-s", type=float, default=1e9, help="skip rows that would start after this")
    p.add_argument("--procs", type=int, default=0, help="only the row of N engines in N processes")
    p.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--sync", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.procs and args.worker < 0:
        return processes(args)
    t0 = time.time()
    base = [f"model={args.model}", "cluster=h200", "cluster.slurm.account=x", "cluster.container.image=x",
            "cluster.gpus_per_node=1", f"rollout.max_new_tokens={args.gen}"]  # fmt: skip
    base += [f"model.num_layers={args.layers}"] if args.layers else []
    model_dir = Path(args.model_dir)
    gen = torch.Generator().manual_seed(0)
    vocab = 49152  # the carried tokenizer's: ids it can decode (any id works for speed)
    prompts = [
        torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)
    ]
    settings = SamplingSettings(n=1, temperature=1.0, top_p=1.0, max_tokens=args.gen, seed=0)
    res: dict = {"model": args.model, "layers": args.layers, "prompts": args.prompts,
                 "prompt_len": args.prompt_len, "gen": args.gen, "rows": {}}  # fmt: skip

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))

    def row(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        if time.time() - t0 > args.deadline_s:
            print(f"{name:40s} skipped (deadline)", flush=True)
            return
        try:
            r = timed(fn, args.iters)
        except Exception as e:  # one failing row keeps the others
            res["rows"][name] = {"error": repr(e)[:500]}
            print(f"{name:40s} FAILED {e!r}"[:300], flush=True)
        else:
            res["rows"][name] = r
            print(
                f"{name:40s} {r['tok_s']:10.0f} tok/s  ({', '.join(f'{x:.2f}' for x in r['s'])} s)",
                flush=True,
            )
        save()

    if not args.skip_hf and args.worker < 0:
        from hpcrl.rollout.hf_engine import HFEngine

        cfg = compose_config([*base, "rollout=hf"])
        start = time.perf_counter()
        hf = HFEngine(model_dir, cfg.rollout, device="cuda")
        res["hf_start_s"] = time.perf_counter() - start
        for seqs in (64, 256):
            hf.cfg.max_num_seqs = seqs
            row(f"hf, max_num_seqs {seqs}", lambda: hf.generate(prompts, settings))
        del hf
        torch.cuda.empty_cache()

    from hpcrl.rollout.vllm_engine import VLLMEngine

    cfg = compose_config([*base, "rollout=vllm", "rollout.block_size=64", "rollout.logprob_fraction=0.125",
                          f"rollout.max_num_seqs={max(int(x) for x in args.seqs.split(','))}",
                          f"rollout.gpu_memory_utilization={args.share}"])  # fmt: skip

    def engine(seed: int) -> VLLMEngine:
        start = time.perf_counter()
        eng = VLLMEngine(model_dir, cfg.rollout, seed=seed, on_cpu=False, scratch=Path(tempfile.mkdtemp()),
                         max_model_len=args.prompt_len + args.gen + 16)  # fmt: skip
        res.setdefault("vllm_start_s", []).append(time.perf_counter() - start)
        print(f"vllm engine started in {res['vllm_start_s'][-1]:.1f} s", flush=True)
        return eng

    if args.worker >= 0:
        return worker(args, engine(args.worker), prompts, settings)
    first = engine(0)

    def waves(eng: VLLMEngine, batch: list[list[int]], size: int) -> list:
        out: list = []
        for i in range(0, len(batch), size):
            out += eng.generate(batch[i : i + size], settings)
        return out

    for seqs in (int(x) for x in args.seqs.split(",")):
        row(f"vllm, {seqs} at once", lambda s=seqs: waves(first, prompts, s))
    if not args.skip_two and time.time() - t0 < args.deadline_s - 120:
        second = engine(1)
        half = len(prompts) // 2

        def both() -> list:
            out: list = [None, None]

            def run(i: int, eng: VLLMEngine, batch: list[list[int]]) -> None:
                out[i] = eng.generate(batch, settings)

            threads = [threading.Thread(target=run, args=(0, first, prompts[:half]), daemon=True),
                       threading.Thread(target=run, args=(1, second, prompts[half:]), daemon=True)]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            if out[0] is None or out[1] is None:
                raise TimeoutError("the two engines did not both finish within 120 s")
            return out[0] + out[1]

        row(f"2 vllm engines, {half} each at once", both)
    print(json.dumps({k: v.get("tok_s", v) for k, v in res["rows"].items()}, indent=1), flush=True)
    save()
    return 0


def worker(args: argparse.Namespace, eng, prompts: list, settings) -> int:  # type: ignore[no-untyped-def]
    """One of ``--procs`` engines: warm up on its share, say ready, wait for the others, then generate
    ``--iters`` times, writing start and end times (wall clock, shared by the processes) and tokens."""
    sync = Path(args.sync)
    (sync / f"started.{args.worker}").touch()
    mine = prompts[args.worker :: args.procs]
    eng.generate(mine, settings)
    (sync / f"ready.{args.worker}").touch()
    while len(list(sync.glob("ready.*"))) < args.procs:
        time.sleep(0.01)
    runs = []
    for _ in range(args.iters):
        start = time.time()
        groups = eng.generate(mine, settings)
        runs.append(
            {"start": start, "end": time.time(), "tokens": sum(len(c.token_ids) for g in groups for c in g)}
        )
    (sync / f"result.{args.worker}.json").write_text(json.dumps(runs))
    return 0


def processes(args: argparse.Namespace) -> int:
    """``--procs N`` engines in N processes on the GPU, each with 1/N of the prompts (and of the memory)."""
    import subprocess

    sync = Path(tempfile.mkdtemp(prefix="sweep-sync-"))
    share = min(args.share, 0.85 / args.procs)
    argv = sys.argv[1:]
    procs = []
    for i in range(args.procs):  # one at a time: vLLM's start-up memory profile must not see another's
        procs.append(subprocess.Popen([sys.executable, __file__, *argv, "--worker", str(i), "--sync", str(sync),
                                       "--share", str(share)]))  # fmt: skip
        while not (sync / f"started.{i}").exists() and procs[-1].poll() is None:
            time.sleep(0.2)
    codes = [p.wait() for p in procs]
    runs = [json.loads((sync / f"result.{i}.json").read_text()) for i in range(args.procs) if not codes[i]]
    name = f"{args.procs} vllm engines in processes, {args.prompts // args.procs} each at once"
    if len(runs) < args.procs:
        print(f"{name:40s} FAILED (exit codes {codes})", flush=True)
        return 1
    per_iter = []
    for i in range(args.iters):
        rows = [r[i] for r in runs]
        secs = max(r["end"] for r in rows) - min(r["start"] for r in rows)
        per_iter.append((secs, sum(r["tokens"] for r in rows)))
    tok_s = statistics.median(t / s for s, t in per_iter)
    print(f"{name:40s} {tok_s:10.0f} tok/s  ({', '.join(f'{s:.2f}' for s, _ in per_iter)} s)", flush=True)
    if args.out:
        out = Path(args.out)
        res = json.loads(out.read_text()) if out.exists() else {"model": args.model, "rows": {}}
        res["rows"][name] = {"s": [s for s, _ in per_iter], "tokens": per_iter[0][1], "tok_s": tok_s,
                             "share": share}  # fmt: skip
        out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    import os

    code = main()
    sys.stdout.flush()
    os._exit(code)  # a timed-out engine thread must not hold the exit
