"""Gemma 3 on one GPU: the megatron backend's GPU-only path (compiled layers, flex_attention on the
sliding-window layers) against the fsdp backend (Hugging Face's Gemma 3) on the same GRPO step.

    python bench/gemma_gpu_parity.py [--model gemma3_1b --batch 4 --seq 1536]

Sequences are longer than the 512-token window, so the sliding layers really cut keys off. fp32
everywhere (``trainer.precision=float32``) so the two backends can be compared closely; each backend
runs in its own process (global process groups). Prints max |log-prob| difference, loss, entropy and
grad-norm of both; the JSON goes to $OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_bench import DEVICE, MODEL_OVERRIDES, make_model_dir, portable

from hpcrl.config.compose import compose_config
from hpcrl.trainer import make_trainer
from hpcrl.trainer.batch import build_batch
from hpcrl.trainer.process_group import free_port


def batch(n: int, seq: int):
    gen = torch.Generator().manual_seed(0)
    half = seq // 2
    prompts = [torch.randint(0, 1000, (half,), generator=gen).tolist() for _ in range(n)]
    comps = [torch.randint(0, 1000, (seq - half - 7 * i,), generator=gen).tolist() for i in range(n)]
    logps = [(-torch.rand(len(c), generator=gen) * 3).tolist() for c in comps]
    return build_batch(prompts, comps, logps, ([1.0, -1.0] * n)[:n], [1.0] * n, 0)


def one(backend: str, model_dir: Path, model: str, n: int, seq: int, out: Path, variant: str) -> None:
    """``variant``: space-separated config overrides, plus ``window=sdpa`` for the masked-SDPA kernel."""
    words = variant.split()
    cfg = compose_config([f"model={model}", *MODEL_OVERRIDES, f"trainer={backend}", "trainer.precision=float32",
                          f"trainer.micro_batch_size={n}", "algo.kl_coef=0", "trainer.grad_clip=1e12",
                          *(w for w in words if not w.startswith("window="))])  # fmt: skip
    if backend == "megatron":
        from hpcrl.trainer.megatron import attention

        attention.WINDOW_KERNEL = "sdpa" if "window=sdpa" in words else "flex"
    trainer: Any = make_trainer(model_dir, cfg, 0, 1, f"127.0.0.1:{free_port()}", DEVICE)
    probes = probe_decoder_input(trainer, backend, scaled=cfg.model.family in ("gemma3", "gemma4"))
    b = batch(n, seq)
    logp = trainer.logprobs(b)
    metrics = trainer.train_step(b, None)
    if backend == "megatron":
        grads = trainer.export_weights(grads=True)
    else:
        from hpcrl.trainer.fsdp import checkpoint_names

        full = {n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for n, p in trainer.model.named_parameters()
                if p.grad is not None}  # fmt: skip
        grads = checkpoint_names(trainer.model, full)
    # float64: the fp32 norm of a big CPU tensor drifts by ~1e-4 (the megatron export is on the CPU)
    norms = {n: float(g.double().norm()) for n, g in grads.items()}
    emb_name = next(n for n in grads if n.endswith("embed_tokens.weight"))
    emb = grads[emb_name].float().to(probes["lookup"].device)
    lookup = probes.pop("lookup")
    probes.update({
        "embedding_grad_rows_top5": _top_rows(emb),
        "embedding_grad_row0": float(emb[0].norm()),
        "lookup_part_norm": float(lookup.norm()),
        "lookup_part_rows_top5": _top_rows(lookup),
        "head_part_norm (total - lookup)": float((emb - lookup).norm()),
    })  # fmt: skip
    torch.save({"logp": logp.cpu(), "mask": b.loss_mask.bool(), "metrics": metrics, "grad_norms": norms,
                "probes": probes}, out)  # fmt: skip


def probe_decoder_input(trainer, backend: str, scaled: bool) -> dict:
    """Gradient norms at the decoder's input (the scaled embeddings) during the training backward: all
    tokens, and the last row's last 7 (padding in ``batch``). Localises a wrong embedding gradient to
    the lookup (these agree) or to what flows into it (these differ)."""
    found: dict = {}

    def record(grad: torch.Tensor, ids: torch.Tensor, tokens_first: bool) -> None:
        g = grad.detach().float()
        last_row = g[-1, -7:] if tokens_first else g[-7:, -1]
        found.setdefault("decoder_input", []).append(float(g.norm()))
        found.setdefault("decoder_input_padding", []).append(float(last_row.norm()))
        # what the lookup alone gives the embedding weight: the scale times the scattered input grads
        # (both probes sit after the sqrt(hidden) scaling); the pad row (id 0, HF's padding_idx) gets
        # nothing in either backend (spec.keep_pad_row_untrained)
        g = g if tokens_first else g.transpose(0, 1)
        part = torch.zeros(vocab, g.shape[-1], device=g.device).index_add_(
            0, ids.reshape(-1), g.reshape(-1, g.shape[-1])
        )
        part[0] = 0
        found["lookup"] = found.get("lookup", 0) + part * scale

    def hook(_module, args, kwargs, out):
        if torch.is_grad_enabled() and out.requires_grad:
            ids = args[0] if args else kwargs["input_ids"]
            out.register_hook(lambda g: record(g, ids, backend != "megatron"))  # megatron is [s, b, h]
        return None

    vocab, hidden = _embedding(trainer).shape
    scale = float(torch.tensor(hidden**0.5)) if scaled else 1.0  # Gemma's sqrt(hidden)

    if backend == "megatron":
        # after the sqrt(hidden) scaling hook
        trainer.model.embedding.register_forward_hook(hook, with_kwargs=True)
    else:
        trainer.model.get_decoder().embed_tokens.register_forward_hook(hook, with_kwargs=True)
    return found


def _top_rows(grad: torch.Tensor) -> dict[int, float]:
    top = grad.norm(dim=1).topk(5)
    return {int(i): float(v) for i, v in zip(top.indices, top.values, strict=True)}


def _embedding(trainer) -> torch.Tensor:
    """The input embedding's weight, [vocab, hidden], in either backend."""
    if hasattr(trainer.model, "embedding"):
        return trainer.model.embedding.word_embeddings.weight
    return trainer.model.get_decoder().embed_tokens.weight


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gemma3_1b")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1536)
    p.add_argument("--one", nargs=3, metavar=("BACKEND", "MODEL_DIR", "OUT"))
    p.add_argument("--variant", default="", help="for --one")
    p.add_argument("--variants", default="", help="';'-separated megatron variants (overrides, window=sdpa)")
    a = p.parse_args()
    if a.one:
        one(a.one[0], Path(a.one[1]), a.model, a.batch, a.seq, Path(a.one[2]), a.variant)
        return 0
    model_dir = make_model_dir(compose_config([f"model={a.model}", *MODEL_OVERRIDES]))
    runs, errors = {}, {}
    for backend, variant in (("fsdp", ""), *(("megatron", v.strip()) for v in a.variants.split(";"))):
        name = f"{backend} {variant}".strip()
        out = model_dir.parent / f"run{len(runs) + len(errors)}.pt"
        done = subprocess.run([sys.executable, __file__, "--model", a.model, "--batch", str(a.batch), "--seq",
                               str(a.seq), "--variant", variant, "--one", backend, str(model_dir), str(out)],
                              capture_output=True, text=True)  # fmt: skip
        if done.returncode:
            errors[name] = portable(done.stderr).strip().splitlines()[-30:]
        else:
            runs[name] = torch.load(out)
    result: dict = {"model": a.model, "batch": a.batch, "seq": a.seq, "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
                    "errors": errors, "runs": {}}  # fmt: skip
    ref = runs.get("fsdp")
    for name, run in runs.items():
        row = {k: run["metrics"][k] for k in ("loss", "entropy", "grad_norm")}
        # the same norm from the per-weight float64 norms: the trainers' own fp32 metric drifts on CPUs
        # (over fsdp's weights: megatron also exports a tied head's copy of the embedding gradient)
        names = (ref or run)["grad_norms"].keys()
        row["grad_norm_float64"] = sum(run["grad_norms"].get(n, 0.0) ** 2 for n in names) ** 0.5
        logp = run["logp"][run["mask"][:, : run["logp"].shape[1]]]
        # how peaked the random model is: the scale of the log-prob differences
        row["completion_logp_mean"] = float(logp.mean())
        row["probes"] = run["probes"]
        if ref is not None:
            mask = ref["mask"][:, : run["logp"].shape[1]]
            row["max_logp_diff_vs_fsdp"] = float((run["logp"] - ref["logp"])[mask].abs().max())
            if run is not ref:  # the weights whose gradient norms differ most from fsdp's
                gaps = {n: (g, ref["grad_norms"].get(n, float("nan"))) for n, g in run["grad_norms"].items()}
                worst = sorted(gaps.items(), key=lambda kv: -abs(kv[1][0] - kv[1][1]))[:6]
                row["worst_grad_norms (megatron, fsdp)"] = dict(worst)
        result["runs"][name] = row
        print(name, row, flush=True)
    print(json.dumps(result, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"gemma_gpu_parity_{a.model}.json").write_text(json.dumps(result, indent=1))
    return 0 if not errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
