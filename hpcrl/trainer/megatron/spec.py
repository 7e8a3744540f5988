"""What Megatron-core builds: the TransformerConfig from a Hugging Face config plus the topology,
and the layer spec.

Layer spec: Transformer Engine's when it is installed; otherwise Megatron's local spec with its
unfused attention (which materialises [b, heads, s, s] scores: out of memory at 8 x 2048 on an H200)
replaced by ``SDPAttention`` — torch's scaled_dot_product_attention, i.e. flash attention on GPUs.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from hpcrl.topology import TrainParallel
from hpcrl.trainer.config import MegatronTrainerConfig, Precision


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


class SDPAttention(torch.nn.Module):
    """Megatron's core-attention slot filled with torch SDPA: causal, GQA without repeating K/V."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 **_: Any) -> None:  # fmt: skip
        super().__init__()
        if config.context_parallel_size != 1:
            raise ValueError(
                "context parallel needs Transformer Engine's attention (trainer.cp must be 1 without it)"
            )
        self.config = config
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.scale = softmax_scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:  # fmt: skip
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention: packed sequences and attention bias need Transformer Engine")
        # Megatron hands [s, b, heads, dim]; SDPA wants [b, heads, s, dim]. Sequences are right-padded,
        # so the causal mask alone is exact for every real token.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0, scale=self.scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )  # fmt: skip
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def layer_spec(num_experts: int | None = None) -> Any:
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if have_transformer_engine():
        return specs.get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts)
    spec = copy.deepcopy(specs.get_gpt_layer_local_spec(num_experts=num_experts, normalization="RMSNorm"))
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def uses_fused_norms() -> bool:
    """TE's spec folds the pre-attention/pre-MLP norms into linear_qkv / linear_fc1 (weight names differ)."""
    return have_transformer_engine()


def transformer_config(hf: Any, trainer: MegatronTrainerConfig, par: TrainParallel, *, device: str) -> Any:
    """fp32 parameters (the optimizer's master copy); on GPUs with ``precision: bfloat16`` the forward
    runs under bf16 autocast (the pipeline schedules apply it), as the fsdp backend's mixed precision."""
    from megatron.core.transformer import TransformerConfig

    on_gpu = device != "cpu"
    autocast = on_gpu and trainer.precision is Precision.bfloat16
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return TransformerConfig(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(getattr(hf, "attention_bias", False) or hf.model_type == "qwen2"),
        qk_layernorm=hf.model_type == "qwen3",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        context_parallel_size=par.cp,
        expert_model_parallel_size=par.ep,
        # Megatron's torch norms (local spec) cannot run sequence parallel: Transformer Engine only.
        sequence_parallel=trainer.sequence_parallel and par.tp > 1 and have_transformer_engine(),
        recompute_granularity="full" if trainer.activation_checkpointing else None,
        recompute_method="uniform" if trainer.activation_checkpointing else None,
        recompute_num_layers=1 if trainer.activation_checkpointing else None,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        enable_autocast=autocast,
        autocast_dtype=torch.bfloat16 if autocast else None,
        use_cpu_initialization=True,  # the weights come from the checkpoint right after
        perform_initialization=False,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=on_gpu,  # Megatron's fused SwiGLU (no Transformer Engine needed)
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=on_gpu and have_transformer_engine(),
        deallocate_pipeline_outputs=False,
        variable_seq_lengths=False,
        moe_router_dtype=trainer.router_dtype,
    )
