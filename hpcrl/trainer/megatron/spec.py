"""What Megatron-core builds: the TransformerConfig from a Hugging Face config plus the topology,
and the layer spec.

Layer spec: Transformer Engine's when it is installed; otherwise Megatron's local spec with two slots
filled by hpcrl:
- core attention: ``SDPAttention`` — torch's scaled_dot_product_attention (flash attention on GPUs)
  instead of Megatron's unfused attention (which materialises [b, heads, s, s] scores: out of memory
  at 8 x 2048 on an H200); it also runs context parallel (keys and values gathered over the CP group);
- norms: ``SPNorm`` — torch's RMSNorm that can run sequence parallel, which Megatron's torch-norm
  wrapper refuses (only Transformer Engine's or Apex's norms could).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.nn.functional as F

from hpcrl.plan.topology import TrainParallel
from hpcrl.trainer.config import MegatronTrainerConfig, Precision, megatron_family


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


class SDPAttention(torch.nn.Module):
    """Megatron's core-attention slot filled with torch SDPA: causal, GQA without repeating K/V.

    Context parallel: Megatron gives each CP rank two of the 2·cp equal chunks of every sequence
    (rank r holds chunks r and 2·cp-1-r, so causal work is balanced). Keys and values are gathered
    from all CP ranks (the backward reduce-scatters their gradients back); each local query chunk
    attends to the keys of every chunk up to its own, causal within its own chunk — on a sliding-window
    layer only to the keys its window reaches, masked by global position (Gemma 3 under CP)."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        **_: Any,
    ) -> None:
        super().__init__()
        self.config = config
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.scale = softmax_scale
        self.window = sliding_window(config, layer_number)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention: packed sequences and attention bias need Transformer Engine")
        # Megatron hands [s, b, heads, dim]; SDPA wants [b, heads, s, dim]. Sequences are right-padded,
        # so the causal mask alone is exact for every real token.
        s, b = query.shape[0], query.shape[1]
        if self.config.context_parallel_size > 1:
            out = self._context_parallel(query, key, value)
        else:
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            if self.window is None or s <= self.window:  # a window longer than the sequence is causal
                out = self._sdpa(q, k, v, causal=True)
            elif q.is_cuda and WINDOW_KERNEL == "flex":
                out = flex_window_attention(q, k, v, self.window, self.scale)
            else:
                out = self._sdpa(q, k, v, causal=window_mask(s, self.window, q.device))
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: Any) -> torch.Tensor:
        mask = None if causal is True else causal
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal is True,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )

    # Eager even inside a compiled layer: compiled, the gradient of the K/V all-gather (a reduce-scatter
    # in Megatron's autograd function) came out wrong on 2 H200s (grad norm 4.46 instead of 6.16).
    @torch.compiler.disable
    def _context_parallel(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state as ps
        from torch.nn.attention.bias import causal_lower_right

        group = ps.get_context_parallel_group()
        cp, rank = group.size(), group.rank()
        chunk = query.shape[0] // 2
        # every rank's queries read these keys/values: their gradients are summed back to the owner
        k_all, v_all = (cp_gather(t, group, sum_grads=True) for t in (key, value))
        outs = []
        for j, g in enumerate((rank, 2 * cp - 1 - rank)):  # this rank's two chunks, by global index
            q = query[j * chunk : (j + 1) * chunk].permute(1, 2, 0, 3)
            seen = (g + 1) * chunk
            # a sliding-window layer reads only the keys its window reaches (masked by global position)
            first = 0 if self.window is None else max(0, g * chunk - self.window + 1)
            k, v = (t[first:seen].permute(1, 2, 0, 3) for t in (k_all, v_all))
            causal: Any
            if self.window is not None:
                causal = window_mask(
                    chunk, self.window, q.device, first_query=g * chunk, first_key=first, keys=seen - first
                )
            else:
                causal = True if g == 0 else causal_lower_right(chunk, seen)
            outs.append(self._sdpa(q, k, v, causal=causal))
        return torch.cat(outs, dim=2)


def sliding_window(config: Any, layer_number: int) -> int | None:
    """Keys a query of this (1-based, global) layer sees, itself included, under Megatron's
    ``window_size`` / ``window_attn_skip_freq``; None: every key before it."""
    from megatron.core.transformer.utils import is_layer_window_attention

    if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return int(config.window_size[0]) + 1
    return None


WINDOW_KERNEL = "flex"
"""Sliding-window layers on GPUs: ``flex`` (flex_attention, key blocks outside the window skipped) or
``sdpa`` (SDPA with a boolean mask: every key block computed). One H200, Gemma 3 1B's shape (8 x 2048,
4/1 heads of 256, window 512), forward + backward: flex 1.09 ms, masked SDPA 2.30 ms, causal flash
attention without a window 0.74 ms (bench/window_attention_bench.py). CPUs always take ``sdpa``."""


@functools.cache
def _window_block_mask(s: int, window: int, device: torch.device) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    def inside(b: Any, h: Any, q: Any, k: Any) -> Any:
        return (q >= k) & (q - k < window)

    return create_block_mask(inside, None, None, s, s, device=device)


@functools.cache
def _flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)  # eager flex_attention is a slow reference implementation


