"""Gemma 4's text decoder (31B, and 26B-A4B with its MoE block) in Megatron-core (local spec, no TE).

Gemma 4 keeps Gemma 3's sandwich norms, GeGLU, sliding windows and scaled embeddings (gemma.py) and
changes these, each handled here:
- layers of two shapes: sliding layers have ``head_dim`` x ``num_key_value_heads``, global layers their
  own (31B: 256 x 16 against 512 x 4). One TransformerConfig describes the sliding layers; a global
  layer's attention is built from a copy with its own ``kv_channels`` / ``num_query_groups``;
- ``attention_k_eq_v``: a global layer has no V projection, its values are its keys before the K norm
  and RoPE. ``linear_qkv`` then holds [q; k] per query group (weights.LayerAttention);
- values normalised by an RMSNorm without weight (``v_norm``), every layer;
- norms ``x * w`` in fp32 (not Gemma 3's ``1 + w``), softmax scale 1 (the Q/K norms set the scale);
- RoPE angles per layer type computed by transformers itself (global layers: "proportional" RoPE on
  a quarter of the 512 dimensions); the local angles are padded to the global width in the one tensor
  Megatron hands every layer, and each layer reads its own head size from it;
- ``layer_scalar``: a checkpoint buffer scaling each layer's output;
- ``final_logit_softcapping`` when a checkpoint sets it (the trainer caps the logits, in the chunked
  log-prob head at TP=1 too);
- 26B-A4B's MoE block: each layer runs a dense MLP and an MoE side by side on the same residual, each
  between its own norms, summed before the outer post-MLP norm; the router reads the un-normalised
  residual through its own weightless norm and ``scale``, renormalises the top-k weights and scales
  them per expert (``Gemma4MoEBlock``, ``Gemma4MoELayer``: Megatron's MoELayer, its dispatcher, EP and
  hpcrl's grouped experts).
The E2B/E4B extras (per-layer embeddings, KV-shared layers, double-wide MLPs) are refused by
``Gemma4.check_supported`` and by the planner (``trainer.config.megatron_build_gap``).
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_layer import TransformerLayer

from hpcrl.trainer.megatron.families.base import GPTFamily
from hpcrl.trainer.megatron.gemma import (
    DualRotaryEmbedding,
    GemmaSelfAttention,
    RowParallelLinearPostNorm,
    gemma_fields,
    scale_embeddings,
)
from hpcrl.trainer.megatron.norms import SPNorm
from hpcrl.trainer.megatron.spec_utils import build, submodules_of, with_module
from hpcrl.trainer.megatron.weights import LayerAttention


class Gemma4Norm(SPNorm):
    in_fp32 = True


class Gemma4PostNorm(RowParallelLinearPostNorm):
    norm = Gemma4Norm


class Gemma4(GPTFamily):
    """Gemma 4's departures from the plain GPT and from Gemma 3 (module docstring)."""

    model_types = ("gemma4_text",)
    local_spec_only = True
    sandwich_norms = True
    norm = Gemma4Norm
    buffers = ("layer_scalar",)

    def __init__(self, hf: Any) -> None:
        super().__init__(hf)
        self.final_logit_softcap = getattr(hf, "final_logit_softcapping", None) or None
        self.moe_block = bool(getattr(hf, "enable_moe_block", False))
        self.layouts = {i: own for i in range(hf.num_hidden_layers) if (own := layer_attention(hf, i))}

    def check_supported(self, hf: Any) -> None:
        gaps = {
            "hidden_size_per_layer_input": "per-layer embeddings (E2B/E4B)",
            "num_kv_shared_layers": "KV-shared layers (E2B/E4B)",
            "attention_bias": "attention biases",
            "attn_logit_softcapping": "attention logit soft-capping",
        }
        for key, what in gaps.items():
            if getattr(hf, key, None):
                raise ValueError(
                    f"trainer=megatron does not build Gemma 4's {what} yet (this checkpoint sets "
                    f"{key}={getattr(hf, key)}): use trainer=fsdp"
                )
        if getattr(hf, "use_bidirectional_attention", None) == "all":
            raise ValueError(
                "trainer=megatron trains causal Gemma 4 only (use_bidirectional_attention='all')"
            )
        # "vision": bidirectional among image tokens only; text-only batches are causal

    def config_fields(self, hf: Any) -> dict[str, Any]:
        # x * w norms: not zero-centred (no layernorm_zero_centered_gamma)
        return {**super().config_fields(hf), **gemma_fields(hf, softmax_scale=1.0)}

    def num_experts(self, hf: Any) -> int:
        """26B-A4B's MoE block (``enable_moe_block``); 0 for the dense 31B."""
        return int(hf.num_experts) if self.moe_block else 0

    def routing(self, hf: Any) -> tuple[int, bool]:
        """Top-k weights always renormalised (then scaled per expert: ``Gemma4MoELayer``)."""
        return int(hf.top_k_experts), False

    def attention_layouts(self, hf: Any) -> dict[int, Any] | None:
        return self.layouts or None

    def adapt_spec(self, spec: Any) -> Any:
        layer = spec.submodules
        attention = type("Gemma4LayerAttention", (Gemma4SelfAttention,), {"layouts": self.layouts})
        layer.self_attention.module = attention
        layer.self_attention.submodules.linear_proj = Gemma4PostNorm
        if self.moe_block:  # the block applies its own norms to the residual it gets
            layer.mlp = type(
                "Gemma4LayerMoEBlock", (Gemma4MoEBlock,), {"moe_spec": with_module(layer.mlp, Gemma4MoELayer)}
            )
            layer.pre_mlp_layernorm = IdentityOp
        else:
            submodules_of(layer.mlp).linear_fc2 = Gemma4PostNorm
        return with_module(spec, Gemma4Layer)

    def adapt_model(self, model: Any, hf: Any, compute_dtype: torch.dtype) -> None:
        scale_embeddings(model, hf, compute_dtype)
        angles = hf_rope_angles(hf)
        ropes = {}
        for kind, inv_freq in angles.items():
            rope = RotaryEmbedding(
                kv_channels=2 * inv_freq.numel(),
                rotary_percent=1.0,
                use_cpu_initialization=True,
                cp_group=model.rotary_pos_emb.cp_group,
            )
            rope.inv_freq = inv_freq  # Megatron's rope computes its angles from this, positions x inv_freq
            ropes[kind] = rope
        full = ropes.get("full_attention") or ropes["sliding_attention"]
        model.rotary_pos_emb = DualRotaryEmbedding(full, ropes.get("sliding_attention", full))


