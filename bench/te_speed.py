"""bench/te_gpu.py's speed part: Super's widths at 8 layers (bench/kernels_gpu.py's config) built as
the trainer builds them (spec.transformer_config, model.build_model) with the local or Transformer
Engine layers, random weights (the same both sides), forward + backward timed per layer kind and for
the whole model under bf16 autocast; and what a build holds (``modules_of``)."""

from __future__ import annotations

from typing import Any

import torch
from kernels_gpu import timed  # the same warm-up and synchronised timing as the kernels rows

PATTERN = "MEM*EMEM"
"""Super's layers 4..11: every kind it has."""


def modules_of(model: torch.nn.Module) -> dict:
    """What the build really holds: TE modules by class, the experts' class."""
    te: dict[str, int] = {}
    for m in model.modules():
        if type(m).__module__.startswith(("transformer_engine", "megatron.core.extensions")):
            te[type(m).__name__] = te.get(type(m).__name__, 0) + 1
    experts = sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith(".experts")})
    return {"te_modules": te, "experts": experts}


def super_model(side: str, experts: int, tiny: bool, device: str) -> tuple[Any, Any]:
    """Super's widths at 8 layers (bench/kernels_gpu.py's config), built as the trainer builds it
    (spec.transformer_config, model.build_model) with ``side``'s layers, random weights."""
    from kernels_gpu import super_config

    from hpcrl.config.compose import compose_config
    from hpcrl.trainer.megatron import compat
    from hpcrl.trainer.megatron.model import build_model, init_parallel, model_shape
    from hpcrl.trainer.megatron.spec import family_of, transformer_config
    from hpcrl.trainer.process_group import collective_backend, free_port, init_process_group

    compat.prepare(device)  # as the trainer does first (on a CPU: megatron-core's CUDA calls made safe)
    hf = super_config(PATTERN, experts, tiny)
    fam = family_of(hf)
    t = compose_config(["model=tiny", "trainer=megatron", "trainer.activation_checkpointing=false"]).trainer
    par = t.parallel(1)
    init_process_group(0, 1, f"127.0.0.1:{free_port()}", collective_backend(device))
    init_parallel(par, True, 0)
    te = side == "te"
    config = transformer_config(hf, fam, t, par, device=device, te=te)
    model = build_model(
        config, hf, fam, model_shape(hf, fam, 1, te), tied=False, compute_dtype=torch.bfloat16,
        device=torch.device(device), hidden_output=False, te=te,
    )  # fmt: skip
    randomize(model)
    return model.train(), hf


def randomize(model: torch.nn.Module) -> None:
    """Weights a checkpoint could hold (the build leaves them uninitialised): norms 1, Mamba's A over
    [1, 16], dt over its range, D 1, correction bias 0, the rest N(0, 0.02); the same seed both sides."""
    from hpcrl.trainer.megatron.weights import expert_name

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, b in model.named_buffers():  # the router's others are its statistics, built as zeros
            if name.endswith("expert_bias"):
                b.zero_()
        for name, p in sorted(model.named_parameters(), key=lambda np: expert_name(np[0])):
            if name.endswith(("norm.weight", "layernorm.weight", "mixer.D")):
                p.fill_(1.0)
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.linspace(1, 16, p.numel())))
            elif name.endswith("dt_bias"):
                p.copy_(torch.linspace(-6.0, 1.0, p.numel()))
            elif name.endswith("conv1d.bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def bench_side(side: str, device: str, batch: int, seq: int, experts: int, tiny: bool, iters: int) -> dict:
    model, hf = super_model(side, experts, tiny, device)
    dev = device.split(":")[0]
    row: dict = {**modules_of(model)}
    for kind in dict.fromkeys(PATTERN):
        layer = model.decoder.layers[PATTERN.index(kind)]
        x = torch.randn(seq, batch, hf.hidden_size, device=device, requires_grad=True)
        grad = torch.randn_like(x)

        def fwd_bwd(layer: Any = layer, x: torch.Tensor = x, grad: torch.Tensor = grad) -> None:
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                out = layer(x, attention_mask=None)
            torch.autograd.backward(out[0] if isinstance(out, tuple) else out, grad)

        row[f"{kind} ms"] = 1e3 * timed(fwd_bwd, 1, iters)
        print(f"bench {side} {kind} ms: {row[f'{kind} ms']:.2f}", flush=True)
        if kind == "E":  # the experts module alone: TE's grouped GEMM or torch's grouped_mm
            row["experts ms"] = 1e3 * timed(experts_alone(layer, fwd_bwd, dev), 1, iters)
            print(f"bench {side} experts ms: {row['experts ms']:.2f}", flush=True)
    model.zero_grad(set_to_none=True)
    ids = torch.randint(3, hf.vocab_size, (batch, seq), device=device)
    pos = torch.arange(seq, device=device).expand(batch, seq)

    def step() -> None:
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            loss = model(ids, pos, None, labels=ids)
        loss.float().mean().backward()

    t = timed(step, 1, iters)
    row.update(step_s=t, tokens_per_s=batch * seq / t)
    if dev == "cuda":
        row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        torch.cuda.reset_peak_memory_stats()
    return row  # the model goes with this frame


def experts_alone(layer: Any, fwd_bwd: Any, dev: str) -> Any:
    """Forward + backward of the MoE layer's experts module by itself, on the inputs it saw in one
    ``fwd_bwd`` of the whole layer (hidden states, tokens per expert, probabilities; a hook keeps them)."""
    experts = next(m for n, m in layer.named_modules() if n.endswith(".experts"))
    seen: dict[str, Any] = {}

    def keep(module: Any, args: tuple, kwargs: dict) -> None:
        seen.setdefault("args", tuple(a.detach() if torch.is_tensor(a) else a for a in args))
        seen.setdefault("kwargs", kwargs)

    hook = experts.register_forward_pre_hook(keep, with_kwargs=True)
    fwd_bwd()
    hook.remove()
    hidden, *rest = seen["args"]
    hidden = hidden.requires_grad_()

    def run() -> None:
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            out = experts(hidden, *rest, **seen["kwargs"])
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.backward(out, torch.ones_like(out))

    return run
