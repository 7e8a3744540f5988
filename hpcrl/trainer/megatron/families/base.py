"""The base family: a Hugging Face decoder that departs in nothing from Megatron-core's plain GPT
(RMSNorm, SwiGLU, RoPE, GQA, no linear biases). Each hook below answers one question the spec,
config, shape or weight-mapping code asks; a family module subclasses ``GPTFamily`` and overrides
only the hooks where its decoder departs (families/table.py lists them).

Imports no Megatron-core and no family: the family modules import it, never the other way round.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hpcrl.trainer.config import MegatronTrainerConfig
from hpcrl.trainer.megatron.norms import SPNorm


class GPTFamily:
    """How a model family's decoder departs from Megatron's plain GPT: the defaults here are the
    plain GPT. One is built per use from the checkpoint's text config (``check_supported`` first)."""

    model_types: tuple[str, ...] = ()
    """The Hugging Face ``model_type`` values of this family's text configs (each maps to the table's
    key through ``trainer.config.megatron_family``)."""
    local_spec_only = False
    """Built from Megatron's local spec even when Transformer Engine is installed."""
    sandwich_norms = False
    """Post-attention / post-MLP norms (weights.Shape)."""
    norm: type = SPNorm
    """Every norm slot's module (the layers' and the final one)."""
    buffers: tuple[str, ...] = ()
    """Buffers loaded from the checkpoint beside the parameters (never trained, never exported)."""
    final_logit_softcap: float | None = None
    """Logits -> cap * tanh(logits / cap) before the log-softmax (chunked head and logits path alike)."""
    moe_block = False
    """Gemma 4 26B-A4B: a dense MLP beside the MoE in every layer (weights.Shape.moe_block)."""
    hybrid = False
    """Built as megatron-core's hybrid (Mamba) model from ``stack_layers``, not as a GPTModel."""
    pad_row_untrained = True
    """Hugging Face builds the embedding with ``padding_idx`` (spec.keep_pad_row_untrained)."""

    def __init__(self, hf: Any) -> None:
        self.check_supported(hf)

    def check_supported(self, hf: Any) -> None:
        """Checkpoints of this family that its decoder does not express fail here, naming the field."""

    def config_fields(self, hf: Any) -> dict[str, Any]:
        """TransformerConfig fields the architecture sets (the run's own — parallelism, precision,
        fusions — are spec.transformer_config's; a family's fields override them)."""
        return {
            "num_layers": hf.num_hidden_layers,
            "hidden_size": hf.hidden_size,
            "ffn_hidden_size": hf.intermediate_size,
            "num_attention_heads": hf.num_attention_heads,
            "num_query_groups": hf.num_key_value_heads,
            "kv_channels": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            "normalization": "RMSNorm",
            "layernorm_epsilon": hf.rms_norm_eps,
            "gated_linear_unit": True,
            "activation_func": F.silu,
            "add_bias_linear": False,
            "add_qkv_bias": bool(getattr(hf, "attention_bias", False)),
            "qk_layernorm": False,
        }

    def num_experts(self, hf: Any) -> int:
        """Routed experts per MoE layer (0: a dense model)."""
        return 0

    def routing(self, hf: Any) -> tuple[int, bool]:
        """(experts per token, softmax over all experts before the top-k): Hugging Face's usual MoE
        fields. Top-k weights renormalised (``norm_topk_prob``) = top-k then softmax over the k."""
        return int(hf.num_experts_per_tok), not getattr(hf, "norm_topk_prob", False)

    def moe_fields(self, hf: Any, trainer: MegatronTrainerConfig) -> dict[str, Any]:
        """Megatron's MoE fields (empty for a dense model): every layer an MoE of ``num_experts`` GLU
        experts, top-k routing as Hugging Face does it (``routing``), dropless, tokens exchanged by
        all-to-all over the EP group."""
        experts = self.num_experts(hf)
        if not experts:
            return {}
        coeff = trainer.moe_aux_loss_coeff
        if coeff is None:
            coeff = float(getattr(hf, "router_aux_loss_coef", 0.0) or 0.0)
        topk, pre_softmax = self.routing(hf)
        return {
            "num_moe_experts": experts,
            "moe_ffn_hidden_size": hf.moe_intermediate_size,
            "moe_router_topk": topk,
            "moe_router_pre_softmax": pre_softmax,
            "moe_router_load_balancing_type": "aux_loss" if coeff > 0 else "none",
            "moe_aux_loss_coeff": coeff,
            "moe_token_dispatcher_type": "alltoall",
            "moe_grouped_gemm": False,
            "expert_tensor_parallel_size": trainer.expert_tp,
        }

    def rope(self, hf: Any) -> dict[str, Any]:
        """GPTModel's RoPE arguments."""
        params = getattr(hf, "rope_parameters", None) or {}
        return {"rotary_base": float(getattr(hf, "rope_theta", None) or params.get("rope_theta", 10000.0))}

    def adapt_spec(self, spec: Any) -> Any:
        """The local layer spec (hpcrl's SDPA and norms already in) -> this family's (changed in place
        or a new one: megatron-core 0.19's partials are rebuilt, ``spec_utils.with_module``)."""
        return spec

    def attention_layouts(self, hf: Any) -> dict[int, Any] | None:
        """Layers whose attention shape departs from the model's (weights.Shape.layers)."""
        return None

    def shape_fields(self, hf: Any) -> dict[str, Any]:
        """weights.Shape fields beyond the attention's (a hybrid model's pattern and Mamba widths)."""
        return {}

    def stack_layers(self, hf: Any, config: Any, te: bool = False) -> dict[str, Any]:
        """A hybrid family's stack submodules, one spec per layer kind (ssm.hybrid_model); ``te``: of
        Transformer Engine's layers (spec.uses_local_spec)."""
        raise NotImplementedError(f"{type(self).__name__} is not a hybrid family")

    def adapt_model(self, model: Any, hf: Any, compute_dtype: torch.dtype) -> None:
        """After GPTModel is built, before the weights load."""
