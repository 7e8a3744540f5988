"""Hugging Face <-> Megatron-core weights for Nemotron-H (the hybrid stack of families/nemotron_h.py),
named as Megatron-Bridge's NemotronH bridge names them, so a Bridge or NeMo RL user reads the same keys.

The checkpoint's own names are ``backbone.*`` with one tensor pair per routed expert; one layer per
pattern symbol, its block norm ``backbone.layers.<i>.norm.weight`` landing in the slot of that layer's
kind (Mamba ``norm``, attention ``input_layernorm``, MoE/MLP ``pre_mlp_layernorm``). At TP=1 every
Megatron tensor equals the Hugging Face one except attention's fused Q/K/V; under TP the Mamba mixer's
``in_proj`` rows [z | x | B | C | dt] and ``conv1d`` channels [x | B | C] are cut part by part, so each
rank holds [z_r | x_r | B_r | C_r | dt_r] (``partitions``, applied by weights.shard / unshard).

The multi-token-prediction layers (``mtp.layers.<i>``, ``Shape.mtp`` their kinds) keep their
checkpoint names' layout: ``mtp_block.layers.<i>.<the Megatron name of a decoder layer of that kind>``, and
a depth's ``enorm`` / ``hnorm`` / ``eh_proj`` / ``final_layernorm`` as they are (megatron/mtp.py).
A model that does not carry them (no ``trainer.mtp_loss_scale``) drops them by name (``MTP_PREFIX``).
"""

from __future__ import annotations

import re

import torch

from hpcrl.trainer.megatron.weights import Shape, pad_vocab, qkv_fused, qkv_split

MTP_PREFIX = "mtp."
MIXER = (
    "in_proj.weight",
    "conv1d.weight",
    "conv1d.bias",
    "A_log",
    "D",
    "dt_bias",
    "norm.weight",
    "out_proj.weight",
)
NORM_SLOT = {
    "M": "norm.weight",
    "*": "input_layernorm.weight",
    "E": "pre_mlp_layernorm.weight",
    "-": "pre_mlp_layernorm.weight",
}
LAYER_KEYS = {
    "*": {"mixer.o_proj.weight": "self_attention.linear_proj.weight"},
    "E": {
        "mixer.gate.weight": "mlp.router.weight",
        "mixer.gate.e_score_correction_bias": "mlp.router.expert_bias",
        "mixer.fc1_latent_proj.weight": "mlp.fc1_latent_proj.weight",
        "mixer.fc2_latent_proj.weight": "mlp.fc2_latent_proj.weight",
        "mixer.shared_experts.up_proj.weight": "mlp.shared_experts.linear_fc1.weight",
        "mixer.shared_experts.down_proj.weight": "mlp.shared_experts.linear_fc2.weight",
    },
    "-": {"mixer.up_proj.weight": "mlp.linear_fc1.weight", "mixer.down_proj.weight": "mlp.linear_fc2.weight"},
    "M": {f"mixer.{k}": f"mixer.{k}" for k in MIXER},
}
HF_LAYER = re.compile(r"^(backbone|mtp)\.layers\.(\d+)\.(.+)$")
MEG_LAYER = re.compile(r"^(decoder|mtp_block)\.layers\.(\d+)\.(.+)$")
MTP_BLOCK = "mtp_block"
"""The MTP layers' Megatron module (megatron/mtp.py): megatron-core gives ``mtp`` a meaning of its own."""
MTP_OWN = {f"{n}.weight" for n in ("enorm", "hnorm", "eh_proj", "final_layernorm")}
"""A depth's own weights, on its first (last: ``final_layernorm``) layer, under one name both sides."""
HF_EXPERT = re.compile(r"^mixer\.experts\.(\d+)\.(up|down)_proj\.weight$")
MEG_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
QKV = "self_attention.linear_qkv.weight"


def partitions(shape: Shape) -> dict[str, tuple[int, ...]]:
    """Megatron names (suffixes) whose column split is per part: the Mamba in_proj and conv1d, and
    the squared-ReLU MLPs' ``linear_fc1`` (one part: no gate/up halves)."""
    inner, gn, heads = shape.mamba
    return {
        "mixer.in_proj.weight": (inner, inner, gn, gn, heads),
        "mixer.conv1d.weight": (inner, gn, gn),
        "mixer.conv1d.bias": (inner, gn, gn),
        "linear_fc1.weight": (),
    }


