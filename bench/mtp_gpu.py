"""MTP speculative decoding after a megatron refit, and routes under drafts, on one GPU (issue 36,
items 2 and 4): what the vLLM CPU tests (tests/rollout/test_vllm_mtp.py) cannot show, since vLLM-CPU
runs no Nemotron-H MoE and its Mamba verify forward changes greedy tokens.

The tiny Nemotron-H of the recipes (``MEM*EME``: Mamba-2, attention, latent MoE with a shared expert)
with one MTP block (``*E``, Super's), random weights. Two GPU vLLM engines on one card, each recording
routes (``trainer.router_replay``): ``plain`` (no drafts) and ``mtp`` (``rollout.speculative=mtp``,
``--draft`` tokens). Steps:

1. both engines generate greedily from the same prompts: the drafted completions must equal the plain
   ones token for token; acceptance; every completion carries routes (none missing), equal to the
   plain engine's for the same tokens;
2. the megatron trainer (GPU, world 1) trains the MTP block alone on the drafted completions
   (``trainer.mtp_loss_scale=1``, detached, zero advantages: the decoder stays as it is), replaying the
   engine's routes in its passes (``trainer.router_replay=true``), and streams its weights (the refit's
   path: ``stream_weights`` into a sink) into both engines;
3. again: greedy equal, acceptance higher (the drafter now runs the trained block), routes complete.

    python bench/mtp_gpu.py [--prompts 64 --tokens 32 --draft 2 --steps 40 --dtype float32]

``--no-routes``: engines without route capture, the trainer then routes freely. Engines run eager
(``rollout.enforce_eager``: vLLM 0.26's CUDA-graph capture failed in its Mamba metadata for this tiny
model, session 28).

Prints a table and writes ``$OUT/mtp_gpu.json`` (cwd without OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcrl.config.compose import compose_config
from hpcrl.plan.planner import make_plan
from hpcrl.rollout.base import SamplingSettings, completion_metrics, spec_acceptance

TINY = ("+experiment=grpo-tinynemotronh-1n1g-megatron", "model.mtp_layers=1", "model.hybrid.mtp_pattern=*E")


def model_dir(scratch: Path) -> Path:
    from hpcrl.run.tiny_model import ensure_tiny_model

    return ensure_tiny_model(compose_config(list(TINY)).model, scratch / "cache", sft_steps=0, log=print)


def engine(path: Path, scratch: Path, args: argparse.Namespace, draft: int) -> Any:
    from hpcrl.rollout.vllm_engine import VLLMEngine

    keys = [
        "rollout=vllm",
        f"rollout.dtype={args.dtype}",
        "rollout.gpu_memory_utilization=0.25",
        "rollout.enforce_eager=true",
    ]
    if draft:
        keys += ["rollout.speculative=mtp", f"rollout.num_speculative_tokens={draft}"]
    cfg = compose_config(list(TINY) + keys).rollout
    t = time.perf_counter()
    eng = VLLMEngine(
        path,
        cfg,
        seed=0,
        max_model_len=64,
        on_cpu=False,
        scratch=scratch,
        kv_cache_gb=2.0,
        routes=args.routes,
    )
    print(f"== engine draft={draft} up in {time.perf_counter() - t:.1f} s", flush=True)
    return eng


def async_scheduling(eng: Any) -> Any:
    try:
        return eng.llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    except AttributeError:
        return None


def compare(plain: list, drafted: list, prompts: list[list[int]]) -> dict[str, Any]:
    """Token equality, acceptance, routes: complete, and equal to the plain engine's where the tokens are."""
    same = [p.token_ids == d.token_ids for p, d in zip(plain, drafted, strict=True)]
    first_diff = [
        next((i for i, (a, b) in enumerate(zip(p.token_ids, d.token_ids, strict=False)) if a != b), None)
        for p, d, s in zip(plain, drafted, same, strict=True)
        if not s
    ]
    routes_ok = 0
    routes_rows = 0
    for p, d, prompt, s in zip(plain, drafted, prompts, same, strict=True):
        if not s or p.routes is None or d.routes is None:
            continue
        n = len(prompt) + len(d.token_ids) - 1
        a = torch.as_tensor(p.routes).long().sort(-1).values
        b = torch.as_tensor(d.routes).long().sort(-1).values
        routes_rows += n
        routes_ok += int((a.shape == b.shape == (n, *a.shape[1:])) and torch.equal(a, b)) * n
    return {
        "completions": len(drafted),
        "greedy_equal": sum(same),
        "first_diff_positions": first_diff[:8],
        "tokens": sum(len(d.token_ids) for d in drafted),
        **spec_acceptance(drafted),
        "routes_missing_mtp": completion_metrics(drafted).get("rollout/routes_missing"),
        "routes_missing_plain": completion_metrics(plain).get("rollout/routes_missing"),
        "route_rows_compared": routes_rows,
        "route_rows_equal": routes_ok,
    }