def layer_attention(hf: Any, i: int) -> LayerAttention | None:
    """Layer ``i``'s attention shape where it departs from the sliding layers' (None: it does not)."""
    view = hf.per_layer_config[i]
    keys_are_values = hf.attention_k_eq_v and hf.layer_types[i] == "full_attention"  # as transformers decides
    own = LayerAttention(view.num_key_value_heads, view.head_dim, values=not keys_are_values)
    return None if own == LayerAttention(hf.num_key_value_heads, hf.head_dim) else own


def hf_rope_angles(hf: Any) -> dict[str, torch.Tensor]:
    """Inverse frequencies per layer type, [head_dim / 2] each, as transformers computes them."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    rope = Gemma4TextRotaryEmbedding(hf)
    out = {}
    for kind in rope.layer_types:
        if getattr(rope, f"{kind}_attention_scaling") != 1.0:
            raise ValueError(
                f"trainer=megatron does not scale Gemma 4's RoPE attention ({kind}: "
                f"{rope.rope_type[kind]}): use trainer=fsdp"
            )
        out[kind] = getattr(rope, f"{kind}_inv_freq").float().clone()
    return out


class Gemma4SelfAttention(GemmaSelfAttention):
    """A layer's attention with its own shape (``layouts``, by 0-based global layer) and the V norm;
    where keys double as values, linear_qkv yields [q; k] per query group."""

    layouts: ClassVar[dict[int, LayerAttention]] = {}  # set per model by Gemma4.adapt_spec

    def __init__(self, config: Any, submodules: Any, layer_number: int, *args: Any, **kwargs: Any) -> None:
        layout = self.layouts.get(layer_number - 1)  # Megatron numbers layers from 1, globally
        if layout is not None:
            config = copy.copy(config)  # this layer's shape; the model's config stays the sliding layers'
            config.kv_channels, config.num_query_groups = layout.head_dim, layout.groups
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.keys_are_values = layout is not None and not layout.values
        if self.keys_are_values:
            tp = self.world_size
            if config.num_query_groups % tp:
                raise ValueError(
                    f"trainer.tp={tp} must divide the {config.num_query_groups} KV heads of "
                    f"Gemma 4's global layers (their keys double as values)"
                )
            narrow_rows(self.linear_qkv, (self.query_projection_size + self.kv_projection_size) // tp)

    def get_query_key_value_tensors(
        self,
        hidden_states: torch.Tensor,
        key_value_states: Any = None,
        output_gate: bool = False,
        split_qkv: bool = True,
    ) -> Any:
        assert not output_gate and split_qkv, "Gemma 4 has no attention output gate"
        if not self.keys_are_values:
            query, key, value = super().get_query_key_value_tensors(hidden_states, key_value_states)
        else:
            mixed, _ = self.linear_qkv(hidden_states)
            groups, d = self.num_query_groups_per_partition, self.hidden_size_per_attention_head
            per = self.num_attention_heads_per_partition // groups
            query, key = mixed.view(*mixed.shape[:2], groups, (per + 1) * d).split([per * d, d], dim=3)
            query = self.q_layernorm(query.reshape(*query.shape[:2], -1, d))
            value, key = key, self.k_layernorm(key)
        # Hugging Face's v_norm: RMS-normalised values, no weight, in fp32
        value = F.rms_norm(value.float(), (value.shape[-1],), None, self.config.layernorm_epsilon).type_as(
            value
        )
        return query, key, value


def narrow_rows(linear: Any, rows: int) -> None:
    """A column-parallel linear re-sized to ``rows`` outputs per rank (before any weight loads): its
    weight keeps Megatron's tensor-parallel attributes."""
    old = linear.weight
    assert linear.bias is None, "Gemma 4 has no attention biases"
    new = torch.nn.Parameter(old.new_empty(rows, old.shape[1]), requires_grad=old.requires_grad)
    new.__dict__.update(old.__dict__)  # partition_dim, tensor_model_parallel, ...
    linear.weight = new
    linear.output_size_per_partition = rows
    linear.output_size = rows * linear.output_size // old.shape[0]


