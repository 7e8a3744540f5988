"""Nemotron-H (Nemotron 3 Super/Nano): megatron-core's hybrid model — one layer per symbol of the
checkpoint's ``hybrid_override_pattern``: ``M`` Mamba-2, ``*`` attention (GQA, no RoPE), ``E`` LatentMoE
(sigmoid router with a correction bias, top-k renormalised and scaled, experts in a latent width, a
shared expert at full width), ``-`` dense MLP; squared-ReLU MLPs throughout.

The layers are megatron-core's (MambaLayer, TransformerLayer, MoELayer), with the pieces that need
mamba_ssm or Transformer Engine taken from ssm.py (``TorchMambaMixer``, ``LatentMoELayer``). The router
is kept as the RL recipes keep it (NeMo RL's Nemotron configs): fp32, no load-balancing loss, the
correction bias (Megatron's ``expert_bias``) loaded and never updated.

With Transformer Engine (``te``: spec.uses_local_spec decides) the same stack takes TE's linears for
attention's linear_qkv / linear_proj, the dense MLP's and shared expert's fc1 / fc2 and the Mamba
mixer's in_proj / out_proj, and runs the routed experts through TE's grouped GEMM (megatron's
``TEGroupedMLP``: parameters ``weight<j>`` per local expert, named as SequentialMLP's at one boundary,
weights.expert_name); the latent projections are MoELayer's own (TE linears in "duplicated" mode, under
sequence parallel marked for the TP sum as ``ReplicatedLinear`` is). Kept from the local build, so
every other weight name is the same: the norms (SPNorm: TE's fused norm+linear would rename them and
normalise in its own precision), the core attention (SDPAttention: packed rows and context parallel
are hpcrl's; on the GPU torch's SDPA already runs a flash kernel, and attention is one layer in eight
of Super), and the mixer's gated group norm and scan (trainer/kernels.py picks mamba_ssm's).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from hpcrl.trainer.config import MegatronTrainerConfig
from hpcrl.trainer.megatron.families.base import GPTFamily

SUPPORTED = {
    "mamba_hidden_act": "silu",
    "mlp_hidden_act": "relu2",
    "use_conv_bias": True,
    "use_bias": False,
    "mlp_bias": False,
    "norm_topk_prob": True,  # Megatron renormalises top-k sigmoid scores whenever k > 1
    "n_group": 1,
    "topk_group": 1,
}
"""Config values this build expresses; a checkpoint with others is refused by name."""


class NemotronH(GPTFamily):
    model_types = ("nemotron_h",)
    hybrid = True
    pad_row_untrained = False  # NemotronH's embedding has no padding_idx: the pad row trains there too
    buffers = ("expert_bias",)  # the router's correction bias (``e_score_correction_bias``)

    def check_supported(self, hf: Any) -> None:
        for key, want in SUPPORTED.items():
            have = getattr(hf, key, want)
            if key == "norm_topk_prob" and int(hf.num_experts_per_tok) == 1:
                continue
            if have != want:
                raise ValueError(
                    f"trainer=megatron builds Nemotron-H with {key}={want!r} (this checkpoint: {have!r}); "
                    "use trainer=fsdp"
                )
        if set(pattern(hf)) - set("M*E-"):
            raise ValueError(
                f"trainer=megatron builds Nemotron-H layers M * E - (pattern {pattern(hf)!r}); use trainer=fsdp"
            )

    def config_fields(self, hf: Any) -> dict[str, Any]:
        from megatron.core.activations import squared_relu

        return {
            "num_layers": len(pattern(hf)),
            "hidden_size": hf.hidden_size,
            "num_attention_heads": hf.num_attention_heads,
            "num_query_groups": hf.num_key_value_heads,
            "kv_channels": hf.head_dim,
            "normalization": "RMSNorm",
            "add_bias_linear": False,
            "qk_layernorm": False,
            "ffn_hidden_size": int(
                getattr(hf, "intermediate_size", 0) or hf.moe_shared_expert_intermediate_size
            ),
            "layernorm_epsilon": hf.layer_norm_epsilon,
            "gated_linear_unit": False,
            "activation_func": squared_relu,
            "bias_activation_fusion": False,  # Megatron fuses GLU activations only
            "add_qkv_bias": bool(getattr(hf, "attention_bias", False)),
            "is_hybrid_model": True,
            "mamba_num_heads": hf.mamba_num_heads,
            "mamba_head_dim": hf.mamba_head_dim,
            "mamba_state_dim": hf.ssm_state_size,
            "mamba_num_groups": hf.n_groups,
        }

    def num_experts(self, hf: Any) -> int:
        return int(hf.n_routed_experts) if "E" in pattern(hf) else 0

    def routing(self, hf: Any) -> tuple[int, bool]:
        return int(hf.num_experts_per_tok), False  # sigmoid scores: no softmax either side of the top-k

    def moe_fields(self, hf: Any, trainer: MegatronTrainerConfig) -> dict[str, Any]:
        fields = super().moe_fields(hf, trainer)
        if not fields:
            return {}
        shared = int(hf.n_shared_experts or 0) * int(hf.moe_shared_expert_intermediate_size)
        return {
            **fields,
            "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            "moe_router_bias_update_rate": 0.0,  # the correction bias stays as the checkpoint has it
            "moe_router_topk_scaling_factor": float(hf.routed_scaling_factor),
            "moe_router_dtype": trainer.router_dtype or "fp32",
            "moe_shared_expert_intermediate_size": shared or None,
            "moe_shared_expert_overlap": False,  # refused with latent projections in training
            "moe_latent_size": getattr(hf, "moe_latent_size", None) or None,
        }

    def rope(self, hf: Any) -> dict[str, Any]:
        return {}

    def shape_fields(self, hf: Any) -> dict[str, Any]:
        inner = hf.mamba_num_heads * hf.mamba_head_dim
        return {"pattern": pattern(hf), "mamba": (inner, hf.n_groups * hf.ssm_state_size, hf.mamba_num_heads)}

    def stack_layers(self, hf: Any, config: Any, te: bool = False) -> dict[str, Any]:
        return stack_layers(hf, config, te)


def pattern(hf: Any) -> str:
    """The layer pattern (transformers keeps ``hybrid_override_pattern`` as a property of its layer types)."""
    return str(hf.hybrid_override_pattern)


@functools.cache  # one class per layer class: every build (policy, reference) shares it
def recomputed(cls: type) -> type:
    """``cls`` whose training forward keeps only its input and runs again in the backward (full
    recompute, one layer at a time, as ``trainer.activation_checkpointing`` asks): megatron-core's
    hybrid stack (0.16) calls its layers without recompute."""

    class Recomputed(cls):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            if not (self.training and torch.is_grad_enabled()):
                return super().forward(*args, **kwargs)
            return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)

    Recomputed.__name__ = Recomputed.__qualname__ = f"Recomputed{cls.__name__}"
    return Recomputed


def stack_layers(hf: Any, config: Any, te: bool = False) -> dict[str, Any]:
    """One spec per layer kind; ``te``: with Transformer Engine's linears and grouped experts (module
    docstring)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from hpcrl.trainer.megatron.experts import use_fp32_router
    from hpcrl.trainer.megatron.norms import SPNorm
    from hpcrl.trainer.megatron.spec_utils import with_module
    from hpcrl.trainer.megatron.ssm import LatentMoELayer, TorchMambaMixer

    # MambaLayer builds its norm without the epsilon (TransformerLayer passes the config's)
    full = config.recompute_granularity == "full"
    mamba_layer, layer = (
        (recomputed(MambaLayer), recomputed(TransformerLayer)) if full else (MambaLayer, TransformerLayer)
    )
    linears = te_linears() if te else None
    mixer = ModuleSpec(
        module=TorchMambaMixer,
        params={
            "chunk_size": hf.chunk_size,
            "conv_kernel": hf.conv_kernel,
            "dt_min": hf.time_step_min,
            "linears": linears,
        },
    )
    attention, dense_mlp = attention_and_mlp(linears)
    layers: dict[str, Any] = {
        "mamba_layer": ModuleSpec(
            module=mamba_layer,
            submodules=MambaLayerSubmodules(norm=SPNorm, mixer=mixer, mamba_bda=get_bias_dropout_add),
        ),
        "attention_layer": ModuleSpec(
            module=layer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=SPNorm, self_attention=attention, self_attn_bda=get_bias_dropout_add
            ),
        ),
        "mlp_layer": ModuleSpec(
            module=layer,
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=SPNorm, mlp=dense_mlp, mlp_bda=get_bias_dropout_add
            ),
        ),
    }
    if config.num_moe_experts:
        moe = te_moe(config.num_moe_experts) if te else local_moe(config.num_moe_experts)
        if config.moe_latent_size and not te:  # with TE: MoELayer's own latent projections, TE linears
            moe = with_module(moe, LatentMoELayer)
        use_fp32_router(moe)
        layers["moe_layer"] = ModuleSpec(
            module=layer,
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=SPNorm, mlp=moe, mlp_bda=get_bias_dropout_add
            ),
        )
    return layers


