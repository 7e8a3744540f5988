"""Nemotron-H's Mamba-2 mixer with mamba_ssm / causal_conv1d's kernels against hpcrl's torch paths
(issue 36 item 5; ``trainer.kernels``, hpcrl/trainer/kernels.py), on one GPU where the kernels are
installed (``bench/device_runs/s24_kernels.sh`` builds them):

    python bench/kernels_gpu.py --parity          # numbers: kernels vs torch, packed and unpacked
    python bench/kernels_gpu.py --bench           # speed at Super's shape, per layer kind and whole step

Both backends' Mamba paths are checked: the fsdp backend's (transformers' Nemotron-H, whose module
functions are the kernels or transformers' torch functions, plus hpcrl's packed wrappers: what
``fsdp/segments.use_kernels`` selects) and the megatron backend's ``TorchMambaMixer`` (where
megatron-core imports; ``kernels.configure`` picks its path).

Parity: a tiny Nemotron-H (every layer kind, chunks of 8) and Super's widths cut to 2 layers (``ME``),
bf16 autocast over fp32 weights, forward + backward, the same weights and batch both ways; loss and
every gradient compared (relative to the gradient's largest entry), unpacked rows and one packed
row of several sequences (``seq_idx``). Bench: Super's widths (conf/model/nemotron_super.yaml; 128
experts instead of 512 as in bench/results session 10), 8 layers of its pattern (``MEM*EMEM``), random
bf16 weights: ms forward + backward per layer kind and the whole model's step in tokens/s, each path.
Writes ``$OUT/kernels_gpu.json`` and prints a table with ratios. ``--device cpu --tiny`` runs the torch
rows on a CPU (a smoke of this script; the kernel rows need CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpcrl.trainer import kernels  # noqa: E402

PATHS = ("kernels", "torch")
PARTIAL: dict = {}
"""Parity cases and bench rows as they finish (main writes them if a later one fails or time runs out)."""


# -- the two paths in transformers' module ------------------------------------------------------------
class HFPaths:
    """transformers' Nemotron-H module functions as bound at import (the kernels where installed) and
    their torch functions, swapped in and out; packed rows get hpcrl's segment wrappers on the torch
    side, as the fsdp backend does."""

    def __init__(self) -> None:
        from transformers.models.nemotron_h import modeling_nemotron_h as hf

        from hpcrl.trainer.fsdp import segments

        self.hf = hf
        self.bound = {n: getattr(hf, n) for n in kernels.TRANSFORMERS_FUNCTIONS}
        kernels.use_torch_in_transformers()
        segments.reset_at_sequence_starts(kernels.TORCH)
        self.torch = {n: getattr(hf, n) for n in kernels.TRANSFORMERS_FUNCTIONS}

    def use(self, path: str) -> None:
        fns = self.bound if path == "kernels" else self.torch
        for name, fn in fns.items():
            setattr(self.hf, name, fn)
        kernels._ACTIVE[0] = kernels.installed() if path == "kernels" else kernels.TORCH


def super_config(layers: str, experts: int, tiny: bool) -> Any:
    from transformers import NemotronHConfig

    if tiny:
        sys.path.insert(0, str(ROOT / "tests" / "harness"))
        from tiny_checkpoints import NEMOTRON_H

        return NemotronHConfig(
            **{**NEMOTRON_H, "hybrid_override_pattern": layers, "tie_word_embeddings": False}
        )
    m = yaml.safe_load((ROOT / "conf/model/nemotron_super.yaml").read_text())
    h = m["hybrid"]
    return NemotronHConfig(
        vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], num_attention_heads=m["num_attention_heads"],
        num_key_value_heads=m["num_kv_heads"], head_dim=m["head_dim"], mamba_num_heads=h["mamba_heads"],
        mamba_head_dim=h["mamba_head_dim"], ssm_state_size=h["mamba_state"], n_groups=h["mamba_groups"],
        conv_kernel=4, chunk_size=128, n_routed_experts=experts, num_experts_per_tok=m["experts_per_token"],
        moe_intermediate_size=m["moe_ffn_hidden_size"], moe_latent_size=m["moe_latent_size"],
        n_shared_experts=1, moe_shared_expert_intermediate_size=m["shared_expert_ffn"], routed_scaling_factor=5.0,
        n_group=1, topk_group=1, norm_topk_prob=True, mlp_hidden_act="relu2", num_nextn_predict_layers=0,
        hybrid_override_pattern=layers, tie_word_embeddings=False, max_position_embeddings=8192,
    )  # fmt: skip


def model_of(config: Any, device: str, dtype: torch.dtype) -> Any:
    from transformers import NemotronHForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = NemotronHForCausalLM(config).to(dtype)
    with torch.no_grad():  # dt over its real range: some heads near the floor, some long
        for name, p in model.named_parameters():
            if name.endswith("dt_bias"):
                p.copy_(torch.linspace(-6.0, 1.0, p.numel()))
    return model.train()


def step(model: Any, ids: torch.Tensor, seq_idx: torch.Tensor | None, device: str) -> torch.Tensor:
    extra: dict[str, Any] = {}
    if (
        seq_idx is not None
    ):  # one packed row: positions restart per sequence, seq_idx restarts the Mamba layers
        starts = torch.cat([seq_idx.new_ones(1, 1), (seq_idx[:, 1:] != seq_idx[:, :-1]).int()], 1)
        idx = torch.arange(ids.shape[1], device=ids.device)
        first = torch.cummax(torch.where(starts.bool(), idx, 0), 1).values
        extra = {"position_ids": idx - first, "seq_idx": seq_idx}
    with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=device != "cpu"):
        logits = model(input_ids=ids, use_cache=False, **extra).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach()


def packed_ids(vocab: int, lengths: list[int], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (1, sum(lengths)), generator=g).to(device)
    seq = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])
    return ids, seq[None].to(device).contiguous()


# -- parity ---------------------------------------------------------------------------------------------
def parity(paths: HFPaths, device: str, tiny_only: bool) -> dict:
    cases = {"tiny MEM*EMEM": (super_config("MEM*EMEM", 8, True), [9, 22, 5, 13], 2)}
    if not tiny_only:
        cases["Super widths ME"] = (super_config("ME", 32, False), [700, 300, 1048], 2)
    out: dict = {}
    for name, (config, lengths, rows) in cases.items():
        model = model_of(config, device, torch.float32)
        g = torch.Generator().manual_seed(2)
        batch = torch.randint(3, config.vocab_size, (rows, sum(lengths)), generator=g).to(device)
        packed, seq_idx = packed_ids(config.vocab_size, lengths, device)
        for layout, ids, seq in (("unpacked", batch, None), ("packed", packed, seq_idx)):
            got = {}
            for path in PATHS:
                paths.use(path)
                model.zero_grad(set_to_none=True)
                loss = step(model, ids, seq, device)
                grads = {
                    n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
                }
                got[path] = (float(loss), grads)
            (lk, gk), (lt, gt) = got["kernels"], got["torch"]
            rel = {n: float((gk[n] - gt[n]).abs().max() / gt[n].abs().max().clamp_min(1e-30)) for n in gt}
            worst = max(rel, key=rel.__getitem__)
            out[f"{name} {layout}"] = PARTIAL.setdefault("parity", {})[f"{name} {layout}"] = {"loss_kernels": lk, "loss_torch": lt, "loss_rel_diff": abs(lk - lt) / abs(lt),
                                       "max_rel_grad_diff": rel[worst], "worst_grad": worst,
                                       "mamba_grad_max_rel": max(v for n, v in rel.items() if "mixer" in n and
                                                                 ("A_log" in n or "conv1d" in n or "dt_bias" in n))}  # fmt: skip
            print(f"parity {name} {layout}: {json.dumps(out[f'{name} {layout}'])}", flush=True)
        del model
    out.update(megatron_parity(device))
    return out


def megatron_parity(device: str) -> dict:
    """The megatron backend's mixer at Super's Mamba widths, its kernels vs its torch path."""
    try:
        mixer = megatron_mixer(device, tiny=device == "cpu")
    except Exception as exc:  # megatron-core absent, or its API moved: the fsdp rows stand
        return {"megatron mixer": {"skipped": f"{type(exc).__name__}: {exc}"[:300]}}
    from types import SimpleNamespace

    out: dict = {}
    length = 2048 if device != "cpu" else 40
    x = torch.randn(length, 2, mixer.in_proj.weight.shape[1], device=device)
    cu = torch.tensor([0, length // 3, length // 2], dtype=torch.int32, device=device)
    for layout, xs, psp in (("unpacked", x, None), ("packed", x[:, :1], SimpleNamespace(cu_seqlens_q=cu))):
        got = {}
        for path in PATHS:
            kernels._ACTIVE[0] = kernels.installed() if path == "kernels" else kernels.TORCH
            mixer.zero_grad(set_to_none=True)
            xi = xs.clone().requires_grad_()
            with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=device != "cpu"):
                y, _ = mixer(xi, packed_seq_params=psp)
            y.float().square().mean().backward()
            got[path] = (
                y.float().detach(),
                xi.grad,
                {n: p.grad.clone() for n, p in mixer.named_parameters()},
            )
        (yk, xk, gk), (yt, xt, gt) = got["kernels"], got["torch"]
        rel = {n: float((gk[n] - gt[n]).abs().max() / gt[n].abs().max().clamp_min(1e-30)) for n in gt}
        out[f"megatron mixer {layout}"] = {
            "out_rel_diff": float((yk - yt).abs().max() / yt.abs().max()),
            "input_grad_rel_diff": float((xk - xt).abs().max() / xt.abs().max()),
            "max_rel_grad_diff": max(rel.values()), "worst_grad": max(rel, key=rel.__getitem__),
        }  # fmt: skip
    return out


def megatron_mixer(device: str, tiny: bool) -> Any:
    """One TorchMambaMixer at Super's Mamba widths (one process, TP=CP=1), fp32 weights."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    from hpcrl.trainer.megatron.ssm import TorchMambaMixer
    from hpcrl.trainer.process_group import free_port

    if not torch.distributed.is_initialized():
        backend = "nccl" if device != "cpu" else "gloo"
        torch.distributed.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
        ps.initialize_model_parallel()
    heads, hd, state, groups, hidden = (8, 16, 16, 4, 64) if tiny else (128, 64, 128, 8, 4096)
    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=4, mamba_num_heads=heads, mamba_head_dim=hd,
        mamba_state_dim=state, mamba_num_groups=groups, layernorm_epsilon=1e-5, use_cpu_initialization=True,
        params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    mixer = TorchMambaMixer(config, hidden, chunk_size=8 if tiny else 128, conv_kernel=4, dt_min=1e-3)
    with torch.no_grad():
        for p in mixer.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
        mixer.dt_bias.copy_(torch.linspace(-6.0, 1.0, mixer.dt_bias.numel()))
        mixer.A_log.copy_(torch.log(torch.linspace(1, 16, mixer.A_log.numel())))
    return mixer.to(device)


