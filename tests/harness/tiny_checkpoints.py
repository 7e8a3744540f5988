"""Tiny random Hugging Face checkpoints of each catalog family, with the layer kinds of a catalog
model: ``kinds_of(model)`` reads what a backend's build depends on from ``conf/model/<name>.yaml``
(family, MoE, VLM class, sliding/global attention, Gemma 4's keys-as-values global layers,
per-layer embeddings with KV-shared layers, double-wide MLPs, the unified checkpoint, Nemotron-H's
hybrid layer kinds and LatentMoE), ``save_tiny(kinds, out)`` saves a model of those kinds at a width
every parallel degree of 2 splits (4 heads, 2 KV heads, 2 KV heads on Gemma 4's global layers too,
4-8 experts, 8 Mamba heads in 4 groups, an even layer count).

Shapes follow the parity fixtures of tests/test_megatron.py and tests/megatron/test_megatron_nemotron_h.py
(4-token windows, so the parity batch's sequences cross them); norms are left at their initial values:
these checkpoints are for builds and steps, not for numerics."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpcrl.config.model import ModelConfig

VOCAB = 128


@dataclass(frozen=True)
class Kinds:
    """What a catalog model is built of, as far as a training backend's build can tell."""

    family: str
    tied: bool = False
    moe: bool = False
    vlm: bool = False
    windowed: bool = False
    """Sliding-window layers beside global ones (Gemma)."""
    keys_as_values: bool = False
    """Gemma 4 31B/26B-A4B/12B: the global layers' keys double as their values (``global_kv_heads``)."""
    per_layer: bool = False
    """Gemma 4 E2B/E4B: per-layer embeddings and KV-shared layers."""
    wide_mlp: bool = False
    """Gemma 4 E2B: double-wide MLPs on the KV-shared layers."""
    unified: bool = False
    """Gemma 4 12B: the ``gemma4_unified`` checkpoint."""
    layers: str = ""
    """Nemotron-H: the hybrid pattern's layer kinds (M Mamba-2, * attention, E MoE, - MLP)."""
    latent: bool = False
    """Nemotron-H: LatentMoE (experts in a latent width)."""

    def label(self) -> str:
        flags = [
            f for f in ("moe", "vlm", "windowed", "per_layer", "wide_mlp", "unified") if getattr(self, f)
        ]
        flags += ["k=v"] * self.keys_as_values + ["latent"] * self.latent + ["tied"] * self.tied
        return "-".join([self.family, *([self.layers] if self.layers else []), *flags])


def kinds_of(model: ModelConfig) -> Kinds:
    return Kinds(
        family=model.family,
        tied=model.tie_embeddings,
        moe=model.is_moe,
        vlm=model.vlm,
        windowed=model.sliding_window > 0,
        keys_as_values=model.global_kv_heads > 0,
        per_layer=model.per_layer_embed_dim > 0,
        wide_mlp=model.wide_mlp_layers > 0,
        unified=model.unified,
        layers="".join(k for k in "M*E-" if k in model.hybrid.pattern),
        latent=model.moe_latent_size > 0,
    )


def save_tiny(kinds: Kinds, out: Path) -> Path:
    """A random checkpoint of ``kinds`` saved in ``out`` (returned)."""
    builders = {
        "qwen2": _qwen_like,
        "qwen3": _qwen_like,
        "llama": _qwen_like,
        "qwen3_moe": _qwen_like,
        "gemma3": gemma3_model,
        "gemma4": gemma4_model,
        "nemotron_h": nemotron_h_model,
    }
    if kinds.family not in builders:
        raise KeyError(
            f"no tiny checkpoint for family {kinds.family}: add one to tests/harness/tiny_checkpoints.py"
        )
    torch.manual_seed(0)
    builders[kinds.family](kinds).save_pretrained(out)
    return out


DENSE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _qwen_like(kinds: Kinds) -> Any:
    """Qwen2 / Llama (no head_dim field), Qwen3 (Q/K norms), Qwen3-MoE (4 experts, top-2)."""
    import transformers as tf

    classes = {
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    }
    config_cls, model_cls = (getattr(tf, name) for name in classes[kinds.family])
    extra: dict[str, Any] = {"head_dim": 16} if kinds.family.startswith("qwen3") else {}
    if kinds.moe:
        extra |= dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    return model_cls(config_cls(**DENSE, **extra, tie_word_embeddings=kinds.tied))


VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)


def gemma3_model(kinds: Kinds) -> Any:
    """4 layers: 4-token windows on 0-2, global layer 3 (PP=2 splits sliding from mixed)."""
    from transformers import Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Gemma3TextConfig

    text = Gemma3TextConfig(
        **{**DENSE, "num_hidden_layers": 4},
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=4,
        tie_word_embeddings=kinds.tied,
    )
    text.layer_types = ["sliding_attention"] * 3 + ["full_attention"]
    if not kinds.vlm:
        return Gemma3ForCausalLM(text)
    config = Gemma3Config(
        text_config=text.to_dict(),
        vision_config={**VISION, "image_size": 28, "patch_size": 14},
        mm_tokens_per_image=4,
        image_token_index=127,
        boi_token_index=125,
        eoi_token_index=126,
    )
    return Gemma3ForConditionalGeneration(config)