# Eager, like the CP path: the block mask is cached per (length, window) outside any compiled graph,
# and flex_attention runs as its own compiled kernel.
@torch.compiler.disable
def flex_window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float | None, kernel: Any = None
) -> torch.Tensor:
    """Sliding-window causal attention on [b, heads, s, dim] (query i reads keys i - window + 1 .. i);
    ``kernel`` replaces the compiled flex_attention (tests pass the eager one)."""
    block = _window_block_mask(q.shape[2], window, q.device)
    run = kernel or _flex()
    return run(q, k, v, block_mask=block, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def window_mask(
    s: int,
    window: int,
    device: torch.device,
    first_query: int = 0,
    first_key: int = 0,
    keys: int | None = None,
) -> torch.Tensor:
    """[s, keys (default s)], True where the query at position ``first_query + i`` may read the key at
    ``first_key + j``: key <= query and query - key < window (sliding-window causal)."""
    q = torch.arange(first_query, first_query + s, device=device)
    k = torch.arange(first_key, first_key + (s if keys is None else keys), device=device)
    distance = q[:, None] - k[None, :]
    return (distance >= 0) & (distance < window)


def chunk_order(cp: int) -> list[int]:
    """Where global chunk g sits in the CP all-gather (rank r contributes chunks r, 2·cp-1-r)."""
    return [2 * g if g < cp else 2 * (2 * cp - 1 - g) + 1 for g in range(2 * cp)]


def cp_gather(t: torch.Tensor, group: Any, *, sum_grads: bool) -> torch.Tensor:
    """Every CP rank's part of dim 0 (its two chunks) -> the whole dim 0 in sequence order, on every
    rank. Backward: ``sum_grads`` sums the gradient over ranks (each rank used all of it), else each
    rank keeps its own part (each rank computed the same result from it)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    cp = group.size()
    every = gather_from_sequence_parallel_region(t.contiguous(), sum_grads, group)
    order = torch.tensor(chunk_order(cp), device=t.device)
    return every.view(2 * cp, t.shape[0] // 2, *t.shape[1:]).index_select(0, order).flatten(0, 1)


class SPNorm(torch.nn.RMSNorm):
    """Megatron's norm slot filled with torch's RMSNorm, sequence parallel allowed; with Megatron's
    ``layernorm_zero_centered_gamma`` (Gemma) the weight is an offset from 1. Under sequence
    parallelism each TP rank normalises its own slice of the sequence, so the weight's gradient is
    partial: it is marked ``sequence_parallel`` and summed over TP by the trainer, as Megatron's own
    fused norms do."""

    in_fp32 = False
    """Gemma 4: ``x * w`` computed in fp32, as Hugging Face does (the zero-centred norms always are)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]
        self.zero_centered = bool(getattr(config, "layernorm_zero_centered_gamma", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centered or self.in_fp32:  # Gemma 3: x * (1 + w); Gemma 4: x * w; in fp32 as HF does
            normed = F.rms_norm(x.float(), self.normalized_shape, None, self.eps)
            y = (normed * (self.weight.float() + float(self.zero_centered))).type_as(x)
        else:
            y = super().forward(x)
        if torch.is_autocast_enabled(x.device.type):
            # The next matmul casts to this anyway (same numbers). Under sequence parallelism it also
            # must: Megatron's linear reduce-scatters its input gradient into a buffer of the input's
            # dtype, and with fp32 parameters + autocast that gradient is bf16 (NCCL refuses the mix).
            y = y.to(torch.get_autocast_dtype(x.device.type))
        return y


class GPTFamily:
    """How a model family's decoder departs from Megatron's plain GPT: not at all for Qwen2/Qwen3/
    Llama and Qwen3-MoE; gemma.py's ``Gemma3`` overrides each hook. ``family_of`` picks one."""

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

    def config_fields(self, hf: Any) -> dict[str, Any]:
        """TransformerConfig fields beyond the GPT ones in ``transformer_config``."""
        return {}

    def rope(self, hf: Any) -> dict[str, Any]:
        """GPTModel's RoPE arguments."""
        params = getattr(hf, "rope_parameters", None) or {}
        return {"rotary_base": float(getattr(hf, "rope_theta", None) or params.get("rope_theta", 10000.0))}

    def adapt_spec(self, spec: Any) -> Any:
        """The local layer spec (hpcrl's SDPA and norms already in) -> this family's (changed in place
        or a new one: megatron-core 0.19's partials are rebuilt, ``with_module``)."""
        return spec

    def attention_layouts(self, hf: Any) -> dict[int, Any] | None:
        """Layers whose attention shape departs from the model's (weights.Shape.layers)."""
        return None

    def adapt_model(self, model: Any, hf: Any, compute_dtype: torch.dtype) -> None:
        """After GPTModel is built, before the weights load."""


def keep_pad_row_untrained(model: Any, hf: Any) -> None:
    """Hugging Face builds these decoders' embeddings with ``padding_idx=pad_token_id``: the lookup
    never sends gradient to the pad row (a tied head still does). Megatron's embedding has no such
    row, so without this the two backends train different weights whenever the pad id occurs in a
    sequence. It matters beyond a rounding error: checkpoints initialised by transformers hold a
    zero pad row, and the first RMSNorm of a zero vector has a 1/sqrt(eps) input gradient (Gemma 3 1B
    with random weights: embedding grad norm 28,880 against 2.24, so clipping starved every other
    weight). Done by cutting the gradient at the pad positions of the embedding output, which only
    the lookup sits behind: the forward is unchanged, and it holds under TP, SP and CP alike."""
    pad = getattr(hf, "pad_token_id", None)
    if getattr(model, "embedding", None) is None or not isinstance(pad, int) or not 0 <= pad < hf.vocab_size:
        return
    from megatron.core import parallel_state as ps

    sp = model.config.sequence_parallel

    def cut(_module: Any, _args: Any, kwargs: dict[str, Any], out: torch.Tensor) -> torch.Tensor:
        if not out.requires_grad:
            return out
        # the output is [s, b, h]; a transposed mask would hand its strides to the result (and on to
        # the pipeline's send, which needs a contiguous tensor)
        keep = (kwargs["input_ids"] != pad).transpose(0, 1).contiguous()
        if sp:  # this TP rank's contiguous share of the sequence
            keep = keep.chunk(ps.get_tensor_model_parallel_world_size())[ps.get_tensor_model_parallel_rank()]
        return torch.where(keep[..., None], out, out.detach())

    model.embedding.register_forward_hook(cut, with_kwargs=True)


def submodules_of(spec: Any) -> Any:
    """A module spec's submodules: megatron-core 0.16 holds specs as ``ModuleSpec``, 0.19 as
    ``functools.partial(Module, submodules=...)`` (None when it has none)."""
    return spec.submodules if hasattr(spec, "submodules") else spec.keywords.get("submodules")


def build(spec: Any, **kwargs: Any) -> Any:
    """The module a spec of either shape describes: a 0.16 ``ModuleSpec`` through Megatron's
    ``build_module``, a 0.19 ``functools.partial`` called (0.19's build_module cannot take one)."""
    if isinstance(spec, functools.partial):
        return spec(**kwargs)
    from megatron.core.transformer.spec_utils import build_module

    return build_module(spec, **kwargs)


def with_module(spec: Any, module: type) -> Any:
    """The same spec (either shape) building ``module`` instead: a ModuleSpec changed in place, a
    partial rebuilt with the same arguments."""
    if isinstance(spec, functools.partial):
        return functools.partial(module, *spec.args, **spec.keywords)
    spec.module = module
    return spec


def text_config(model_dir: Any) -> Any:
    """The checkpoint's text-decoder config. A heterogeneous one (Gemma 4: ``per_layer_config``)
    answers model-wide fields with the default layers' values (Gemma 4: the sliding layers');
    gemma4.py reads the layers that depart from them."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir).get_text_config()
    if getattr(hf, "per_layer_config", None) is not None:
        hf.allow_global_per_layer_attribute_access = True
    return hf


def num_experts(hf: Any) -> int:
    """Routed experts per MoE layer (0: a dense model): Qwen3-MoE, Gemma 4's MoE block (26B-A4B)."""
    if hf.model_type == "qwen3_moe" or getattr(hf, "enable_moe_block", False):
        return int(hf.num_experts)
    return 0


def family(hf: Any) -> str:
    """The catalog family (hpcrl/models.py) of a Hugging Face text config."""
    return megatron_family(hf.model_type)


def family_of(hf: Any) -> GPTFamily:
    if family(hf) == "gemma3":
        from hpcrl.trainer.megatron.gemma import Gemma3

        return Gemma3()
    if family(hf) == "gemma4":
        from hpcrl.trainer.megatron.gemma4 import Gemma4

        return Gemma4(hf)
    return GPTFamily()


def layer_spec(config: Any, fam: GPTFamily) -> Any:
    """The decoder spec GPTModel takes, for this pipeline stage's layers."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    experts, qk_norm = config.num_moe_experts, bool(config.qk_layernorm)
    if not uses_local_spec(fam):
        return specs.get_gpt_layer_with_transformer_engine_spec(num_experts=experts, qk_layernorm=qk_norm)
    spec = copy.deepcopy(
        specs.get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=qk_norm, normalization="RMSNorm")
    )
    layer, attention = spec.submodules, spec.submodules.self_attention.submodules
    attention.core_attention = SDPAttention
    layer.input_layernorm = layer.pre_mlp_layernorm = fam.norm
    if qk_norm:
        attention.q_layernorm = attention.k_layernorm = fam.norm
    else:
        assert attention.q_layernorm is IdentityOp
    if experts:
        from hpcrl.trainer.megatron.experts import use_grouped_experts

        use_grouped_experts(layer.mlp)
    spec = fam.adapt_spec(spec)
    return TransformerBlockSubmodules(
        layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=fam.norm
    )


def uses_local_spec(fam: GPTFamily) -> bool:
    return fam.local_spec_only or not have_transformer_engine()


def uses_fused_norms(fam: GPTFamily) -> bool:
    """TE's spec folds the pre-attention/pre-MLP norms into linear_qkv / linear_fc1 (weight names differ)."""
    return not uses_local_spec(fam)


def transformer_config(hf: Any, trainer: MegatronTrainerConfig, par: TrainParallel, *, device: str) -> Any:
    """fp32 parameters (the optimizer's master copy); on GPUs with ``precision: bfloat16`` the forward
    runs under bf16 autocast (the pipeline schedules apply it), as the fsdp backend's mixed precision."""
    from megatron.core.transformer import TransformerConfig

    on_gpu = device != "cpu"
    autocast = on_gpu and trainer.precision is Precision.bfloat16
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    fields = dict(
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
        qk_layernorm=hf.model_type in ("qwen3", "qwen3_moe"),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        context_parallel_size=par.cp,
        expert_model_parallel_size=par.ep,
        sequence_parallel=trainer.sequence_parallel and par.tp > 1,
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
    return TransformerConfig(**{**fields, **moe_settings(hf, trainer), **family_of(hf).config_fields(hf)})


def moe_settings(hf: Any, trainer: MegatronTrainerConfig) -> dict[str, Any]:
    """Megatron's MoE fields for a Qwen3-MoE or Gemma 4 MoE checkpoint (empty for dense models): every
    layer an MoE of ``num_experts`` GLU experts, top-k routing as Hugging Face does it (softmax over all experts
    then top-k when the top-k weights are not renormalised; top-k then softmax when they are, which is
    the same as renormalising), dropless, tokens exchanged by all-to-all over the EP group."""
    if not num_experts(hf):
        return {}
    if getattr(hf, "decoder_sparse_step", 1) != 1 or getattr(hf, "mlp_only_layers", None):
        raise ValueError(
            "trainer=megatron builds Qwen3-MoE with an MoE in every layer "
            "(decoder_sparse_step=1, no mlp_only_layers); use trainer=fsdp"
        )
    coeff = trainer.moe_aux_loss_coeff
    if coeff is None:
        coeff = float(getattr(hf, "router_aux_loss_coef", 0.0) or 0.0)
    gemma4 = family(hf) == "gemma4"  # top-k weights always renormalised (then scaled per expert: gemma4.py)
    return {
        "num_moe_experts": hf.num_experts,
        "moe_ffn_hidden_size": hf.moe_intermediate_size,
        "moe_router_topk": hf.top_k_experts if gemma4 else hf.num_experts_per_tok,
        "moe_router_pre_softmax": not (gemma4 or getattr(hf, "norm_topk_prob", False)),
        "moe_router_load_balancing_type": "aux_loss" if coeff > 0 else "none",
        "moe_aux_loss_coeff": coeff,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "expert_tensor_parallel_size": trainer.expert_tp,
    }
