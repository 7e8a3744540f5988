"""Router replay (issue 36 item 2): engine-vs-trainer log-prob mismatch (``gen_kl_error``) with and
without ``trainer.router_replay``, on a tiny Qwen3-MoE (2 layers, 8 experts, top-2) with the real vLLM
CPU engine and the fsdp trainer (one gloo rank, fp32 both).

    python bench/router_replay_kl.py [--prompts 16] [--n 4] [--max-new 24] [--scales 0,0.01,0.03,0.1]

On a CPU both sides compute in fp32 and route alike, so the row at scale 0 shows the floor. The other
rows give the trainer's routers noise of std ``scale`` (the engine keeps the checkpoint's), a stand-in
for the numerics drift (bf16 kernels, another reduction order) that moves near-tied top-k choices
on GPUs. Per row: the share of generated tokens whose experts differ from the engine's in at least one
layer (free routing; replay makes it 0), and ``gen_kl_error`` free and replayed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcrl.algo.losses import gen_kl_error
from hpcrl.config.compose import compose_config
from hpcrl.rollout.base import SamplingSettings
from hpcrl.rollout.config import VLLMRolloutConfig
from hpcrl.rollout.vllm_engine import VLLMEngine
from hpcrl.trainer.batch import TrainBatch, build_batch
from hpcrl.trainer.fsdp import FSDPTrainer
from hpcrl.trainer.process_group import free_port
from tests.harness.tiny_checkpoints import save_engine_moe

MASTER = f"127.0.0.1:{free_port()}"


def generate(model_dir: Path, scratch: Path, prompts: int, n: int, max_new: int) -> TrainBatch:
    cfg = compose_config([]).rollout
    assert isinstance(cfg, VLLMRolloutConfig)
    engine = VLLMEngine(
        model_dir, cfg, seed=0, max_model_len=64, on_cpu=True, scratch=scratch, kv_cache_gb=0.1, routes=True
    )
    gen = torch.Generator().manual_seed(0)
    ps = [[1, *torch.randint(3, 120, (int(torch.randint(4, 16, (1,), generator=gen)),), generator=gen).tolist()]
          for _ in range(prompts)]  # fmt: skip
    groups = engine.generate(
        ps, SamplingSettings(n=n, temperature=1.0, top_p=1.0, max_tokens=max_new, seed=0)
    )
    comps = [c for g in groups for c in g]
    return build_batch(
        [p for p in ps for _ in range(n)],
        [c.token_ids for c in comps],
        [c.logprobs for c in comps],
        [0.0] * len(comps),
        [1.0] * len(comps),
        pad_id=0,
        routes=[c.routes for c in comps],
    )


def drifted(model_dir: Path, out: Path, scale: float) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.add_(torch.randn_like(layer.mlp.gate.weight) * scale)
    model.save_pretrained(out)
    return out


def measure(model_dir: Path, b: TrainBatch, replay: bool) -> tuple[float, float, float]:
    """(gen_kl_error, the largest |log-prob gap| on a generated token, share of generated tokens routed
    off the engine's experts in some layer)."""
    cfg = compose_config(["algo.kl_coef=0", f"trainer.router_replay={str(replay).lower()}"])
    t = FSDPTrainer(model_dir, cfg, master=MASTER)
    seen: list[list[torch.Tensor]] = [[] for _ in t.model.model.layers]
    for i, layer in enumerate(t.model.model.layers):
        layer.mlp.experts.register_forward_pre_hook(lambda _m, args, i=i: seen[i].append(args[1]))
    logp = t.logprobs(b if replay else dataclasses.replace(b, routes=None))
    used = torch.stack([torch.cat(s) for s in seen], 1).view(*b.input_ids.shape, len(seen), -1)
    assert b.routes is not None
    differs = (used.sort(-1).values != b.routes.long().sort(-1).values).any(-1).any(-1)  # [B, T]
    # the positions whose outputs predict generated tokens (target j: position j); the last
    # generated token's own position predicts nothing and has no engine route
    off = differs[:, :-1][b.loss_mask.bool()].float().mean().item()
    gap = (logp - b.rollout_logp)[b.loss_mask.bool()].abs().max().item()
    return float(gen_kl_error(logp, b.rollout_logp, b.loss_mask)), gap, off


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--scales", default="0,0.01,0.03,0.1")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = save_engine_moe(root / "moe")
        b = generate(model_dir, root / "vllm", args.prompts, args.n, args.max_new)
        rows = []
        for scale in (float(s) for s in args.scales.split(",")):
            trainer_dir = drifted(model_dir, root / f"drift{scale}", scale) if scale else model_dir
            kl_free, gap_free, off_free = measure(trainer_dir, b, replay=False)
            kl_replay, gap_replay, off_replay = measure(trainer_dir, b, replay=True)
            rows.append(dict(router_noise=scale, tokens_off_route_free=off_free, tokens_off_route_replay=off_replay,
                             gen_kl_error_free=kl_free, gen_kl_error_replay=kl_replay,
                             max_logp_gap_free=gap_free, max_logp_gap_replay=gap_replay))  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        tokens = int(b.loss_mask.sum())
        print(json.dumps({"model": "tiny qwen3_moe 2L 8e top2", "generated_tokens": tokens, "rows": rows}))


if __name__ == "__main__":
    main()
