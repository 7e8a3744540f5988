"""The megatron backend with Transformer Engine's layers against its local (torch) layers, on one GPU
with TE installed (issue 36 item 5; ``bench/device_runs/s28_te.sh`` runs it):

    python bench/te_gpu.py --parity       # numbers: local vs TE, the same HF weights, one process
    python bench/te_gpu.py --bench        # speed at Super's widths, whole model and per layer kind

Which layers a build takes is ``spec.uses_local_spec``'s choice (TE when it imports and the model is
on CUDA); the local builds here are the trainer's with that answer turned to "local" (``layers``), so
both sides run the real code: ``make_trainer`` -> the checkpoint streamed in (load.py) -> the
pipeline's forward -> the GRPO step -> export to Hugging Face names.

Parity (one process, world 1, ``trainer.compile=false`` both sides): tiny random Nemotron-H models
(pattern ``M*EM-E``: every layer kind; MoE with a latent width and without; one with an MTP block
trained) and a tiny Qwen3-MoE (also packed: ``trainer.packing=true``, TE's linears around hpcrl's
attention over the packed rows), each saved once and built with the local spec and with TE, in fp32 and
in the backend's real bf16 path (fp32 master weights, bf16 autocast). Per case: the GRPO loss, the
per-token log-probs (max abs diff over the completion tokens), every gradient grouped by parameter
kind (max abs diff relative to the group's largest entry), and the weights exported back to Hugging
Face names against the input file (round trip: equal, both builds); last, the first case's TE build
with the trainer's default torch.compile against it eager. Bench: Super's widths (hidden
4096, 128 Mamba heads, LatentMoE with 128 experts top-22 in a 1024 latent; as bench/kernels_gpu.py)
at 8 layers ``MEM*EMEM``, 4 x 2048 tokens, random weights, bf16 autocast: forward + backward of the
whole model in tokens/s and of one layer of each kind (Mamba, MoE, attention) in ms, local vs TE
(bench/te_speed.py).

Each case and row is printed as it finishes and kept if a later one fails or SIGTERM ends the run;
JSON goes to ``$OUT/te_gpu.json`` (the working directory without ``OUT``). ``--device cpu --tiny``
builds only the local side (a smoke of this script where TE or a GPU is missing).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import signal
import sys
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from te_speed import bench_side, modules_of  # noqa: E402

PARTIAL: dict = {}
"""Parity cases and bench rows as they finish (main writes them if a later one fails or time runs out)."""
PATTERN = "M*EM-E"
"""Every Nemotron-H layer kind, an MoE layer after each of the others."""
SIDES = ("local", "te")


def te_version() -> str:
    try:
        from importlib.metadata import version

        import transformer_engine  # noqa: F401

        return version("transformer_engine")
    except Exception as exc:  # absent, or built against another torch
        return f"absent ({type(exc).__name__}: {exc})"[:200]


def failed(exc: BaseException) -> dict:
    """A case's or row's error, its traceback to stderr (the log) for whoever reads the run."""
    traceback.print_exc()
    return {"error": f"{type(exc).__name__}: {exc}"[:600]}


# -- the tiny checkpoints ---------------------------------------------------------------------------------
def save_nemotron(out: Path, latent: int | None, mtp: bool) -> None:
    """tests/harness/tiny_checkpoints.py's Nemotron-H with every layer kind; a correction bias that
    changes which experts win and dt biases across the 0.001 floor (as tests/megatron's parity model);
    ``mtp``: one MTP block of Super's kinds (attention, LatentMoE) under the checkpoint's ``mtp.*``."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    from tests.harness.tiny_checkpoints import NEMOTRON_H

    fields = {**NEMOTRON_H, "hybrid_override_pattern": PATTERN, "moe_latent_size": latent}
    if mtp:
        fields.update(num_nextn_predict_layers=1, mtp_hybrid_override_pattern="*E")
    torch.manual_seed(0)
    model = NemotronHForCausalLM(NemotronHConfig(**fields, time_step_min=0.001, tie_word_embeddings=False))
    if mtp:
        from hpcrl.trainer.mtp import attach

        attach(model, 1)
        model.mtp.apply(model._init_weights)
    with torch.no_grad():
        for name, t in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn_like(t) * 0.1)
            elif name.endswith("dt_bias"):
                t.copy_(torch.linspace(-12.0, 1.0, t.numel()))
    model.save_pretrained(out)


