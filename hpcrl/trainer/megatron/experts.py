"""MoE experts as two grouped GEMMs over every local expert at once.

Megatron's local spec (no Transformer Engine) runs a layer's experts as ``SequentialMLP``: one small
GEMM pair per expert, 128 launches per layer for Qwen3-30B-A3B (one H200, 4 layers of it: 18.2k
tokens/s against the fsdp backend's 83.8k with Hugging Face's grouped experts; bench/results/README.md).
``GroupedExperts`` keeps SequentialMLP's parameters — one MLP per local expert, the names the weight
mapping, EP relocation and expert-TP sharding already know — and computes the layer with torch's
grouped_mm over the stacked weights: gate/up, GLU (or a plain activation), the router's probabilities, down. Layouts it does
not express (bias, probabilities applied on the input, fp8) keep SequentialMLP's
loop. Imports Megatron-core: imported only where a Megatron model is built (``spec.layer_spec``).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter

from hpcrl.trainer.megatron.spec_utils import submodules_of, with_module

KERNEL = "grouped"
"""``"grouped"`` (the default) or ``"sequential"`` (Megatron's loop; benches compare the two)."""


class GroupedExperts(SequentialMLP):
    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        cfg = self.config
        if (
            KERNEL != "grouped"
            or cfg.moe_apply_probs_on_input
            or getattr(cfg, "fp8", None)
            or getattr(cfg, "fp4", None)
            or cfg.add_bias_linear
            or getattr(cfg, "activation_func_clamp_value", None) is not None
            or getattr(cfg, "glu_linear_offset", 0.0)
            or getattr(cfg, "use_te_activation_func", False)
        ):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        # grouped_mm is not autocast-aware: cast as autocast would for a linear layer
        dtype = (
            torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        )
        w1 = torch.stack([e.linear_fc1.weight for e in self.local_experts]).to(dtype)  # [E, 2f or f, h]
        w2 = torch.stack([e.linear_fc2.weight for e in self.local_experts]).to(dtype)  # [E, h, f]
        ends = torch.cumsum(torch.as_tensor(tokens_per_expert, device=x.device), 0).to(torch.int32)
        h = _grouped_mm(x.to(dtype), w1.transpose(1, 2), ends)
        if cfg.gated_linear_unit:
            gate, up = h.chunk(2, dim=-1)
            a = cfg.activation_func(gate) * up
        else:  # Nemotron-H: squared ReLU, no gate
            a = cfg.activation_func(h)
        # as Megatron's MLP applies per_token_scale; in the GEMM's dtype (under CUDA autocast squared
        # ReLU's pow comes out fp32)
        a = (a * permuted_probs.unsqueeze(-1)).to(dtype)
        return _grouped_mm(a, w2.transpose(1, 2), ends), None


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    out = torch._grouped_mm(x, w, offs=ends)
    if out.requires_grad:  # its backward refuses an expanded (stride-0) gradient
        out.register_hook(lambda g: g.contiguous())
    return out


def use_grouped_experts(mlp: Any) -> None:
    """GroupedExperts in the experts slot of an MoE layer's spec, in place (a dense MLP's spec has no
    such slot and stays as it is)."""
    subs = submodules_of(mlp)
    if getattr(subs, "experts", None) is not None:
        subs.experts = with_module(subs.experts, GroupedExperts)


class Fp32Router(TopKRouter):
    """Megatron's top-k router with its gating GEMM computed here, by torch, in one dtype for input
    and weight: ``moe_router_dtype`` (fp32, the MoE quirk), else the input's (under autocast: the
    autocast dtype, as megatron-core's torch.mm ran). megatron-core's own gating takes TE's GEMM
    wherever Transformer Engine imports, which refuses mixed operands: hpcrl keeps fp32 master weights
    under bf16 autocast, and bf16 hidden states against fp32 router weights failed in cuBLAS
    ("unsupported value or parameter", then "Unable to find suitable cuBLAS GEMM algorithm" for
    Qwen3-MoE's default router dtype; one H100, TE 2.20.2, sessions 28-29). Without TE its torch.mm
    inside an autograd Function was turned bf16 by CUDA autocast, and the backward then mixed bf16
    and fp32 ("expected mat1 and mat2 to have the same dtype", one H200, megatron-core 0.19.2). The
    numbers are the torch path's (both operands cast to the router's dtype); autograd keeps the cast
    input (fp32 under a fp32 router) where megatron-core's Function kept the bf16 one."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype or "")
        device = input.device.type
        if dtype is None:
            on = torch.is_autocast_enabled(device)
            dtype = torch.get_autocast_dtype(device) if on else input.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        with torch.autocast(device, enabled=False):
            return torch.nn.functional.linear(input.to(dtype), self.weight.to(dtype), bias)


def use_fp32_router(mlp: Any) -> None:
    """Fp32Router in the router slot of an MoE layer's spec, in place (none: the spec is kept)."""
    subs = submodules_of(mlp)
    if getattr(subs, "router", None) is not None:
        subs.router = Fp32Router