def train_mtp(path: Path, completions: list, prompts: list[list[int]], steps: int) -> tuple[Any, list[float]]:
    from hpcrl.trainer.batch import build_batch
    from hpcrl.trainer.megatron import MegatronTrainer
    from hpcrl.trainer.process_group import free_port

    replay = completions[0].routes is not None  # the engines recorded routes (not --no-routes)
    keys = (
        "rollout=vllm",
        "trainer.mtp_loss_scale=1.0",
        "algo.lr=1e-2",
        "algo.kl_coef=0",
        f"trainer.router_replay={str(replay).lower()}",
    )
    cfg = make_plan(compose_config([*TINY, *keys])).cfg
    trainer = MegatronTrainer(path, cfg, master=f"127.0.0.1:{free_port()}", device="cuda")
    batch = build_batch(
        prompts,
        [c.token_ids for c in completions],
        [c.logprobs for c in completions],
        [0.0] * len(completions),
        [1.0] * len(completions),
        pad_id=0,
        routes=[c.routes for c in completions] if replay else None,
    )
    losses = [float(trainer.train_step(batch)["mtp_loss"]) for _ in range(steps)]
    return trainer, losses


def refit(trainer: Any, engines: list[Any]) -> float:
    from hpcrl.trainer.base import CollectSink

    t = time.perf_counter()
    sink = CollectSink()
    trainer.stream_weights(sink, torch.float32)
    for eng in engines:
        eng.load_weights(sink.weights)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--draft", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--no-routes",
        dest="routes",
        action="store_false",
        help="engines without route capture; the trainer routes freely",
    )
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "."))
    scratch = Path(tempfile.mkdtemp(prefix="mtp-gpu-"))
    rows: dict[str, Any] = {"args": vars(args), "device": torch.cuda.get_device_name()}

    def save() -> None:
        (out / "mtp_gpu.json").write_text(json.dumps(rows, indent=1, default=str))

    path = model_dir(scratch)
    g = torch.Generator().manual_seed(0)
    vocab = compose_config(list(TINY)).model.vocab_size
    prompts = [
        torch.randint(3, vocab, (int(n),), generator=g).tolist()
        for n in torch.randint(4, 24, (args.prompts,), generator=g)
    ]
    settings = SamplingSettings(n=1, temperature=0.0, top_p=1.0, max_tokens=args.tokens, seed=0)
    plain, mtp = engine(path, scratch, args, 0), engine(path, scratch, args, args.draft)
    rows["async_scheduling"] = {"plain": async_scheduling(plain), "mtp": async_scheduling(mtp)}

    def both(tag: str) -> list:
        t = time.perf_counter()
        p = [grp[0] for grp in plain.generate(prompts, settings)]
        tp = time.perf_counter() - t
        t = time.perf_counter()
        d = [grp[0] for grp in mtp.generate(prompts, settings)]
        rows[tag] = compare(p, d, prompts) | {
            "plain_s": round(tp, 3),
            "mtp_s": round(time.perf_counter() - t, 3),
        }
        print(f"== {tag}: {rows[tag]}", flush=True)
        save()
        return d

    drafted = both("before_refit")
    trainer, losses = train_mtp(path, drafted, prompts, args.steps)
    rows["mtp_loss"] = {"first": losses[0], "last": losses[-1]}
    rows["refit_s"] = round(refit(trainer, [plain, mtp]), 3)
    print(f"== megatron MTP loss {losses[0]:.4f} -> {losses[-1]:.4f}; refit {rows['refit_s']} s", flush=True)
    both("after_refit")
    b, a = rows["before_refit"], rows["after_refit"]
    print("\n| | greedy equal | acceptance | routes missing (mtp) | route rows equal |")
    print("|---|---|---|---|---|")
    for tag, r in (("random MTP", b), ("megatron-trained MTP, refitted", a)):
        acc = r.get("rollout/spec_acceptance")
        shown = "none" if acc is None else f"{acc:.3f}"
        print(
            f"| {tag} | {r['greedy_equal']}/{r['completions']} | {shown} | {r['routes_missing_mtp']} | "
            f"{r['route_rows_equal']}/{r['route_rows_compared']} |"
        )
    save()


if __name__ == "__main__":
    main()