def save_qwen3_moe(out: Path) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    Qwen3MoeForCausalLM(config).save_pretrained(out)


CASES = {
    "nemotron_h latent": (lambda out: save_nemotron(out, 32, False), ()),
    "qwen3_moe": (save_qwen3_moe, ()),
    "qwen3_moe packed": (save_qwen3_moe, ("trainer.packing=true",)),
    "nemotron_h no-latent": (lambda out: save_nemotron(out, None, False), ()),
    "nemotron_h latent+mtp": (
        lambda out: save_nemotron(out, 32, True),
        ("trainer.mtp_loss_scale=0.5", "trainer.mtp_detach=false"),
    ),
}
"""Name -> (writes the checkpoint into a directory, the case's own overrides); Super's kind first."""


# -- building through the trainer -----------------------------------------------------------------------
@contextmanager
def layers(side: str) -> Iterator[None]:
    """Within: the trainer builds ``side``'s layers. TE's are the trainer's own choice where TE
    imports on a GPU (checked after the build); the local ones are that choice answered "local"."""
    from hpcrl.trainer.megatron import trainer as megatron_trainer

    chosen = megatron_trainer.uses_local_spec
    if side == "local":
        megatron_trainer.uses_local_spec = lambda fam, device: True  # type: ignore[assignment]
    try:
        yield
    finally:
        megatron_trainer.uses_local_spec = chosen  # type: ignore[assignment]


def make(
    model_dir: Path, side: str, precision: str, extra: tuple[str, ...], device: str, compiled: bool = False
) -> Any:
    from hpcrl.config.compose import compose_config
    from hpcrl.trainer import make_trainer
    from hpcrl.trainer.process_group import free_port

    cfg = compose_config(
        [
            "model=tiny",
            "trainer=megatron",
            f"trainer.precision={precision}",
            "trainer.micro_batch_size=2",
            f"trainer.compile={str(compiled).lower()}",
            "trainer.grad_clip=1e12",
            "algo.kl_coef=0",
            "algo.num_minibatches=1",
            *extra,
        ]
    )
    with layers(side):
        trainer = make_trainer(model_dir, cfg, 0, 1, f"127.0.0.1:{free_port()}", device)
    if trainer.te != (side == "te"):
        raise RuntimeError(f"asked for the {side} layers, the trainer built te={trainer.te}")
    return trainer


def run_side(
    model_dir: Path, side: str, precision: str, extra: tuple[str, ...], device: str, compiled: bool = False
) -> dict:
    from safetensors.torch import load_file

    from tests.harness.megatron_parity import parity_batch, stepped_grads

    trainer = make(model_dir, side, precision, extra, device, compiled)
    try:
        source = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            source.update(load_file(f))
        # copies: at TP=1 on the CPU the export holds views of the parameters, which the step updates
        exported = {k: v.detach().to("cpu", copy=True) for k, v in trainer.export_weights().items()}
        batch = parity_batch()
        logp = trainer.logprobs(batch).detach().float().cpu()
        grads = stepped_grads(trainer, "megatron")
        metrics = trainer.train_step(batch)
        del trainer.zero_grad
        return {
            "logp": logp,
            "mask": batch.loss_mask.bool()[:, : logp.shape[1]],
            "metrics": metrics,
            "grads": {k: v.float().cpu() for k, v in grads.items()},
            "round_trip": round_trip(source, exported),
            **modules_of(trainer.model),
        }
    finally:
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


BUFFERS = ("e_score_correction_bias",)
"""Checkpoint buffers the model loads and never exports (families' ``buffers``)."""