# -- speed ----------------------------------------------------------------------------------------------
def timed(fn: Any, warmup: int = 1, iters: int = 3) -> float:
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench(paths: HFPaths, device: str, batch: int, seq: int, experts: int, tiny: bool, iters: int) -> dict:
    """ms forward + backward per layer kind (one layer of each, bf16 weights, bf16 input) and the whole
    8-layer model's step (loss over the logits) in tokens/s, on each path; megatron's mixer too."""
    pattern = "MEM*EMEM"
    model = model_of(super_config(pattern, experts, tiny), device, torch.bfloat16)
    h = model.config.hidden_size
    ids = torch.randint(3, model.config.vocab_size, (batch, seq), device=device)
    rows: dict = {}
    for path in PATHS:
        if path == "kernels" and not (device != "cpu" and kernels.installed().mamba):
            rows[path] = {"skipped": "no kernels here (mamba_ssm + causal_conv1d on a GPU)"}
            continue
        paths.use(path)
        row: dict = {}
        for kind in dict.fromkeys(pattern):
            layer = model.model.layers[pattern.index(kind)]
            x = torch.randn(batch, seq, h, device=device, dtype=torch.bfloat16, requires_grad=True)

            def fwd_bwd(layer: Any = layer, x: torch.Tensor = x) -> None:
                out = layer(x)
                (out[0] if isinstance(out, tuple) else out).float().square().mean().backward()

            row[f"{kind} ms"] = 1e3 * timed(fwd_bwd, 1, iters)
        model.zero_grad(set_to_none=True)
        t = timed(lambda: step(model, ids, None, device), 1, iters)
        row.update(step_s=t, tokens_per_s=batch * seq / t)
        if device != "cpu":
            row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
            torch.cuda.reset_peak_memory_stats()
        rows[path] = PARTIAL.setdefault("bench", {})[path] = row
        print(f"bench {path}: {json.dumps(row)}", flush=True)
    rows["megatron mixer"] = megatron_speed(device, batch, seq, tiny, iters)
    return rows