def attention_and_mlp(linears: tuple[type, type] | None) -> tuple[Any, Any]:
    """The attention spec (core attention: SDPAttention) and the dense MLP's, from Megatron's local
    spec; ``linears``: TE's column- and row-parallel linears in their linear slots."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    from hpcrl.trainer.megatron.attention import SDPAttention
    from hpcrl.trainer.megatron.spec_utils import submodules_of

    dense = copy.deepcopy(specs.get_gpt_layer_local_spec(normalization="RMSNorm")).submodules
    attention = dense.self_attention
    attention.submodules.core_attention = SDPAttention
    if linears is not None:
        attention.submodules.linear_qkv, attention.submodules.linear_proj = linears
        mlp = submodules_of(dense.mlp)
        mlp.linear_fc1, mlp.linear_fc2 = linears
    return attention, dense.mlp


def te_linears() -> tuple[type, type]:
    """Transformer Engine's column- and row-parallel linears (megatron-core's wrappers: the same
    weight layout and call as its local ones)."""
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear

    return TEColumnParallelLinear, TERowParallelLinear


def local_moe(experts: int) -> Any:
    """Megatron's local MoE spec with the experts on torch's grouped_mm (experts.GroupedExperts)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    from hpcrl.trainer.megatron.experts import use_grouped_experts

    local = specs.get_gpt_layer_local_spec(num_experts=experts, normalization="RMSNorm")
    moe = copy.deepcopy(local.submodules.mlp)
    use_grouped_experts(moe)
    return moe


def te_moe(experts: int) -> Any:
    """Megatron's TE MoE spec: TEGroupedMLP (TE's grouped GEMM over the local experts), the shared
    expert on TE linears."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    return get_moe_module_spec(use_te=True, num_experts=experts, moe_grouped_gemm=True)
