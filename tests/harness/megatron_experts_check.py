"""One rank (under torchrun): the Qwen3-MoE model's first MoE layer's experts run by hpcrl's grouped
path, by Megatron's per-expert loop (fp32; its linear layers' backward is CUDA-only under autocast)
and by a plain per-expert loop of F.linear (fp32 and under bf16 autocast, the path GPUs take) on the
same routed tokens (uneven counts, one expert with none); outputs and gradients go to argv[2] for
tests/test_megatron.py to compare.

    python -m torch.distributed.run --nproc_per_node=1 tests/harness/megatron_experts_check.py MODEL_DIR OUT
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from hpcrl.config.compose import compose_config


def plain_loop(
    experts, x: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor
) -> tuple[torch.Tensor, None]:
    """Each expert's SwiGLU MLP with F.linear (autocast casts it), the router's probability applied
    after the GLU as Megatron's MLP does."""
    outs = []
    for expert, xi, pi in zip(
        experts.local_experts, x.split(counts.tolist()), probs.split(counts.tolist()), strict=True
    ):
        gate, up = torch.nn.functional.linear(xi, expert.linear_fc1.weight).chunk(2, dim=-1)
        a = torch.nn.functional.silu(gate) * up
        outs.append(torch.nn.functional.linear((a * pi[:, None]).to(a.dtype), expert.linear_fc2.weight))
    return torch.cat(outs), None


def run(experts, kernel: str, x: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor, bf16: bool) -> dict:
    from hpcrl.trainer.megatron import experts as grouped

    grouped.KERNEL = kernel
    for p in experts.parameters():
        p.grad = None
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out, _ = plain_loop(experts, x, counts, probs) if kernel == "plain" else experts(x, counts, probs)
    (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = {n: p.grad.clone() for n, p in experts.named_parameters()}
    return {"out": out.detach().float(), "dtype": str(out.dtype), "x_grad": x.grad.clone(), "grads": grads}


def main() -> None:
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    from hpcrl.trainer import make_trainer

    torch.set_num_threads(1)
    master = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', 29500)}"
    cfg = compose_config(
        ["model=tiny", "trainer=megatron", "trainer.moe_aux_loss_coeff=0", "trainer.router_dtype=fp32"]
    )
    trainer = make_trainer(model_dir, cfg, 0, 1, master, "cpu")
    experts = trainer.model.decoder.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 9, 2])  # expert 1 gets no token
    x = torch.randn(int(counts.sum()), experts.config.hidden_size, generator=gen)
    probs = torch.rand(len(x), generator=gen)
    result = {"module": type(experts).__name__}
    for name, kernel, bf16 in (
        ("grouped fp32", "grouped", False),
        ("sequential fp32", "sequential", False),
        ("plain fp32", "plain", False),
        ("grouped bf16", "grouped", True),
        ("plain bf16", "plain", True),
    ):
        result[name] = run(experts, kernel, x, counts, probs, bf16)
    result["router"] = router_under_autocast(trainer.model.decoder.layers[0].mlp.router, x)
    torch.save(result, out)
    torch.distributed.destroy_process_group()


def router_under_autocast(router: torch.nn.Module, x: torch.Tensor) -> dict:
    """The fp32 router's gating under bf16 autocast: its logits' dtype, and its weight gradient."""
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = router.gating(x.to(torch.bfloat16))
    logits.float().sum().backward()
    return {
        "module": type(router).__name__,
        "dtype": str(logits.dtype),
        "weight_grad": router.weight.grad is not None,
    }


if __name__ == "__main__":
    main()