def megatron_speed(device: str, batch: int, seq: int, tiny: bool, iters: int) -> dict:
    try:
        mixer = megatron_mixer(device, tiny)
    except Exception as exc:  # megatron-core absent, or its API moved: the fsdp rows stand
        return {"skipped": f"{type(exc).__name__}: {exc}"[:300]}
    x = torch.randn(seq, batch, mixer.in_proj.weight.shape[1], device=device, requires_grad=True)
    out: dict = {}
    for path in PATHS:
        if path == "kernels" and not (device != "cpu" and kernels.installed().mamba):
            continue
        kernels._ACTIVE[0] = kernels.installed() if path == "kernels" else kernels.TORCH

        def fwd_bwd() -> None:
            with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=device != "cpu"):
                y, _ = mixer(x)
            y.float().square().mean().backward()

        out[f"M mixer ms ({path})"] = 1e3 * timed(fwd_bwd, 1, iters)
    return out


def table(results: dict) -> None:
    for name, r in results.get("parity", {}).items():
        print(
            f"parity {name:32s} "
            + " ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items())
        )
    rows = results.get("bench", {})
    if not rows:
        return
    k, t = rows.get("kernels", {}), rows.get("torch", {})
    print(
        f"\n{'Super 8 layers ' + results['shape']:30s} {'kernels':>10s} {'torch':>10s} {'torch/kernels':>14s}"
    )
    for key in t:
        if isinstance(t[key], float):
            kv = k.get(key, float("nan"))
            ratio = kv / t[key] if key == "tokens_per_s" else t[key] / kv
            print(f"{key:30s} {kv:10.2f} {t[key]:10.2f} {ratio:13.2f}x")
    for key, v in rows.get("megatron mixer", {}).items():
        print(f"{key:30s} {v}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--parity", action="store_true")
    p.add_argument("--bench", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny widths (a CPU smoke of this script)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--iters", type=int, default=3)
    a = p.parse_args()
    results: dict = {"device": torch.cuda.get_device_name() if a.device != "cpu" else "cpu",
                     "torch": torch.__version__, "installed": kernels.installed().describe(),
                     "kernel_rows_are_kernels": a.device != "cpu" and kernels.installed().mamba,
                     "shape": f"{a.batch}x{a.seq}"}  # fmt: skip
    for pkg in ("transformers", "mamba_ssm", "causal_conv1d", "megatron-core"):
        try:
            from importlib.metadata import version

            results[pkg] = version(pkg)
        except Exception:
            results[pkg] = "not installed"
    print(json.dumps(results), flush=True)
    paths = HFPaths()
    out = Path(os.environ.get("OUT", "."), "kernels_gpu.json")
    # timeout's SIGTERM ends the run through the finally below, which keeps what finished
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    try:
        if a.parity:
            results["parity"] = parity(paths, a.device, a.tiny)
        if a.bench:
            results["bench"] = bench(paths, a.device, a.batch, a.seq, a.experts, a.tiny, a.iters)
    finally:
        for part, got in PARTIAL.items():
            results.setdefault(part, got)
        out.write_text(json.dumps(results, indent=1))
    table(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
