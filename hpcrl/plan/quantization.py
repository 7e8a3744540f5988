"""The planner's checks of ``rollout.quantization`` (FP8 rollout, BF16 training)."""

from __future__ import annotations

from hpcrl.config.model import ModelConfig
from hpcrl.config.schema import RunConfig
from hpcrl.errors import ConfigError
from hpcrl.plan.topology import on_gpus
from hpcrl.rollout.backends import served_weights
from hpcrl.rollout.config import CPU_QUANTIZATION

FP8_BLOCK = 128
"""vLLM quantizes activations in groups of 128 along a linear layer's input (``per_token_group_quant_fp8``
asserts it divides the input), so every linear input width on one TP rank must be a multiple."""


def check_quantization(cfg: RunConfig, rollout_tp: int) -> None:
    """``rollout.quantization``: GPU engines, an IS correction for the engine/trainer gap, a model whose
    linear inputs split into 128-wide groups on each of the ``rollout_tp`` ranks."""
    served = served_weights(cfg.rollout)
    if served is None or served.quantization is None:
        return
    key = f"rollout.quantization={served.quantization}"
    if not on_gpus(cfg.cluster):
        raise ConfigError(CPU_QUANTIZATION.format(served.quantization))
    if cfg.algo.is_correction.value == "none":
        raise ConfigError(
            f"{key} samples from FP8 weights while the trainer scores in BF16: set algo.is_correction=tis "
            "(or icepop) so the importance correction covers the gap"
        )
    if cfg.model.vlm and not served.language_model_only:
        raise ConfigError(
            f"{key}: the vision towers would be quantized too; set rollout.language_model_only=true "
            "(text prompts) or rollout.quantization=null"
        )
    for name, width in linear_inputs(cfg.model, rollout_tp).items():
        if width % FP8_BLOCK:
            raise ConfigError(
                f"{key}: {cfg.model.name}'s {name} ({width} per rank at rollout.tp={rollout_tp}) is not a "
                f"multiple of {FP8_BLOCK}, FP8's block; use rollout.quantization=null"
            )


def linear_inputs(model: ModelConfig, tp: int) -> dict[str, int]:
    """The input width of each kind of linear layer on one of ``tp`` ranks (row-parallel ones split)."""
    widths = {"hidden size": model.hidden_size}
    widths["attention output"] = model.num_attention_heads * model.head_dim // tp
    if model.global_head_dim:
        widths["global attention output"] = model.num_attention_heads * model.global_head_dim // tp
    if model.ffn_hidden_size:
        widths["MLP width"] = model.ffn_hidden_size // tp
    if model.is_moe and model.moe_ffn_hidden_size:
        widths["expert MLP width"] = model.moe_ffn_hidden_size // tp
    if model.hybrid.mamba_heads:
        widths["Mamba inner width"] = model.hybrid.mamba_heads * model.hybrid.mamba_head_dim // tp
    return widths