def round_trip(source: dict[str, torch.Tensor], exported: dict[str, torch.Tensor]) -> dict:
    """The exported weights (Hugging Face names) against the checkpoint file: the same names but the
    buffers, and bit-equal tensors."""
    common = source.keys() & exported.keys()
    unequal = sorted(k for k in common if not torch.equal(source[k].float(), exported[k].float()))
    missing = sorted(k for k in source.keys() - exported.keys() if not k.endswith(BUFFERS))
    return {
        "equal": not unequal and not missing and exported.keys() <= source.keys(),
        "names": len(common),
        "missing": missing[:6],
        "extra": sorted(exported.keys() - source.keys())[:6],
        "unequal": unequal[:6],
    }


def group_of(name: str) -> str:
    """A parameter's kind: its Hugging Face name with the layer and expert indices cut out."""
    return re.sub(r"\.\d+\.", ".N.", name)


def compare(local: dict, te: dict, names: tuple[str, str] = SIDES) -> dict:
    """``te`` against ``local`` (``names``: what the two are, for the modules row)."""
    mask = local["mask"]
    diff = (te["logp"] - local["logp"])[mask].abs()
    nll = {n: float(-r["logp"][mask].mean()) for n, r in zip(names, (local, te), strict=True)}
    # the step's metrics (the GRPO loss of the first step is the advantages' mean: the gradients and
    # log-probs carry the comparison)
    loss = {
        k: (v, te["metrics"].get(k))
        for k, v in local["metrics"].items()
        if isinstance(v, float) and not k.startswith("time/")
    }
    groups: dict[str, tuple[float, float]] = {}  # kind -> (max abs diff, max abs of local)
    for name, g in local["grads"].items():
        other = te["grads"].get(name)
        if other is None:
            continue
        d, m = float((other - g).abs().max()), float(g.abs().max())
        old = groups.get(group_of(name), (0.0, 0.0))
        groups[group_of(name)] = (max(old[0], d), max(old[1], m))
    rel = {k: d / max(m, 1e-30) for k, (d, m) in groups.items()}
    return {
        "loss": loss,
        "completion_nll": nll,
        "max_logp_abs_diff": float(diff.max()),
        "mean_logp_abs_diff": float(diff.mean()),
        "grad_names": {"local": len(local["grads"]), "te": len(te["grads"]),
                       "only_one_side": sorted(local["grads"].keys() ^ te["grads"].keys())[:6]},
        "max_rel_grad_diff": max(rel.values()) if rel else None,
        "worst_group": max(rel, key=rel.__getitem__) if rel else None,
        "grad_groups_rel": dict(sorted(rel.items(), key=lambda kv: -kv[1])),
        "round_trip": {n: r["round_trip"] for n, r in zip(names, (local, te), strict=True)},
        "modules": {s: {"te_modules": r["te_modules"], "experts": r["experts"]} for s, r in zip(names, (local, te), strict=True)},
    }  # fmt: skip


def parity(device: str, sides: tuple[str, ...], precisions: tuple[str, ...], cases: list[str]) -> dict:
    """Each case both sides, each precision; then the first case's TE build compiled (last: compiling
    takes the longest, and a timeout then loses only that row)."""
    out: dict = {}
    eager: dict | None = None  # the first case's bf16 TE run
    for case in cases:
        save, extra = CASES[case]
        with tempfile.TemporaryDirectory() as tmp:
            save(Path(tmp))
            for precision in precisions:
                name = f"{case} {precision}"
                try:
                    runs = {s: run_side(Path(tmp), s, precision, extra, device) for s in sides}
                    row = compare(runs["local"], runs["te"]) if len(runs) == 2 else {
                        "local only": {"metrics": runs["local"]["metrics"],
                                       "round_trip": runs["local"]["round_trip"],
                                       "experts": runs["local"]["experts"]}}  # fmt: skip
                except Exception as exc:  # the other cases stand
                    row = failed(exc)
                out[name] = PARTIAL.setdefault("parity", {})[name] = row
                print(f"parity {name}: {json.dumps(row)}", flush=True)
                if case == cases[0] and precision == "bfloat16" and "te" in sides and "error" not in row:
                    eager = runs["te"]
    if eager is not None:
        out.update(compiled_row(cases[0], eager, device))
    return out


