"""Qwen3-MoE: Qwen3's decoder (Q/K norms) with an MoE of ``num_experts`` experts in every layer,
routed as Hugging Face's usual fields say (``GPTFamily.routing``); the experts run as hpcrl's grouped
GEMMs (experts.py, put in by spec.layer_spec for every MoE)."""

from __future__ import annotations

from typing import Any

from hpcrl.trainer.megatron.families.base import GPTFamily


class Qwen3MoE(GPTFamily):
    model_types = ("qwen3_moe",)

    def check_supported(self, hf: Any) -> None:
        if getattr(hf, "decoder_sparse_step", 1) != 1 or getattr(hf, "mlp_only_layers", None):
            raise ValueError(
                "trainer=megatron builds Qwen3-MoE with an MoE in every layer "
                "(decoder_sparse_step=1, no mlp_only_layers); use trainer=fsdp"
            )

    def config_fields(self, hf: Any) -> dict[str, Any]:
        return {**super().config_fields(hf), "qk_layernorm": True}

    def num_experts(self, hf: Any) -> int:
        return int(hf.num_experts)