class Gemma4Layer(TransformerLayer):
    """Megatron's layer, its output scaled by the checkpoint's ``layer_scalar``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output, context = super().forward(*args, **kwargs)
        return output * self.layer_scalar.to(output.dtype), context


class Gemma4MoELayer(MoELayer):
    """Megatron's MoE layer routing on another input than the one it dispatches (``router_input``:
    the block's residual), with Gemma 4's router: a weightless RMSNorm, ``scale`` and 1/sqrt(hidden)
    before the gating matmul; top-k then softmax over the k (= Hugging Face's softmax, top-k,
    renormalise); the weights then scaled per expert (``per_expert_scale``)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        for name, size in (("scale", config.hidden_size), ("per_expert_scale", config.num_moe_experts)):
            param = torch.nn.Parameter(torch.ones(size))
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]  # as the router's weight
            self.router.register_parameter(name, param)
        self.router_input: torch.Tensor | None = None

    def route(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        x = self.router_input
        assert x is not None, "Gemma4MoEBlock sets router_input"
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.config.layernorm_epsilon).type_as(x)
        scaled = normed * self.router.scale.to(x.dtype) * x.shape[-1] ** -0.5
        probs, routing_map = super().route(scaled, *args, **kwargs)
        return probs * self.router.per_expert_scale.to(probs.dtype), routing_map


class Gemma4MoEBlock(MLP):
    """A Gemma 4 26B-A4B layer's MLP slot (the layer's pre-MLP norm is an identity: both branches need
    the residual): ``post_layernorm(post_fc2_norm(MLP(dense_layernorm(x))) +
    experts_post_layernorm(MoE(experts_layernorm(x); routed on x)))``. The dense MLP is this module's own
    ``linear_fc1`` / ``linear_fc2`` (its post norm is Hugging Face's post_feedforward_layernorm_1)."""

    moe_spec: ClassVar[Any] = None  # the local spec's MoE layer, set per model by Gemma4.adapt_spec

    def __init__(self, config: Any, submodules: Any = None, pg_collection: Any = None, **_: Any) -> None:
        dense = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=Gemma4PostNorm)
        tp = {"tp_group": pg_collection.tp} if pg_collection is not None else {}
        super().__init__(config, dense, **tp)
        h, eps = config.hidden_size, config.layernorm_epsilon
        for name in ("dense_layernorm", "experts_layernorm", "experts_post_layernorm", "post_layernorm"):
            setattr(self, name, Gemma4Norm(config, h, eps=eps))
        moe = {"pg_collection": pg_collection} if pg_collection is not None else {}
        self.moe = build(self.moe_spec, config=config, **moe)

    def set_layer_number(self, layer_number: int) -> None:
        self.moe.set_layer_number(layer_number)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        dense, _ = super().forward(self.dense_layernorm(hidden_states))
        self.moe.router_input = hidden_states
        try:
            routed, _ = self.moe(self.experts_layernorm(hidden_states))
        finally:
            self.moe.router_input = None
        return self.post_layernorm(dense + self.experts_post_layernorm(routed)), None
