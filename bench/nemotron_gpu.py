"""Nemotron 3 Super's shape cut to a few layers on one GPU (issue 17 item 7): the HF + SDPA baseline,
the fsdp backend and the megatron backend in the same run — tokens/s, MFU on the active parameters,
peak memory against the plan's estimate, the time of each layer kind (Mamba-2 ``M``, LatentMoE ``E``,
attention ``*``) — and megatron vs transformers on the same fp32 step (log-probs, loss, grad norms).

    python bench/nemotron_gpu.py [--parts speed,parity] [--batch 4 --seq 2048 --parity-batch 2 --parity-seq 1024]

(session 10 ran ``--batch 4``: at 8 x 2048 the plan predicts 161-168 GB). megatron-core 0.19.2 needs four
fixes that are not in hpcrl yet; they are applied here as named shims (``HPCRL_BENCH_SHIMS``, default
``norm,experts,cast,router``; ``""`` for none, to see the errors), each listed in its row's ``shims``.

The cut (``HPCRL_BENCH_MODEL_OVERRIDES``, default ``CUT``): Super's real widths (hidden 4096; 128
Mamba heads x 64, state 128, 8 groups, chunk 128; 32 q / 2 kv heads x 128; LatentMoE top-22 in a
1024-wide latent, experts 2688, shared expert 5376; vocab 131072) and 8 layers of its real pattern
(symbols 4..11: ``MEM*EMEM``), with 128 experts instead of 512 — at 512 each E layer holds 2.87B
parameters (46 GB with fp32 master weights, gradients and Adam), three of them do not fit one GPU.
Random weights (``gpu_bench.make_model_dir``). Each backend row runs in its own process (global
process groups); a row whose default fails is retried eagerly (``trainer.compile=false``).

MFU = tokens/s x (6 N_active + 12 L_attn h s) / 989 TFLOP/s (the convention of bench/results: the
SSD scan's own FLOPs, ~5% of an M layer's 6N, are not counted). Layer rows: one layer of each kind
alone, forward + backward at the step's shape under bf16 autocast over the trainer's own weights,
MFU on that layer's 6 N_active (+ 12 h s for attention).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CUT = (
    "model.num_layers=8 model.hybrid.pattern=MEM*EMEM model.hybrid.mamba=4 model.hybrid.attention=1 "
    "model.hybrid.moe=3 model.num_experts=128"
)
os.environ.setdefault("HPCRL_BENCH_MODEL_OVERRIDES", CUT)  # before gpu_bench reads it

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import (  # noqa: E402
    DATASHEET_TFLOPS,
    DEVICE,
    MODEL_OVERRIDES,
    bench_train_baseline,
    make_model_dir,
    portable,
    train_flops_per_token,
)

from hpcrl.config.compose import compose_config  # noqa: E402

MODEL = "nemotron_super"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


def peak_gb() -> float:
    return torch.cuda.max_memory_allocated() / 1e9 if DEVICE == "cuda" else float("nan")


def compose(backend: str, overrides: list[str]):
    return compose_config(
        [f"model={MODEL}", *MODEL_OVERRIDES, f"trainer={backend}", "algo.kl_coef=0", *overrides]
    )


def mamba_norm_shim() -> str | None:
    """megatron-core 0.19's MambaLayer passes ``eps=config.layernorm_epsilon`` to its norm itself (0.16
    passed none), so the family's ``ModuleSpec(SPNorm, params={"eps": ...})`` gets eps twice
    (``TypeError: SPNorm() got multiple values for keyword argument 'eps'``). Bench-side workaround
    until families/nemotron_h.py takes it: the plain SPNorm there (the config's epsilon is the
    checkpoint's). Returns what it did, for the results."""
    import inspect

    from megatron.core.ssm.mamba_layer import MambaLayer

    if "eps=" not in inspect.getsource(MambaLayer.__init__):
        return None
    from hpcrl.trainer.megatron.families import nemotron_h
    from hpcrl.trainer.megatron.norms import SPNorm

    original = nemotron_h.stack_layers

    def stack_layers(hf: Any, config: Any, te: bool = False) -> dict[str, Any]:
        layers = original(hf, config, te)
        layers["mamba_layer"].submodules.norm = SPNorm
        return layers

    nemotron_h.stack_layers = stack_layers
    return "mamba_layer norm: plain SPNorm (MambaLayer passes eps itself)"


def experts_build_shim() -> str | None:
    """megatron-core 0.19 holds the experts' spec as a ``functools.partial``, which its own
    ``build_module`` cannot take (``AttributeError: 'functools.partial' object has no attribute
    'module'``), and ssm.py's LatentMoELayer rebuilds its experts through ``build_module``. Bench-side
    workaround until ssm.py takes it: ssm's ``build_module`` calls a partial, as 0.19's MoELayer does
    (``self.submodules.experts(num_local_experts, config, pg_collection=...)``)."""
    import functools

    from hpcrl.trainer.megatron import ssm

    original = ssm.build_module
    if getattr(original, "bench_shim", False):
        return None

    def build_module(spec: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(spec, functools.partial):
            return spec(*args, **kwargs)
        return original(spec, *args, **kwargs)

    build_module.bench_shim = True  # type: ignore[attr-defined]
    ssm.build_module = build_module
    return "ssm.LatentMoELayer experts: a 0.19 partial spec called, not given to build_module"


def grouped_mm_cast_shim() -> str | None:
    """Under CUDA autocast Megatron's ``squared_relu`` (``pow``) comes out fp32, so GroupedExperts
    feeds fp32 activations to its second bf16 grouped GEMM (``RuntimeError: expected mat1 and mat2 to
    have the same dtype, but got: float != c10::BFloat16``; Qwen3-MoE's SwiGLU stays bf16). Bench-side
    workaround until experts.py casts to the GEMM's dtype: the activations cast to the weights'."""
    from hpcrl.trainer.megatron import experts

    original = experts._grouped_mm
    if getattr(original, "bench_shim", False):
        return None

    def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        return original(x.to(w.dtype), w, ends)

    grouped_mm.bench_shim = True  # type: ignore[attr-defined]
    experts._grouped_mm = grouped_mm
    return "experts._grouped_mm: input cast to the weights' dtype (fp32 squared ReLU under autocast)"


def router_fp32_shim() -> str | None:
    """Without Transformer Engine megatron-core 0.19's ``RouterGatingLinearFunction`` computes the
    "fp32" router logits with ``torch.mm`` inside an autograd Function, where CUDA autocast turns them
    bf16; its backward then multiplies that bf16 gradient by the fp32 weight (``RuntimeError:
    expected mat1 and mat2 to have the same dtype, but got: c10::BFloat16 != float``). Bench-side
    workaround: the forward with autocast off (the router really in fp32, as the quirk means) and the
    gradient cast to the router dtype."""
    from megatron.core.transformer.moe import moe_utils

    fn = moe_utils.RouterGatingLinearFunction
    if getattr(fn, "bench_shim", False):
        return None
    forward, backward = fn.forward, fn.backward

    def fwd(ctx: Any, *args: Any) -> Any:
        with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            return forward(ctx, *args)

    def bwd(ctx: Any, grad_output: torch.Tensor) -> Any:
        return backward(ctx, grad_output.to(ctx.router_dtype))

    fn.forward, fn.backward, fn.bench_shim = staticmethod(fwd), staticmethod(bwd), True  # type: ignore[attr-defined]
    return "megatron RouterGatingLinearFunction: forward outside autocast, gradient cast to the router dtype"


SHIMS: list[str] = []


def make(backend: str, model_dir: Path, overrides: list[str]):
    from hpcrl.trainer import make_trainer
    from hpcrl.trainer.process_group import free_port

    wanted = os.environ.get("HPCRL_BENCH_SHIMS", "norm,experts,cast,router").split(",")  # "" for none
    if backend == "megatron":
        shims = {
            "norm": mamba_norm_shim,
            "experts": experts_build_shim,
            "cast": grouped_mm_cast_shim,
            "router": router_fp32_shim,
        }
        SHIMS.extend(s for s in (shims[w]() for w in wanted if w in shims) if s)
    cfg = compose(backend, overrides)
    trainer = make_trainer(model_dir, cfg, 0, 1, f"127.0.0.1:{free_port()}", DEVICE)
    if backend == "megatron" and "mixers" in wanted:  # a variant: the torch Mamba mixers compiled too
        for layer in trainer.model.decoder.layers:
            if hasattr(layer, "mixer"):
                layer.mixer.compile()
        SHIMS.append("Mamba mixers compiled (torch.compile per TorchMambaMixer)")
    return cfg, trainer


# -- speed --------------------------------------------------------------------------------------------
def speed_one(backend: str, model_dir: Path, batch: int, seq: int, overrides: list[str], iters: int) -> dict:
    from megatron_bench import grpo_batch

    started = time.perf_counter()
    cfg, trainer = make(backend, model_dir, [f"trainer.micro_batch_size={batch}",
                                             "trainer.activation_checkpointing=false", *overrides])  # fmt: skip
    built = time.perf_counter() - started
    b = grpo_batch(batch, seq)
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train_step(b, None)
    sync()
    first = time.perf_counter() - start  # compilation included
    t = timed(lambda: trainer.train_step(b, None), 1, iters)
    out = {"tokens_per_s": batch * seq / t, "step_s": t, "peak_mem_gb": peak_gb(), "first_step_s": first,
           "build_s": built, "shims": SHIMS}  # fmt: skip
    try:
        out["layers"] = time_layers(trainer, backend, cfg, batch, seq)
    except Exception as exc:  # the step's figures stand without the layer timing
        out["layers_error"] = f"{type(exc).__name__}: {exc}"[:400]
    return out


def decoder_layers(trainer: Any, backend: str) -> tuple[list[Any], str]:
    if backend == "megatron":
        return list(trainer.model.decoder.layers), trainer.shape.pattern
    model = trainer.model
    return list(model.model.layers), str(model.config.hybrid_override_pattern)


def layer_params(layer: Any, cfg: Any, kind: str) -> tuple[float, float]:
    """(total, active) parameters of one layer (an E layer's routed experts count top-k / E)."""
    m = cfg.model
    total = expert = 0.0
    for name, p in layer.named_parameters():
        n = float(p.numel())  # a DTensor's numel is the whole tensor's
        total += n
        if "experts" in name and "shared" not in name:
            expert += n
    active = total - expert + expert * m.experts_per_token / max(m.num_experts, 1)
    return total, active


def time_layers(trainer: Any, backend: str, cfg: Any, batch: int, seq: int) -> dict:
    """One layer of each kind alone: forward and forward + backward under bf16 autocast, fp32 input
    (the residual stream of an fp32-master model), MFU on 6 N_active (+ 12 h s for attention)."""
    layers, pattern = decoder_layers(trainer, backend)
    h = cfg.model.hidden_size
    results: dict = {}
    for kind in dict.fromkeys(pattern):
        i = pattern.index(kind)
        layer = layers[i]
        shape = (seq, batch, h) if backend == "megatron" else (batch, seq, h)
        x = torch.randn(*shape, device=DEVICE, requires_grad=True)
        grad = torch.randn(*shape, device=DEVICE)

        def fwd(layer=layer, x=x) -> torch.Tensor:
            with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda"):
                out = layer(x, attention_mask=None)
            return out[0] if isinstance(out, tuple) else out

        def fwd_bwd(fwd=fwd, grad=grad) -> None:
            torch.autograd.backward(fwd(), grad)

        with torch.no_grad():
            t_fwd = timed(fwd, 1, 3)
        t = timed(fwd_bwd, 1, 3)
        total, active = layer_params(layer, cfg, kind)
        flops = 6 * active + (12 * h * seq if kind == "*" else 0)
        results[f"{kind} (layer {i})"] = {"fwd_bwd_ms": 1e3 * t, "fwd_ms": 1e3 * t_fwd, "params": total,
                                          "active_params": active,
                                          "mfu": batch * seq * flops / t / DATASHEET_TFLOPS / 1e12}  # fmt: skip
        x.grad = None
        for p in layer.parameters():
            p.grad = None
    if "M" in pattern:  # the SSD scan alone, at an M layer's shape (fp32, as both mixers run it)
        try:
            results["ssd_scan alone (M shape)"] = time_scan(cfg, batch, seq)
        except Exception as exc:
            results["ssd_scan alone (M shape)"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return results


def time_scan(cfg: Any, batch: int, seq: int) -> dict:
    from hpcrl.trainer.megatron.ssm import ssd_scan

    hy = cfg.model.hybrid
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, device=DEVICE, generator=g).requires_grad_()

    x, b, c = (
        r(batch, seq, hy.mamba_heads, hy.mamba_head_dim),
        r(batch, seq, hy.mamba_groups, hy.mamba_state),
        r(batch, seq, hy.mamba_groups, hy.mamba_state),
    )
    dt = (torch.rand(batch, seq, hy.mamba_heads, device=DEVICE, generator=g) * 0.1).requires_grad_()
    a = -torch.rand(hy.mamba_heads, device=DEVICE, generator=g) - 0.5
    y = ssd_scan(x, dt, a, b, c, 128)
    grad = torch.randn_like(y)

    def fwd_bwd() -> None:
        torch.autograd.backward(ssd_scan(x, dt, a, b, c, 128), grad)

    with torch.no_grad():
        t_fwd = timed(lambda: ssd_scan(x, dt, a, b, c, 128), 1, 3)
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = timed(fwd_bwd, 1, 3)
    return {"fwd_bwd_ms": 1e3 * t, "fwd_ms": 1e3 * t_fwd, "peak_mem_gb_during": peak_gb()}


# -- parity -------------------------------------------------------------------------------------------
def parity_one(backend: str, model_dir: Path, n: int, seq: int, out: Path, overrides: list[str]) -> None:
    from gemma_gpu_parity import batch as parity_batch

    cfg, trainer = make(backend, model_dir, ["trainer.precision=float32", f"trainer.micro_batch_size={n}",
                                             "trainer.grad_clip=1e12", *overrides])  # fmt: skip
    margins = router_margins(trainer, cfg) if backend == "fsdp" else None
    b = parity_batch(n, seq)
    logp = trainer.logprobs(b)
    metrics = trainer.train_step(b, None)
    if backend == "megatron":
        grads = trainer.export_weights(grads=True)
    else:
        from hpcrl.trainer.fsdp import checkpoint_names

        full = {k: getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for k, p in trainer.model.named_parameters()
                if p.grad is not None}  # fmt: skip
        grads = checkpoint_names(trainer.model, full)
    norms = {k: float(g.double().norm()) for k, g in grads.items()}
    torch.save({"logp": logp.cpu(), "mask": b.loss_mask.bool(), "metrics": metrics, "grad_norms": norms,
                "router_margins": margins}, out)  # fmt: skip


def router_margins(trainer: Any, cfg: Any) -> dict:
    """Per HF router, over the tokens of the logprobs pass: the smallest gap between the k-th and the
    (k+1)-th selection score (sigmoid + correction bias). A gap within float error lets two
    implementations pick different experts for that token."""
    k = cfg.model.experts_per_token
    found: dict = {}

    def hook(module: Any, _inputs: Any, output: Any, name: str) -> None:
        logits = output[0].detach().float()
        scores = logits.sigmoid() + module.e_score_correction_bias.float()
        top = scores.topk(k + 1, dim=-1).values
        gap = top[:, k - 1] - top[:, k]
        found.setdefault(name, []).append({"min_gap": float(gap.min()), "tokens_below_1e-6": int((gap < 1e-6).sum()),
                                           "tokens_below_1e-5": int((gap < 1e-5).sum()), "tokens": gap.numel()})  # fmt: skip

    for name, m in trainer.model.named_modules():
        if hasattr(m, "e_score_correction_bias"):
            m.register_forward_hook(lambda mod, i, o, name=name: hook(mod, i, o, name))
    return found


def compare(runs: dict) -> dict:
    ref = runs.get("fsdp")
    result = {}
    for name, run in runs.items():
        row: dict = {k: run["metrics"].get(k) for k in ("loss", "entropy", "grad_norm")}
        names = (ref or run)["grad_norms"].keys()
        row["grad_norm_float64"] = sum(run["grad_norms"].get(n, 0.0) ** 2 for n in names) ** 0.5
        logp = run["logp"][run["mask"][:, : run["logp"].shape[1]]]
        row["completion_logp_mean"] = float(logp.mean())
        if ref is not None and run is not ref:
            mask = ref["mask"][:, : run["logp"].shape[1]]
            diff = (run["logp"] - ref["logp"])[mask].abs()
            row["max_logp_diff_vs_fsdp"] = float(diff.max())
            row["mean_logp_diff_vs_fsdp"] = float(diff.mean())
            common = set(run["grad_norms"]) & set(ref["grad_norms"])
            row["grad_names"] = {"both": len(common), "megatron_only": sorted(set(run["grad_norms"]) - common)[:8],
                                 "fsdp_only": sorted(set(ref["grad_norms"]) - common)[:8]}  # fmt: skip
            rel = {
                n: abs(run["grad_norms"][n] - ref["grad_norms"][n]) / max(ref["grad_norms"][n], 1e-30)
                for n in common
            }
            row["max_rel_grad_norm_diff"] = max(rel.values()) if rel else None
            worst = sorted(rel, key=lambda n: -rel[n])[:8]
            row["worst_grad_norms (megatron, fsdp, rel)"] = {
                n: (run["grad_norms"][n], ref["grad_norms"][n], rel[n]) for n in worst
            }
        if run.get("router_margins"):
            row["router_margins"] = run["router_margins"]
        result[name] = row
    return result


# -- the driver -----------------------------------------------------------------------------------------
def isolated(args: list[str], timeout: int, env: dict | None = None) -> dict:
    """One configuration per process (Megatron's parallel state and the fsdp group are global)."""
    try:
        done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout,
                              env=env)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        tail = portable((exc.stderr or b"").decode() if isinstance(exc.stderr, bytes) else exc.stderr or "")
        return {"error": f"timed out after {timeout} s", "stderr_tail": tail.strip().splitlines()[-30:]}
    for line in done.stdout.splitlines()[::-1]:
        if line.startswith("{"):
            return json.loads(line)
    lines = portable(done.stderr).strip().splitlines()
    errors = [line for line in lines if ("Error" in line or "error" in line) and not line.startswith(" ")]
    return {"error": (errors or lines or [str(done.returncode)])[-1], "stderr_tail": lines[-40:]}


def plan_estimate(backend: str, batch: int, seq: int) -> dict:
    from hpcrl.plan.planner import plan_from_overrides

    p = plan_from_overrides([f"model={MODEL}", *MODEL_OVERRIDES, f"trainer={backend}", f"trainer.micro_batch_size={batch}",
                             f"trainer.max_seq_len={seq}", "trainer.activation_checkpointing=false", "algo.kl_coef=0"])  # fmt: skip
    t = p.memory.train
    return {k: round(getattr(t, k), 2) for k in ("weights", "grads", "optimizer", "activations", "logits", "overhead",
                                                   "peak")}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--parts", default="speed,parity")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--parity-batch", type=int, default=2)
    p.add_argument("--parity-seq", type=int, default=1024)
    p.add_argument("--backends", default="fsdp,megatron")
    p.add_argument("--skip-hf", action="store_true", help="no HF + SDPA baseline row")
    p.add_argument("--speed-backends", default="", help="speed rows (default: --backends)")
    p.add_argument("--row-timeout", type=int, default=300)
    p.add_argument("--mixers-row", action="store_true", help="also megatron with its Mamba mixers compiled")
    p.add_argument("--model-dir", default="", help="reuse a random checkpoint (else one is built)")
    p.add_argument("--one", nargs=3, metavar=("PART", "BACKEND", "MODEL_DIR"))
    p.add_argument("--out", default="", help="for --one parity")
    p.add_argument("--override", action="append", default=[])
    a = p.parse_args()
    if a.one:
        part, backend, model_dir = a.one
        if part == "speed":
            print(json.dumps(speed_one(backend, Path(model_dir), a.batch, a.seq, a.override, a.iters)))
        else:
            parity_one(backend, Path(model_dir), a.parity_batch, a.parity_seq, Path(a.out), a.override)
            print("{}")
        return 0

    cfg = compose_config([f"model={MODEL}", *MODEL_OVERRIDES])
    m = cfg.model
    counts = m.param_counts()
    started = time.perf_counter()
    model_dir = Path(a.model_dir) if a.model_dir else make_model_dir(cfg)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    results: dict = {"model": MODEL, "model_overrides": MODEL_OVERRIDES, "pattern": m.hybrid.pattern,
                     "params": counts.total, "active_params": counts.active,
                     "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "torch": torch.__version__,
                     "model_dir_s": time.perf_counter() - started}  # fmt: skip
    from importlib.metadata import PackageNotFoundError, version

    for pkg in ("megatron-core", "transformers"):
        try:
            results[pkg] = version(pkg)
        except PackageNotFoundError:
            results[pkg] = "not installed"
    out_dir = os.environ.get("OUT")

    def save() -> None:
        if out_dir:
            Path(out_dir, "nemotron_gpu.json").write_text(json.dumps(results, indent=1))

    parts, backends = a.parts.split(","), a.backends.split(",")
    common = ["--batch", str(a.batch), "--seq", str(a.seq), "--iters", str(a.iters)]
    eager: dict[str, list[str]] = {b: [] for b in backends}  # what parity runs with: what worked here
    if "speed" in parts:
        flops = train_flops_per_token(cfg, a.seq)
        rows: dict = {}
        results.update(flops_per_token=flops, shape=f"{a.batch}x{a.seq}", rows=rows)
        if DEVICE == "cuda" and not a.skip_hf:
            try:
                rows["hf_sdpa_baseline"] = bench_train_baseline(model_dir, a.batch, a.seq)
            except Exception as exc:
                rows["hf_sdpa_baseline"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            torch.cuda.empty_cache()
            save()
        for backend in a.speed_backends.split(",") if a.speed_backends else backends:
            row = isolated(["--one", "speed", backend, str(model_dir), *common], a.row_timeout)
            rows[backend] = row
            row["plan_estimate_gb"] = plan_estimate(backend, a.batch, a.seq)
            if "error" in row:
                eager[backend] = ["--override", "trainer.compile=false"]
                rows[f"{backend} trainer.compile=false"] = isolated(
                    ["--one", "speed", backend, str(model_dir), *common, *eager[backend]], a.row_timeout
                )
            save()
        if "megatron" in backends and a.mixers_row:
            env = {**os.environ, "HPCRL_BENCH_SHIMS": "norm,experts,cast,router,mixers"}
            rows["megatron, Mamba mixers compiled (bench shim)"] = isolated(
                ["--one", "speed", "megatron", str(model_dir), *common, *eager["megatron"]],
                a.row_timeout,
                env,
            )
            save()
        base = rows.get("hf_sdpa_baseline", {}).get("tokens_per_s")
        for row in rows.values():
            if "tokens_per_s" in row:
                row["mfu_datasheet"] = row["tokens_per_s"] * flops / DATASHEET_TFLOPS / 1e12
                row["x_hf"] = row["tokens_per_s"] / base if base else None
        save()
    if "parity" in parts:
        runs, errors = {}, {}
        for backend in backends:
            out = model_dir.parent / f"parity_{backend}.pt"
            done = isolated(["--one", "parity", backend, str(model_dir), "--out", str(out), "--parity-batch",
                             str(a.parity_batch), "--parity-seq", str(a.parity_seq), *eager[backend]], a.row_timeout)  # fmt: skip
            if "error" in done:
                errors[backend] = done
            else:
                runs[backend] = torch.load(out)
        results["parity"] = {"batch": a.parity_batch, "seq": a.parity_seq, "precision": "float32",
                             "errors": errors, "runs": compare(runs)}  # fmt: skip
        save()
    print(json.dumps(results, indent=1, default=str))
    rows = results.get("rows", {})
    if rows:
        print(
            f"\n{'row ' + results['shape']:34s} {'tok/s':>8s} {'MFU':>6s} {'peak GB':>8s} {'plan GB':>8s} {'x HF':>6s}"
        )
        for name, r in rows.items():
            if "tokens_per_s" not in r:
                print(f"{name:34s} {r.get('error', '?')[:90]}")
                continue
            plan = r.get("plan_estimate_gb", {}).get("peak", float("nan"))
            print(f"{name:34s} {r['tokens_per_s']:8.0f} {100 * r['mfu_datasheet']:5.1f}% {r['peak_mem_gb']:8.1f} "
                  f"{plan:8.1f} {r.get('x_hf') or float('nan'):6.2f}")  # fmt: skip
            for kind, lr in r.get("layers", {}).items():
                mfu = f"{100 * lr['mfu']:5.1f}%" if "mfu" in lr else ""
                if "fwd_bwd_ms" not in lr:
                    print(f"    {kind:30s} {lr}")
                    continue
                print(f"    {kind:30s} fwd+bwd {lr['fwd_bwd_ms']:8.1f} ms  fwd {lr['fwd_ms']:7.1f} ms  {mfu}")
    for name, r in results.get("parity", {}).get("runs", {}).items():
        print(
            "parity",
            name,
            {
                k: v
                for k, v in r.items()
                if k not in ("router_margins", "worst_grad_norms (megatron, fsdp, rel)")
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
