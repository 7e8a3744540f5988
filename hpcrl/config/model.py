"""Model catalog schema: real architecture numbers, and the parameter counts derived from them.

The memory estimate and the MFU figures both start from ``ModelConfig.param_counts()``; a test
checks each catalog entry against the parameter count its publisher states.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hpcrl.config.checks import MISSING, non_negative, positive
from hpcrl.errors import ConfigError


@dataclass
class HybridLayers:
    """Layer mix of hybrid (Mamba + attention + MoE) stacks such as Nemotron-H.

    Each of ``mamba``, ``attention``, ``moe`` and ``mlp`` counts layers of that kind; they add up
    to ``num_layers``. ``pattern`` is the checkpoint's ``hybrid_override_pattern`` (one symbol a layer:
    ``M`` Mamba-2, ``*`` attention, ``E`` MoE, ``-`` dense MLP), the order the counts must agree with.
    """

    pattern: str = ""
    mamba: int = 0
    attention: int = 0
    moe: int = 0
    mlp: int = 0
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state: int = 0
    mamba_groups: int = 0


@dataclass
class ParamCounts:
    total: int
    active: int
    expert: int
    """Parameters inside routed experts (sharded by expert parallelism)."""
    embedding: int
    frozen: int
    """Towers the RL recipes keep frozen (vision/audio)."""

    @property
    def dense(self) -> int:
        return self.total - self.expert


@dataclass
class ModelConfig:
    name: str = MISSING
    hf_id: str = MISSING
    family: str = MISSING
    """Architecture family: qwen2, qwen3, qwen3_moe, llama, gemma3, gemma4, nemotron_h."""
    hf_class: str = MISSING
    num_layers: int = MISSING
    hidden_size: int = MISSING
    num_attention_heads: int = MISSING
    num_kv_heads: int = MISSING
    head_dim: int = MISSING
    ffn_hidden_size: int = MISSING
    """Dense MLP width (for MoE models: the shared/dense MLP next to the experts, 0 if none)."""
    vocab_size: int = MISSING
    tie_embeddings: bool = False
    gated_mlp: bool = True
    """SwiGLU/GeGLU (3 matrices) versus a plain up/down MLP (2 matrices, e.g. squared ReLU)."""
    num_experts: int = 0
    experts_per_token: int = 0
    moe_ffn_hidden_size: int = 0
    moe_latent_size: int = 0
    """LatentMoE: experts run in this smaller width, behind a down/up projection."""
    shared_expert_ffn: int = 0
    sliding_window: int = 0
    """Local attention window; 0 means every layer attends globally."""
    global_every: int = 0
    """One global-attention layer every N layers (Gemma: 6); 0 when all layers are global."""
    global_head_dim: int = 0
    global_kv_heads: int = 0
    wide_mlp_layers: int = 0
    """Gemma 4 E2B: layers whose MLP is twice ``ffn_hidden_size`` wide (the KV-shared layers)."""
    per_layer_embed_dim: int = 0
    """Gemma 4 E-models: per-layer embedding width (the 'E' in E2B/E4B)."""
    hybrid: HybridLayers = field(default_factory=HybridLayers)
    vision_params_m: float = 0.0
    """Vision/audio tower parameters in millions (frozen in the text RL recipes)."""
    vlm: bool = False
    """Checkpoint loads through an image-text class even when trained on text only."""
    unified: bool = False
    """Gemma 4 ``gemma4_unified`` checkpoint (no model-owned CP attention)."""
    stated_params_b: float = MISSING
    """Total parameters the publisher states, in billions (checked against the architecture)."""
    max_position_embeddings: int = 8192

    def check(self) -> None:
        for key in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
        ):
            positive(f"model.{key}", getattr(self, key))
        for key in (
            "ffn_hidden_size",
            "num_experts",
            "experts_per_token",
            "moe_ffn_hidden_size",
            "sliding_window",
            "global_every",
            "per_layer_embed_dim",
            "vision_params_m",
        ):
            non_negative(f"model.{key}", getattr(self, key))
        if self.num_attention_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_kv_heads={self.num_kv_heads} must divide "
                f"model.num_attention_heads={self.num_attention_heads}"
            )
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ConfigError(
                f"model.experts_per_token={self.experts_per_token} must be in 1..num_experts={self.num_experts}"
            )
        h = self.hybrid
        layer_sum = h.mamba + h.attention + h.moe + h.mlp
        if layer_sum and layer_sum != self.num_layers:
            raise ConfigError(
                f"model.hybrid layer counts ({h.mamba}+{h.attention}+{h.moe}+{h.mlp}) must add up "
                f"to model.num_layers={self.num_layers}"
            )
        if h.pattern:
            counts = {s: h.pattern.count(s) for s in "M*E-"}
            if len(h.pattern) != self.num_layers or sum(counts.values()) != len(h.pattern):
                raise ConfigError(
                    f"model.hybrid.pattern={h.pattern!r} must have one of M * E - per layer "
                    f"({self.num_layers} layers)"
                )
            if (counts["M"], counts["*"], counts["E"], counts["-"]) != (h.mamba, h.attention, h.moe, h.mlp):
                raise ConfigError(
                    f"model.hybrid.pattern={h.pattern!r} has {counts['M']} M, {counts['*']} *, "
                    f"{counts['E']} E, {counts['-']} -: set model.hybrid.mamba/attention/moe/mlp to match"
                )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_hybrid(self) -> bool:
        return self.hybrid.mamba > 0

    # -- layer counts by kind -------------------------------------------------------------
    @property
    def attention_layers(self) -> int:
        return self.hybrid.attention if self.is_hybrid else self.num_layers

    @property
    def global_attention_layers(self) -> int:
        if self.sliding_window and self.global_every:
            return self.attention_layers // self.global_every
        return 0 if self.sliding_window else self.attention_layers

    @property
    def moe_layers(self) -> int:
        if not self.is_moe:
            return 0
        return self.hybrid.moe if self.is_hybrid else self.num_layers

    @property
    def dense_mlp_layers(self) -> int:
        if self.is_hybrid:
            return self.hybrid.mlp
        return self.num_layers  # MoE models with a dense MLP beside the experts (Gemma 4 26B) count too

    # -- parameter counts ----------------------------------------------------------------
    def _attention_params(self, kv_heads: int, head_dim: int) -> int:
        q_and_o = 2 * self.hidden_size * self.num_attention_heads * head_dim
        return q_and_o + 2 * self.hidden_size * kv_heads * head_dim

    def _mlp_params(self, width: int, hidden: int | None = None) -> int:
        matrices = 3 if self.gated_mlp else 2
        return matrices * (hidden or self.hidden_size) * width

    def _mamba_params(self) -> int:
        h, d = self.hybrid, self.hidden_size
        inner = h.mamba_heads * h.mamba_head_dim
        in_proj = d * (2 * inner + 2 * h.mamba_groups * h.mamba_state + h.mamba_heads)
        return in_proj + inner * d + 4 * (inner + 2 * h.mamba_groups * h.mamba_state)

    def param_counts(self) -> ParamCounts:
        """Parameter totals from the architecture (norms and biases ignored: < 0.1%)."""
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)
        embed += self.per_layer_embed_dim * self.vocab_size * self.num_layers
        n_global = self.global_attention_layers
        local = self.attention_layers - n_global
        global_kv = self.global_kv_heads or self.num_kv_heads
        global_dim = self.global_head_dim or self.head_dim
        attention = local * self._attention_params(self.num_kv_heads, self.head_dim)
        attention += n_global * self._attention_params(global_kv, global_dim)
        dense_mlp = (
            self.dense_mlp_layers * self._mlp_params(self.ffn_hidden_size) if self.ffn_hidden_size else 0
        )
        dense_mlp += self.wide_mlp_layers * self._mlp_params(self.ffn_hidden_size)
        mamba = self.hybrid.mamba * self._mamba_params()
        expert = active_expert = 0
        if self.is_moe:
            width = self.moe_latent_size or self.hidden_size
            one_expert = self._mlp_params(self.moe_ffn_hidden_size, hidden=width)
            per_layer_shared = self.hidden_size * self.num_experts  # router
            per_layer_shared += self._mlp_params(self.shared_expert_ffn) if self.shared_expert_ffn else 0
            if self.moe_latent_size:
                per_layer_shared += 2 * self.hidden_size * self.moe_latent_size
            expert = self.moe_layers * self.num_experts * one_expert
            active_expert = self.moe_layers * self.experts_per_token * one_expert
            dense_mlp += self.moe_layers * per_layer_shared
        frozen = int(self.vision_params_m * 1e6)
        common = embed + attention + dense_mlp + mamba + frozen
        return ParamCounts(
            total=common + expert,
            active=common + active_expert,
            expert=expert,
            embedding=embed,
            frozen=frozen,
        )

    # -- rollout cache --------------------------------------------------------------------
    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> float:
        """KV-cache bytes per token of a long sequence (sliding-window layers counted at full length)."""
        global_kv = self.global_kv_heads or self.num_kv_heads
        global_dim = self.global_head_dim or self.head_dim
        n_global = self.global_attention_layers
        local = self.attention_layers - n_global
        per_layer_local = 2 * self.num_kv_heads * self.head_dim * dtype_bytes
        per_layer_global = 2 * global_kv * global_dim * dtype_bytes
        return local * per_layer_local + n_global * per_layer_global

    def kv_bytes_for_sequence(self, tokens: int, dtype_bytes: int = 2) -> float:
        """KV bytes for one sequence; sliding-window layers hold at most ``sliding_window`` tokens."""
        global_kv = self.global_kv_heads or self.num_kv_heads
        global_dim = self.global_head_dim or self.head_dim
        n_global = self.global_attention_layers
        local = self.attention_layers - n_global
        local_tokens = min(tokens, self.sliding_window) if self.sliding_window else tokens
        total = local * 2 * self.num_kv_heads * self.head_dim * dtype_bytes * local_tokens
        total += n_global * 2 * global_kv * global_dim * dtype_bytes * tokens
        if self.is_hybrid:  # Mamba state is per sequence, kept in fp32
            h = self.hybrid
            total += h.mamba * h.mamba_heads * h.mamba_head_dim * h.mamba_state * 4
        return total
