"""The Megatron model for a Hugging Face checkpoint: whether this backend can build it
(``check_buildable``), Megatron's parallel groups, the GPTModel of this rank's pipeline stage with its
family's pieces (``build_model``), and the checkpoint's shape in Megatron's terms (``model_shape``).

At TP=1 the model can return its final hidden states instead of logits (``HiddenOutput``): the loss
then reads log-probs from them in chunks (trainer/logprob_head.py).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from hpcrl.core.parallel import TrainParallel
from hpcrl.trainer.config import MegatronTrainerConfig
from hpcrl.trainer.megatron.families.base import GPTFamily
from hpcrl.trainer.megatron.spec import (
    folds_norms,
    keep_pad_row_untrained,
    layer_spec,
)
from hpcrl.trainer.megatron.weights import Shape


def check_buildable(hf: Any, arch: GPTFamily, t: MegatronTrainerConfig, par: TrainParallel) -> int:
    """Raise where this backend cannot build ``hf`` under ``par`` (an unknown family was refused by
    ``spec.family_of`` already); else the number of routed experts per MoE layer (0: dense)."""
    experts = arch.num_experts(hf)
    if experts and t.moe_gap(hf.model_type):  # the planner refuses it before submitting
        raise ValueError(t.moe_gap(hf.model_type))
    if experts % par.ep:
        raise ValueError(f"trainer.ep={par.ep} must divide the model's {experts} experts")
    if hf.num_hidden_layers % par.pp:
        raise ValueError(f"trainer.pp={par.pp} must divide the model's {hf.num_hidden_layers} layers")
    return experts


def init_parallel(par: TrainParallel, moe: bool, seed: int) -> None:
    """Megatron's TP/PP/CP/EP groups (once per process) and its model-parallel RNG seeds."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=par.tp,
            pipeline_model_parallel_size=par.pp,
            context_parallel_size=par.cp,
            expert_model_parallel_size=par.ep,
            expert_tensor_parallel_size=par.expert_tp if moe else None,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def model_shape(hf: Any, fam: GPTFamily, tp: int, te: bool = False) -> Shape:
    """``te``: built from Transformer Engine's layers (spec.uses_local_spec's answer)."""
    heads = hf.num_attention_heads
    padded = math.ceil(hf.vocab_size / tp) * tp
    return Shape(
        heads=heads,
        groups=hf.num_key_value_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        vocab=hf.vocab_size,
        padded_vocab=padded,
        fused_norms=folds_norms(fam, te),
        moe=bool(fam.num_experts(hf)),
        sandwich_norms=fam.sandwich_norms,
        layers=fam.attention_layouts(hf),
        moe_block=fam.moe_block,
        **fam.shape_fields(hf),
    )


def build_model(
    config: Any,
    hf: Any,
    arch: GPTFamily,
    shape: Shape,
    *,
    tied: bool,
    compute_dtype: torch.dtype,
    device: torch.device,
    hidden_output: bool,
    te: bool = False,
) -> Any:
    """This rank's pipeline stage of the GPTModel, or of the hybrid model for a hybrid family
    (randomly initialised: the caller loads weights); ``te``: of Transformer Engine's layers."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if arch.hybrid:
        from hpcrl.trainer.megatron.ssm import hybrid_model

        model = hybrid_model(
            config,
            arch.stack_layers(hf, config, te),
            pattern=shape.pattern,
            vocab_size=shape.padded_vocab,
            max_sequence_length=hf.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            tied=tied,
        )
    else:
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(config, arch, te),
            vocab_size=shape.padded_vocab,
            max_sequence_length=hf.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=tied,
            position_embedding_type="rope",
            **arch.rope(hf),
        )
    arch.adapt_model(model, hf, compute_dtype)
    if arch.pad_row_untrained:
        keep_pad_row_untrained(model, hf)
    return with_hidden_output(model.to(device), hidden_output)


def decoder_layers(model: Any) -> list[Any]:
    """This rank's decoder layers (GPTModel's TransformerBlock and the hybrid stack alike)."""
    return list(getattr(getattr(model, "decoder", None), "layers", []))


def keep_autocast_in_recompute(model: Any, config: Any, device_type: str = "cuda") -> None:
    """Each decoder layer enters the forward's autocast itself. Megatron-core's full recompute
    (``trainer.activation_checkpointing``: ``tensor_parallel.checkpoint``) re-runs a layer's forward
    inside the backward pass, after the pipeline schedule's bf16 autocast (around the forward step
    only) has ended, and does not restore it as torch's checkpoint does: the recompute ran in fp32, so
    the backward took fp32 GEMMs (the 1.5B step at ~3.6k tokens/s on an H100, session 30) and gave
    gradients of an fp32 forward the loss never saw. Inside the forward the outer autocast is the same
    one: nothing changes there."""
    if not config.enable_autocast or config.recompute_granularity != "full":
        return
    for layer in decoder_layers(model):
        layer.forward = _under_autocast(layer.forward, device_type, config.autocast_dtype)


def _under_autocast(forward: Any, device_type: str, dtype: torch.dtype) -> Any:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    return run


def compile_layers(model: Any, moe: bool) -> None:
    """torch.compile each decoder layer; a layer with an MoE compiles its attention only (if it has
    one: a hybrid model's MoE layers have none): the token dispatcher calls record_stream, which
    torch.compile cannot functionalize (every Qwen3-MoE step raised on an H200)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for layer in decoder_layers(model):
        if not moe or not any(isinstance(m, MoELayer) for m in layer.modules()):
            layer.compile()
        elif isinstance(getattr(layer, "self_attention", None), torch.nn.Module):
            layer.self_attention.compile()


class HiddenOutput(torch.nn.Module):
    """Stands in for ``GPTModel.output_layer`` (and keeps its weight, so names and the optimizer's
    parameters do not change): the model returns its final hidden states [b, s, h] instead of logits."""

    def __init__(self, layer: Any) -> None:
        super().__init__()
        self.weight = layer.weight  # None when tied to the input embedding

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return hidden, None


def with_hidden_output(model: Any, enabled: bool) -> Any:
    if enabled and getattr(model, "output_layer", None) is not None:
        model.output_layer = HiddenOutput(model.output_layer)
    return model