def compiled_row(case: str, eager: dict, device: str) -> dict:
    """The TE build with the trainer's torch.compile of each decoder layer (its default at TP=1)
    against the same build eager: whether TE's layers compile, and to the same numbers."""
    name = f"{case} bfloat16 te compiled vs eager"
    save, extra = CASES[case]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            save(Path(tmp))  # the same weights: the checkpoint is written from a fixed seed
            compiled = run_side(Path(tmp), "te", "bfloat16", extra, device, compiled=True)
        row = compare(eager, compiled, ("te eager", "te compiled"))
    except Exception as exc:
        row = failed(exc)
    PARTIAL.setdefault("parity", {})[name] = row
    print(f"parity {name}: {json.dumps(row)}", flush=True)
    return {name: row}


# -- speed (bench/te_speed.py builds and times) ------------------------------------------------------
def bench(
    device: str, sides: tuple[str, ...], batch: int, seq: int, experts: int, tiny: bool, iters: int
) -> dict:
    rows: dict = {}
    for side in sides:
        try:
            rows[side] = PARTIAL.setdefault("bench", {})[side] = bench_side(
                side, device, batch, seq, experts, tiny, iters
            )
        except Exception as exc:  # the other side's row stands
            rows[side] = PARTIAL.setdefault("bench", {})[side] = failed(exc)
        print(f"bench {side}: {json.dumps(rows[side])}", flush=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def table(results: dict) -> None:
    for name, r in results.get("parity", {}).items():
        brief = {
            k: r.get(k) for k in ("loss", "max_logp_abs_diff", "max_rel_grad_diff", "worst_group", "error")
        }
        rt = r.get("round_trip", {})
        brief["round_trip_equal"] = {s: v.get("equal") for s, v in rt.items()} if rt else None
        print(f"parity {name:32s} {json.dumps(brief)}")
    rows = results.get("bench", {})
    local, te = rows.get("local", {}), rows.get("te", {})
    if not local and not te:
        return
    print(f"\n{'Super 8 layers ' + results['shape']:30s} {'local':>10s} {'te':>10s} {'local/te':>10s}")
    for key in ("M ms", "E ms", "experts ms", "* ms", "step_s", "tokens_per_s", "peak_gb"):
        a, b = local.get(key, float("nan")), te.get(key, float("nan"))
        ratio = b / a if key == "tokens_per_s" else a / b if b else float("nan")
        print(f"{key:30s} {a:10.2f} {b:10.2f} {ratio:9.2f}x")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parity", action="store_true")
    p.add_argument("--bench", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny widths for the bench (a smoke of this script)")
    p.add_argument(
        "--precisions", default="float32,bfloat16", help="parity: comma-separated trainer.precision"
    )
    p.add_argument(
        "--cases", default="", help=f"parity: comma-separated, of {', '.join(CASES)} (default all)"
    )
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--iters", type=int, default=3)
    a = p.parse_args()
    sides = SIDES if a.device != "cpu" else ("local",)  # TE has no CPU kernels
    results: dict = {"device": torch.cuda.get_device_name() if a.device != "cpu" else "cpu",
                     "torch": torch.__version__, "transformer_engine": te_version(), "sides": list(sides),
                     "shape": f"{a.batch}x{a.seq}"}  # fmt: skip
    for pkg in ("transformers", "megatron-core", "mamba_ssm"):
        try:
            from importlib.metadata import version

            results[pkg] = version(pkg)
        except Exception:
            results[pkg] = "not installed"
    print(json.dumps(results), flush=True)
    out = Path(os.environ.get("OUT", "."), "te_gpu.json")
    # timeout's SIGTERM ends the run through the finally below, which keeps what finished
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    try:
        if a.parity:
            cases = a.cases.split(",") if a.cases else list(CASES)
            results["parity"] = parity(a.device, sides, tuple(a.precisions.split(",")), cases)
        if a.bench:
            results["bench"] = bench(a.device, sides, a.batch, a.seq, a.experts, a.tiny, a.iters)
    finally:
        for part, got in PARTIAL.items():
            results.setdefault(part, got)
        out.write_text(json.dumps(results, indent=1, default=str))
    table(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
