"""What Megatron-core builds for a checkpoint: its family (``family_of``: families/table.py), the
TransformerConfig (the family's architecture fields over the run's parallelism and precision) and the
layer spec.

Layer spec: Transformer Engine's when it is installed, the model runs on a GPU and the family allows
it (``uses_local_spec`` decides, once per trainer: its answer is passed on as ``te``); otherwise Megatron's
local spec with two slots filled by hpcrl — core attention: ``SDPAttention`` (attention.py: torch
SDPA, sliding windows, context parallel), norms: ``SPNorm`` (norms.py: sequence parallel allowed) —
then changed by the family's ``adapt_spec``. Also the checkpoint's text config and the embedding's
untrained pad row, which every family shares.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from hpcrl.core.parallel import TrainParallel
from hpcrl.trainer.config import MegatronTrainerConfig, Precision, megatron_family
from hpcrl.trainer.megatron.attention import SDPAttention
from hpcrl.trainer.megatron.families.base import GPTFamily
from hpcrl.trainer.megatron.spec_utils import have_transformer_engine


def family(hf: Any) -> str:
    """The catalog family (``model.family``: conf/model/*.yaml) of a Hugging Face text config."""
    return megatron_family(hf.model_type)


def family_of(hf: Any) -> GPTFamily:
    """The family that builds this text config, from the table (its checks already run)."""
    # imported here: the Gemma families import Megatron-core at module level, and compat.prepare
    # checks its version before anything imports it (importing spec.py imports no Megatron-core)
    from hpcrl.trainer.megatron.families.table import FAMILIES

    name = family(hf)
    if name not in FAMILIES:
        raise ValueError(
            f"trainer=megatron cannot build model_type {hf.model_type!r} yet "
            f"(supported: {', '.join(FAMILIES)}); use trainer=fsdp"
        )
    return FAMILIES[name](hf)


def num_experts(hf: Any) -> int:
    """Routed experts per MoE layer (0: a dense model): Qwen3-MoE, Gemma 4's MoE block (26B-A4B)."""
    return family_of(hf).num_experts(hf)


def text_config(model_dir: Any) -> Any:
    """The checkpoint's text-decoder config. A heterogeneous one (Gemma 4: ``per_layer_config``)
    answers model-wide fields with the default layers' values (Gemma 4: the sliding layers');
    families/gemma4.py reads the layers that depart from them."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir).get_text_config()
    if getattr(hf, "per_layer_config", None) is not None:
        hf.allow_global_per_layer_attribute_access = True
    return hf


def layer_spec(config: Any, fam: GPTFamily, te: bool) -> Any:
    """The decoder spec GPTModel takes, for this pipeline stage's layers (``te``: Transformer Engine's,
    experts through its grouped GEMM)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    experts, qk_norm = config.num_moe_experts, bool(config.qk_layernorm)
    if te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, qk_layernorm=qk_norm, moe_grouped_gemm=bool(experts)
        )
        # hpcrl's attention, not TEDotProductAttention: packed rows (their bounds) and context
        # parallel's chunks run one way with TE's linears or without (TE's takes THD + cu_seqlens)
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
        if experts:
            from hpcrl.trainer.megatron.experts import use_fp32_router

            use_fp32_router(spec.submodules.mlp)
        return spec
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
        from hpcrl.trainer.megatron.experts import use_fp32_router, use_grouped_experts

        use_grouped_experts(layer.mlp)
        use_fp32_router(layer.mlp)
    spec = fam.adapt_spec(spec)
    return TransformerBlockSubmodules(
        layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=fam.norm
    )


def uses_local_spec(fam: GPTFamily, device: str | torch.device) -> bool:
    """The one place that picks the layers: Transformer Engine's where it imports, the model runs on
    a GPU (TE has no CPU kernels) and the family has a TE build (not ``local_spec_only``); else
    Megatron's local spec with hpcrl's pieces (the same numbers as before TE was ever installed)."""
    return fam.local_spec_only or torch.device(device).type != "cuda" or not have_transformer_engine()


def describe_layers(fam: GPTFamily, te: bool) -> str:
    """The layers a build runs, for the startup log (beside trainer/kernels.py's Kernels line)."""
    if te:
        norms = "its norms fused into the linears" if folds_norms(fam, te) else "hpcrl's norms"
        return (
            f"Transformer Engine linears, {norms}, SDPA attention, MoE experts (if any) on TE's grouped GEMM"
        )
    why = (
        "family builds the local spec only"
        if fam.local_spec_only
        else "Transformer Engine absent or the model on the CPU"
    )
    return f"megatron local spec ({why}): torch linears and SDPA attention, experts on torch grouped_mm"


def folds_norms(fam: GPTFamily, te: bool) -> bool:
    """TE's GPT spec folds the pre-attention/pre-MLP norms into linear_qkv / linear_fc1 (weight names
    differ: weights._norm_names). A hybrid family's TE build keeps its own norms
    (families/nemotron_h.py says why). Both keep hpcrl's SDPAttention (``layer_spec``)."""
    return te and not fam.hybrid


def transformer_config(
    hf: Any,
    fam: GPTFamily,
    trainer: MegatronTrainerConfig,
    par: TrainParallel,
    *,
    device: str,
    te: bool = False,
) -> Any:
    """The run's fields (``run_fields``), the family's architecture over them, its MoE fields (``te``:
    the experts on Transformer Engine's grouped GEMM)."""
    from megatron.core.transformer import TransformerConfig

    moe = fam.moe_fields(hf, trainer)
    if moe and te:
        moe["moe_grouped_gemm"] = True
    return TransformerConfig(**{**run_fields(trainer, par, device=device), **fam.config_fields(hf), **moe})


def run_fields(trainer: MegatronTrainerConfig, par: TrainParallel, *, device: str) -> dict[str, Any]:
    """TransformerConfig fields the run sets: parallelism, recompute, fp32 parameters (the optimizer's
    master copy) and, on GPUs with ``precision: bfloat16``, the forward under bf16 autocast (the
    pipeline schedules apply it), as the fsdp backend's mixed precision; fusions where they run."""
    on_gpu = device != "cpu"
    autocast = on_gpu and trainer.precision is Precision.bfloat16
    return dict(
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