def to_megatron(hf: dict[str, torch.Tensor], shape: Shape, tied: bool) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in hf.items():
        if name.startswith(MTP_PREFIX) and not shape.mtp:
            continue
        if name == "backbone.embeddings.weight":
            out["embedding.word_embeddings.weight"] = pad_vocab(t, shape)
            if tied:  # here, not after the loop: the loader converts one weight (or layer) at a time
                out["output_layer.weight"] = out["embedding.word_embeddings.weight"]
        elif name == "lm_head.weight":
            if not tied:
                out["output_layer.weight"] = pad_vocab(t, shape)
        elif name == "backbone.norm_f.weight":
            out["decoder.final_norm.weight"] = t
        elif m := HF_LAYER.match(name):
            mtp, i, key = m.group(1) == "mtp", int(m.group(2)), m.group(3)
            kind = (shape.mtp if mtp else shape.pattern)[i]
            pre = f"{MTP_BLOCK if mtp else 'decoder'}.layers.{i}"
            if mtp and key in MTP_OWN:
                out[f"{pre}.{key}"] = t
            elif key == "norm.weight":
                out[f"{pre}.{NORM_SLOT[kind]}"] = t
            elif key in LAYER_KEYS[kind]:
                out[f"{pre}.{LAYER_KEYS[kind][key]}"] = t
            elif kind == "*" and key in {f"mixer.{p}_proj.weight" for p in "qkv"}:
                qkv.setdefault(pre, {})[key[len("mixer.") : key.index("_")]] = t
            elif kind == "E" and (e := HF_EXPERT.match(key)):
                fc = "linear_fc1" if e.group(2) == "up" else "linear_fc2"
                out[f"{pre}.mlp.experts.local_experts.{e.group(1)}.{fc}.weight"] = t
            else:
                raise KeyError(f"no Megatron name for Hugging Face weight {name!r} (layer kind {kind!r})")
        else:
            raise KeyError(f"no Megatron name for Hugging Face weight {name!r}")
    for pre, p in qkv.items():
        # every attention layer has the model's shape (Nemotron-H's Shape.layers is empty)
        out[f"{pre}.{QKV}"] = qkv_fused(p["q"], p["k"], p["v"], shape.attention(0), shape.heads)
    return out


def to_hf(
    meg: dict[str, torch.Tensor], shape: Shape, tied: bool, contiguous: bool = True
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in meg.items():
        if name == "embedding.word_embeddings.weight":
            out["backbone.embeddings.weight"] = t[: shape.vocab]
        elif name == "output_layer.weight":
            out["lm_head.weight"] = t[: shape.vocab]
        elif name == "decoder.final_norm.weight":
            out["backbone.norm_f.weight"] = t
        elif m := MEG_LAYER.match(name):
            mtp, i, key = m.group(1) == MTP_BLOCK, int(m.group(2)), m.group(3)
            kind = (shape.mtp if mtp else shape.pattern)[i]
            pre = f"{'mtp' if mtp else 'backbone'}.layers.{i}"
            back = {v: k for k, v in LAYER_KEYS[kind].items()}
            if mtp and key in MTP_OWN:
                out[f"{pre}.{key}"] = t
            elif key == NORM_SLOT[kind]:
                out[f"{pre}.norm.weight"] = t
            elif key in back:
                out[f"{pre}.{back[key]}"] = t
            elif key == QKV:
                q, k, v = qkv_split(t, shape.attention(0), shape.heads)
                out.update({f"{pre}.mixer.{p}_proj.weight": w for p, w in zip("qkv", (q, k, v), strict=True)})
            elif e := MEG_EXPERT.match(key):
                proj = "up" if e.group(2) == "linear_fc1" else "down"
                out[f"{pre}.mixer.experts.{e.group(1)}.{proj}_proj.weight"] = t
            else:
                raise KeyError(f"no Hugging Face name for Megatron weight {name!r}")
        else:
            raise KeyError(f"no Hugging Face name for Megatron weight {name!r}")
    if tied and "backbone.embeddings.weight" in out:
        out["lm_head.weight"] = out["backbone.embeddings.weight"]
    return {k: v.contiguous() for k, v in out.items()} if contiguous else out