GEMMA4_TOKENS = dict(
    image_token_id=127,
    boi_token_id=125,
    eoi_token_id=126,
    video_token_id=124,
    boa_token_id=123,
    eoa_token_index=122,
    audio_token_id=121,
)


def gemma4_text(kinds: Kinds) -> dict[str, Any]:
    """Windows of 4 and global layers with twice the head size. Dense: sliding 0-2, global 3. MoE
    (26B-A4B's block: a dense MLP beside 4 experts, top-2): one sliding and one global layer. E-models:
    sliding/global twice, layers 2-3 reading the KV of 0-1, 16-wide per-layer embeddings."""
    types = ["sliding_attention"] * 3 + ["full_attention"]
    text: dict[str, Any] = {**DENSE, "num_hidden_layers": 4, "head_dim": 16, "global_head_dim": 32}
    text |= dict(sliding_window=4, tie_word_embeddings=kinds.tied, hidden_size_per_layer_input=0)
    if kinds.keys_as_values:
        text |= dict(attention_k_eq_v=True, num_global_key_value_heads=2)
    if kinds.moe:
        types = ["sliding_attention", "full_attention"]
        text |= dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    if kinds.per_layer:
        types = ["sliding_attention", "full_attention"] * 2
        text |= dict(hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2)
        text |= dict(use_double_wide_mlp=kinds.wide_mlp)
    return text | {"num_hidden_layers": len(types), "layer_types": types}


def gemma4_model(kinds: Kinds) -> Any:
    """Gemma4ForCausalLM / Gemma4ForConditionalGeneration (vision tower; the E-models' audio tower is
    left out: frozen by the quirk, it builds nothing in the trainer) / the unified checkpoint's class."""
    import transformers as tf

    text = gemma4_text(kinds)
    if kinds.unified:
        text.pop("hidden_size_per_layer_input")
        vision = dict(
            patch_size=4, pooling_kernel_size=1, mm_embed_dim=64, mm_posemb_size=16, output_proj_dims=64
        )
        config = tf.Gemma4UnifiedConfig(
            text_config=text, vision_config=vision, audio_config=None, **GEMMA4_TOKENS
        )
        return tf.Gemma4UnifiedForConditionalGeneration(config)
    if not kinds.vlm:
        return tf.Gemma4ForCausalLM(tf.Gemma4TextConfig(**text))
    vision = {**VISION, "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4}
    config = tf.Gemma4Config(text_config=text, vision_config=vision, audio_config=None, **GEMMA4_TOKENS)
    return tf.Gemma4ForConditionalGeneration(config)


NEMOTRON_H = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    mamba_num_heads=8,
    mamba_head_dim=16,
    ssm_state_size=16,
    n_groups=4,
    conv_kernel=4,
    chunk_size=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    moe_shared_expert_intermediate_size=64,
    routed_scaling_factor=5.0,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    mlp_hidden_act="relu2",
    num_nextn_predict_layers=0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
"""Nemotron 3 Super's layer kinds at a width TP/CP/EP 2 split (chunks of 8 tokens: the parity batch's
sequences cross them)."""


def nemotron_h_model(kinds: Kinds) -> Any:
    """Super's layers 4..11 (``MEM*EMEM``: every kind, 8 layers for PP=2), kept to the kinds asked for."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    if set(kinds.layers) - set("M*E"):
        raise KeyError(f"tiny nemotron_h has no {kinds.layers} layers yet: add them to NEMOTRON_H's pattern")
    pattern = "".join(k for k in "MEM*EMEM" if k in kinds.layers)
    config = NemotronHConfig(
        **NEMOTRON_H,
        hybrid_override_pattern=pattern,
        moe_latent_size=32 if kinds.latent else None,
        tie_word_embeddings=kinds.tied,
    )
    return NemotronHForCausalLM(config)


def save_engine_moe(out: Path, experts: int = 8) -> Path:
    """A tiny Qwen3-MoE both vLLM's CPU build and transformers run (vLLM-CPU's attention takes head
    sizes of 32 and up), with the project's character tokenizer: 2 layers of ``experts`` experts,
    top-2. Router weights at std 0.1 (``initializer_range``), so the top-k is not a coin toss."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from hpcrl.run.tiny_model import build_tokenizer

    shape = {**DENSE, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}
    config = Qwen3MoeConfig(
        **shape,
        num_experts=experts,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(out)
    build_tokenizer(out, VOCAB)
    return out
