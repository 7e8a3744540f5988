"""Gemma 3's text decoder (1B; 4B+ inside Gemma3ForConditionalGeneration) in Megatron-core, local spec.

What Gemma 3 has that the plain GPT does not, and where each lives:
- norms ``x * (1 + w)`` computed in fp32: Megatron's ``layernorm_zero_centered_gamma``, honoured by
  hpcrl's ``SPNorm`` (every norm: input, pre-MLP, Q/K, final, and the sandwich norms);
- sandwich norms, GeGLU with tanh GELU, sliding windows, scaled embeddings: the Gemma modules shared
  with Gemma 4 (gemma.py);
- two RoPE bases (global layers: ``rope_theta`` with linear scaling on 4B+, sliding layers: the local
  base): ``rope`` gives GPTModel the global one, ``adapt_model`` hands every layer both;
- softmax scale ``query_pre_attn_scalar ** -0.5``.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from hpcrl.trainer.megatron.families.base import GPTFamily
from hpcrl.trainer.megatron.gemma import (
    DualRotaryEmbedding,
    GemmaSelfAttention,
    RowParallelLinearPostNorm,
    gemma_fields,
    scale_embeddings,
)
from hpcrl.trainer.megatron.spec_utils import submodules_of


class Gemma3(GPTFamily):
    """Gemma 3's departures from the plain GPT (module docstring); always the local spec: its sandwich
    norms have no place in Transformer Engine's."""

    model_types = ("gemma3_text",)
    local_spec_only = True
    sandwich_norms = True

    def check_supported(self, hf: Any) -> None:
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(hf, key, None) is not None:
                raise ValueError(
                    f"trainer=megatron does not apply {key} (this checkpoint sets "
                    f"{getattr(hf, key)}; Gemma 3 has none): use trainer=fsdp"
                )
        if getattr(hf, "use_bidirectional_attention", False):
            raise ValueError(
                "trainer=megatron trains causal Gemma 3 only (use_bidirectional_attention is set)"
            )
        full = hf.rope_parameters.get("full_attention") or {}
        if full.get("rope_type", "default") not in ("default", "linear"):
            raise ValueError(
                f"trainer=megatron applies default or linear RoPE scaling on Gemma 3's global "
                f"layers, not {full.get('rope_type')!r}: use trainer=fsdp"
            )

    def config_fields(self, hf: Any) -> dict[str, Any]:
        return {
            **super().config_fields(hf),
            "layernorm_zero_centered_gamma": True,
            **gemma_fields(hf, hf.query_pre_attn_scalar**-0.5),
        }

    def rope(self, hf: Any) -> dict[str, Any]:
        """The global layers' base and linear scaling; the local base goes in with ``adapt_model``."""
        base, factor, _ = rope_bases(hf)
        return {"rotary_base": base, "seq_len_interpolation_factor": factor}

    def adapt_spec(self, spec: Any) -> Any:
        layer = spec.submodules
        layer.self_attention.module = GemmaSelfAttention
        layer.self_attention.submodules.linear_proj = RowParallelLinearPostNorm
        submodules_of(layer.mlp).linear_fc2 = RowParallelLinearPostNorm
        return spec

    def adapt_model(self, model: Any, hf: Any, compute_dtype: torch.dtype) -> None:
        """Embeddings scaled, both RoPE bases handed to every layer."""
        scale_embeddings(model, hf, compute_dtype)
        _, _, local_base = rope_bases(hf)
        local = RotaryEmbedding(
            kv_channels=model.config.kv_channels,
            rotary_percent=1.0,
            rotary_base=local_base,
            use_cpu_initialization=True,
            cp_group=model.rotary_pos_emb.cp_group,
        )
        model.rotary_pos_emb = DualRotaryEmbedding(model.rotary_pos_emb, local)


def rope_bases(hf: Any) -> tuple[float, float | None, float]:
    """(global base, global linear scaling factor or None, local base)."""
    params = hf.rope_parameters
    full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    factor = full.get("factor") if full.get("rope_type") == "linear" else None
    return float(full.get("rope_theta", 1e6)), factor, float(local.get("rope_theta", 1e4))
