"""Hugging Face <-> Megatron-core weights for Qwen2/Qwen3/Llama-family decoders, Qwen3-MoE, Gemma 3 and
Gemma 4 (sandwich norms map to ``linear_proj.post_layernorm`` / ``linear_fc2.post_layernorm``; Gemma 4's
global layers have their own head size and KV heads, and with ``attention_k_eq_v`` no V projection:
``Shape.layers``; its ``layer_scalar`` buffer keeps its name; 26B-A4B's MoE block: ``MOE_BLOCK_LAYER_KEYS``
and the experts' stacked tensors split per expert; a vision-language checkpoint's text decoder is picked
out by ``LanguageModel``).

Two steps each way. ``to_megatron`` turns HF tensors into Megatron names and layouts as one
unsharded (TP=1) model: Q/K/V fused per query group ([q heads of the group; k; v]), gate and up
fused into ``linear_fc1`` (per expert too: ``mlp.experts.local_experts.<e>`` with the global expert
index <e>; ``relocate`` maps an expert-parallel rank's local index to it), the MoE gate is the router. ``shard`` then cuts one tensor for one tensor-parallel rank
(column-parallel on dim 0 — fc1 per half, so each rank keeps matching gate and up rows —,
row-parallel on dim 1, norms replicated). ``unshard`` and ``to_hf`` invert both exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
HF_LAYER_KEYS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "mlp.gate.weight": "mlp.router.weight",
}
SANDWICH_LAYER_KEYS = {  # Gemma: a norm before and after both attention and the MLP
    **HF_LAYER_KEYS,
    "post_attention_layernorm.weight": "self_attention.linear_proj.post_layernorm.weight",
    "pre_feedforward_layernorm.weight": "pre_mlp_layernorm.weight",
    "post_feedforward_layernorm.weight": "mlp.linear_fc2.post_layernorm.weight",
    "layer_scalar": "layer_scalar",  # Gemma 4: a per-layer output scale (a buffer, never trained)
}
MOE_BLOCK_LAYER_KEYS = {  # Gemma 4 26B-A4B: a dense MLP and an MoE side by side, each with its norms
    **SANDWICH_LAYER_KEYS,
    "pre_feedforward_layernorm.weight": "mlp.dense_layernorm.weight",
    "post_feedforward_layernorm_1.weight": "mlp.linear_fc2.post_layernorm.weight",
    "pre_feedforward_layernorm_2.weight": "mlp.experts_layernorm.weight",
    "post_feedforward_layernorm_2.weight": "mlp.experts_post_layernorm.weight",
    "post_feedforward_layernorm.weight": "mlp.post_layernorm.weight",
    "router.proj.weight": "mlp.moe.router.weight",
    "router.scale": "mlp.moe.router.scale",
    "router.per_expert_scale": "mlp.moe.router.per_expert_scale",
}
EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
STACKED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")  # Gemma 4: [experts, out, in] tensors
MEGATRON_EXPERT = re.compile(
    r"^(mlp\.(?:moe\.)?experts\.local_experts\.)(\d+)\.(linear_fc1|linear_fc2)\.weight$"
)
TE_EXPERT = re.compile(r"\.experts\.(linear_fc[12])\.weight(\d+)$")
"""Transformer Engine's grouped experts (``TEGroupedMLP``): local expert j's weights are
``experts.linear_fc1.weight<j>`` / ``experts.linear_fc2.weight<j>``, one parameter per expert."""
MAMBA_MIXER = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias", "norm.weight")
"""A Mamba mixer's column-parallel weights (split by heads / channels; weights_hybrid.py maps them)."""
COLUMN = (
    *(f"mixer.{k}" for k in MAMBA_MIXER),
    "linear_qkv.weight",
    "linear_qkv.bias",
    "linear_fc1.weight",
    "word_embeddings.weight",
    "output_layer.weight",
    "eh_proj.weight",  # an MTP depth's input projection (megatron/mtp.py), column-parallel as Megatron's
)
ROW = ("linear_proj.weight", "linear_fc2.weight", "mixer.out_proj.weight")


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention shape where it departs from the model's (Gemma 4's global layers)."""

    groups: int
    head_dim: int
    values: bool = True
    """False: keys double as values (``attention_k_eq_v``): no V projection, linear_qkv holds [q; k]."""


@dataclass(frozen=True)
class Shape:
    heads: int
    groups: int
    head_dim: int
    vocab: int
    padded_vocab: int
    fused_norms: bool = False
    """Transformer Engine's spec keeps the norms inside linear_qkv / linear_fc1 (not an MoE's: ``moe``)."""
    moe: bool = False
    """Every decoder layer's MLP is an MoE (Qwen3-MoE): TE's spec keeps its pre-MLP norm apart."""
    sandwich_norms: bool = False
    """Gemma: post-attention / post-MLP norms (``linear_proj.post_layernorm``, ``linear_fc2.post_layernorm``)."""
    layers: dict[int, LayerAttention] | None = None
    """Layers (global index) whose attention has its own shape; the rest have ``groups`` x ``head_dim``."""
    moe_block: bool = False
    """Gemma 4 26B-A4B: every layer a dense MLP beside an MoE (``MOE_BLOCK_LAYER_KEYS``, ``mlp.moe.*``)."""
    pattern: str = ""
    """A hybrid model's layer kinds, one symbol a layer (Nemotron-H: weights_hybrid.py maps it)."""
    mamba: tuple[int, int, int] = (0, 0, 0)
    """A hybrid model's Mamba widths (inner = heads x head dim, groups x state, heads): in_proj's parts."""
    mtp: str = ""
    """The multi-token-prediction layers' kinds, one symbol a layer over every depth (Nemotron-H's
    ``mtp_layers_block_type`` times the depths) when the model carries them (``trainer.mtp_loss_scale``)."""

    def attention(self, layer: int) -> LayerAttention:
        return (self.layers or {}).get(layer) or LayerAttention(self.groups, self.head_dim)

    @property
    def layer_keys(self) -> dict[str, str]:
        """Hugging Face layer weight -> Megatron name, for weights that map one to one."""
        if self.moe_block:
            return MOE_BLOCK_LAYER_KEYS
        return SANDWICH_LAYER_KEYS if self.sandwich_norms else HF_LAYER_KEYS


VLM_LAYOUTS = {
    "language_model.model.": "language_model.lm_head.weight",
    "model.language_model.": "lm_head.weight",
}
"""Where a vision-language checkpoint (Gemma3ForConditionalGeneration) keeps its text decoder and
head: the published checkpoints' layout (which transformers still writes), and transformers' in-memory
names."""


@dataclass(frozen=True)
class LanguageModel:
    """A checkpoint's text decoder under causal-LM names (``model.*``, ``lm_head.weight``); ``text``
    may hold meta tensors (the loader builds it from the file headers: names and shapes only).

    For a vision-language checkpoint, ``prefix`` and ``head`` give the weights the checkpoint's own
    names back on export (what the rollout engines load and the fsdp backend exports), and
    ``left_out`` counts the vision tower and projector weights this backend does not train: they stay
    as loaded in the rollout engines."""

    text: dict[str, torch.Tensor]
    prefix: str = "model."
    head: str = "lm_head.weight"
    left_out: int = 0

    @classmethod
    def of(cls, state: dict[str, torch.Tensor]) -> LanguageModel:
        for prefix, head in VLM_LAYOUTS.items():
            if any(k.startswith(prefix) for k in state):
                text = {f"model.{k[len(prefix) :]}": v for k, v in state.items() if k.startswith(prefix)}
                if head in state:
                    text["lm_head.weight"] = state[head]
                return cls(text, prefix, head, len(state) - len(text))
        return cls(dict(state))

    def named(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Causal-LM names (``to_hf``'s) -> this checkpoint's."""
        if self.prefix == "model.":
            return hf
        return {self.source(k): v for k, v in hf.items()}

    def source(self, name: str) -> str:
        """The checkpoint's own name of the causal-LM name ``name``."""
        if self.prefix == "model.":
            return name
        return self.head if name == "lm_head.weight" else self.prefix + name.removeprefix("model.")


def _norm_names(shape: Shape) -> dict[str, str]:
    if not shape.fused_norms:
        return {}
    qkv = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight"}
    return qkv if shape.moe else {**qkv, "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def pad_vocab(t: torch.Tensor, shape: Shape) -> torch.Tensor:
    extra = shape.padded_vocab - t.shape[0]
    return torch.cat([t, t.new_zeros((extra, *t.shape[1:]))]) if extra else t


def to_megatron(hf: dict[str, torch.Tensor], shape: Shape, tied: bool) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    norms = _norm_names(shape)
    parts: dict[int, dict[str, torch.Tensor]] = {}  # layer -> its weights that are fused or split
    for name, t in hf.items():
        if name == "model.embed_tokens.weight":
            out["embedding.word_embeddings.weight"] = pad_vocab(t, shape)
            if tied:
                out["output_layer.weight"] = out["embedding.word_embeddings.weight"]
        elif name == "lm_head.weight":
            if not tied:
                out["output_layer.weight"] = pad_vocab(t, shape)
        elif name == "model.norm.weight":
            out["decoder.final_layernorm.weight"] = t
        elif m := LAYER.match(name.removeprefix("model.")):
            i, key = int(m.group(1)), m.group(2)
            if key in shape.layer_keys:
                mkey = shape.layer_keys[key]
                out[f"decoder.layers.{i}.{norms.get(mkey, mkey)}"] = t
            else:
                parts.setdefault(i, {})[key] = t
        else:
            raise KeyError(f"no Megatron name for Hugging Face weight {name!r}")
    for i, p in parts.items():
        out.update(_fused_layer(f"decoder.layers.{i}", p, shape.attention(i), shape.heads))
    return out


def qkv_fused(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, att: LayerAttention, heads: int
) -> torch.Tensor:
    """Q/K/V (weights or biases) fused per query group, as Megatron's ``linear_qkv``: [q heads of the
    group; k; v] for each group (no v: keys double as values)."""
    g, d, per = att.groups, att.head_dim, heads // att.groups
    kv = [k.reshape(g, d, -1)] + ([v.reshape(g, d, -1)] if v is not None else [])
    return torch.cat([q.reshape(g, per * d, -1), *kv], dim=1).reshape(-1, *q.shape[1:])


def qkv_split(t: torch.Tensor, att: LayerAttention, heads: int) -> list[torch.Tensor]:
    """Inverse of ``qkv_fused``: [q, k(, v)]."""
    g, d, per = att.groups, att.head_dim, heads // att.groups
    sizes = [per * d, d, d] if att.values else [per * d, d]
    parts = t.reshape(g, sum(sizes), -1).split(sizes, dim=1)
    return [p.reshape(-1, *t.shape[1:]) for p in parts]


def _fused_layer(
    pre: str, p: dict[str, torch.Tensor], att: LayerAttention, heads: int
) -> dict[str, torch.Tensor]:
    """One layer's Q/K/V, gate/up and expert weights (Hugging Face names under the layer) as
    Megatron's fused ones under ``pre``."""
    out: dict[str, torch.Tensor] = {}
    for kind in ("weight", "bias"):
        if f"self_attn.q_proj.{kind}" in p:
            q, k = p[f"self_attn.q_proj.{kind}"], p[f"self_attn.k_proj.{kind}"]
            v = p[f"self_attn.v_proj.{kind}"] if att.values else None
            out[f"{pre}.self_attention.linear_qkv.{kind}"] = qkv_fused(q, k, v, att, heads)
    if "mlp.gate_proj.weight" in p:
        out[f"{pre}.mlp.linear_fc1.weight"] = torch.cat([p["mlp.gate_proj.weight"], p["mlp.up_proj.weight"]])
    if STACKED_EXPERTS[0] in p:  # one [experts, 2 x ffn, hidden] and one [experts, hidden, ffn] tensor
        for e, (fc1, fc2) in enumerate(zip(p[STACKED_EXPERTS[0]], p[STACKED_EXPERTS[1]], strict=True)):
            out[f"{pre}.mlp.moe.experts.local_experts.{e}.linear_fc1.weight"] = fc1  # [gate; up], as Megatron
            out[f"{pre}.mlp.moe.experts.local_experts.{e}.linear_fc2.weight"] = fc2
    for e in sorted({int(m.group(1)) for key in p if (m := EXPERT.match(key))}):
        hf_pre, meg_pre = f"mlp.experts.{e}", f"{pre}.mlp.experts.local_experts.{e}"
        out[f"{meg_pre}.linear_fc1.weight"] = torch.cat(
            [p[f"{hf_pre}.gate_proj.weight"], p[f"{hf_pre}.up_proj.weight"]]
        )
        out[f"{meg_pre}.linear_fc2.weight"] = p[f"{hf_pre}.down_proj.weight"]
    known = {f"self_attn.{proj}_proj.{kind}" for proj in "qkv" for kind in ("weight", "bias")}
    known |= {"mlp.gate_proj.weight", "mlp.up_proj.weight", *STACKED_EXPERTS}
    left = [key for key in p if key not in known and not EXPERT.match(key)]
    if left:
        raise KeyError(
            f"no Megatron name for Hugging Face weight {pre.replace('decoder.', 'model.')}.{left[0]}"
        )
    return out


def to_hf(
    meg: dict[str, torch.Tensor], shape: Shape, tied: bool, contiguous: bool = True
) -> dict[str, torch.Tensor]:
    """Megatron names -> Hugging Face names; ``contiguous=False`` leaves views where it can (the
    weight stream copies them straight into its buckets)."""
    out: dict[str, torch.Tensor] = {}
    back = {v: k for k, v in shape.layer_keys.items()}
    unfused = {v: k for k, v in _norm_names(shape).items()}
    stacked: dict[str, dict[str, dict[int, torch.Tensor]]] = {}  # layer -> fc -> expert -> tensor
    for name, t in meg.items():
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = t[: shape.vocab]
        elif name == "output_layer.weight":
            out["lm_head.weight"] = t[: shape.vocab]  # sent even when tied: vLLM's reload does not re-tie
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = t
        else:
            m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
            if m is None:
                raise KeyError(f"no Hugging Face name for Megatron weight {name!r}")
            i, key = m.group(1), unfused.get(m.group(2), m.group(2))
            pre = f"model.layers.{i}"
            if key in back:
                out[f"{pre}.{back[key]}"] = t
            elif key.startswith("self_attention.linear_qkv."):
                kind = key.rsplit(".", 1)[1]
                for proj, part in zip(
                    "qkv", qkv_split(t, shape.attention(int(i)), shape.heads), strict=False
                ):
                    out[f"{pre}.self_attn.{proj}_proj.{kind}"] = part
            elif key == "mlp.linear_fc1.weight":
                gate, up = t.chunk(2)
                out[f"{pre}.mlp.gate_proj.weight"], out[f"{pre}.mlp.up_proj.weight"] = gate, up
            elif em := MEGATRON_EXPERT.match(key):
                slot, e, fc = em.group(1), int(em.group(2)), em.group(3)
                hf_pre = f"{pre}.mlp.experts.{e}"
                if slot.startswith("mlp.moe."):  # Gemma 4: stacked over the experts after the loop
                    stacked.setdefault(pre, {}).setdefault(fc, {})[e] = t
                elif fc == "linear_fc1":
                    out[f"{hf_pre}.gate_proj.weight"], out[f"{hf_pre}.up_proj.weight"] = t.chunk(2)
                else:
                    out[f"{hf_pre}.down_proj.weight"] = t
            else:
                raise KeyError(f"no Hugging Face name for Megatron weight {name!r}")
    for pre, fcs in stacked.items():
        for fc, hf_name in zip(("linear_fc1", "linear_fc2"), STACKED_EXPERTS, strict=True):
            out[f"{pre}.{hf_name}"] = torch.stack([t for _, t in sorted(fcs[fc].items())])
    if tied and "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return {k: v.contiguous() for k, v in out.items()} if contiguous else out


def expert_name(name: str) -> str:
    """The name SequentialMLP gives a TE grouped expert's weight (``TE_EXPERT``): the one boundary
    between the two, so the mapping, EP relocation, TP cuts, streaming and checkpoints all see one
    name per expert (``...experts.linear_fc1.weight3`` -> ``...experts.local_experts.3.linear_fc1.weight``)."""
    return TE_EXPERT.sub(lambda m: f".experts.local_experts.{m.group(2)}.{m.group(1)}.weight", name)


def is_expert(name: str) -> bool:
    return ".local_experts." in expert_name(name)


def is_split(name: str) -> bool:
    """Split over its tensor-parallel group (else replicated on every rank of it): the dense TP group,
    or for an expert's fc1/fc2 the expert-TP group (trainer.expert_tp)."""
    name = expert_name(name)
    return name.endswith(COLUMN) or name.endswith(ROW)


def is_sharded(name: str) -> bool:
    """Split over the dense tensor-parallel group (experts are split over expert TP: ``is_split``)."""
    return not is_expert(name) and is_split(name)


def shard(
    name: str, full: torch.Tensor, tp: int, rank: int, parts: tuple[int, ...] | None = None
) -> torch.Tensor:
    """This rank's slice of one unsharded Megatron tensor over a tensor-parallel group of ``tp``
    (the expert-TP group for an expert's weights: the caller picks). ``parts``: a column-parallel
    tensor cut part by part (each rank: its slice of every part, in order; () = one part), else by
    its name."""
    if tp == 1:
        return full
    name = expert_name(name)
    if parts:
        return torch.cat([p.chunk(tp)[rank] for p in full.split(list(parts))])
    if name.endswith("linear_fc1.weight") and parts is None:
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    if name.endswith(COLUMN):
        return full.chunk(tp, dim=0)[rank]
    if name.endswith(ROW):
        return full.chunk(tp, dim=1)[rank]
    return full


def unshard(name: str, parts: list[torch.Tensor], sizes: tuple[int, ...] | None = None) -> torch.Tensor:
    """Inverse of ``shard`` given every rank's slice in rank order (and the same ``sizes`` as its ``parts``)."""
    if len(parts) == 1:
        return parts[0]
    name = expert_name(name)
    if sizes:
        per_rank = [p.split([n // len(parts) for n in sizes]) for p in parts]
        return torch.cat([torch.cat([r[j] for r in per_rank]) for j in range(len(sizes))])
    if name.endswith("linear_fc1.weight") and sizes is None:
        halves = [p.chunk(2) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    if name.endswith(COLUMN):
        return torch.cat(parts, dim=0)
    if name.endswith(ROW):
        return torch.cat(parts, dim=1)
    return parts[0]


def relocate(name: str, offset: int, expert_offset: int = 0) -> str:
    """A pipeline stage's local layer name -> the model's global one (``decoder.layers.<i + offset>``);
    an expert-parallel rank's local expert -> its global index (``local_experts.<j + expert_offset>``),
    in the decoder's layers and the MTP layers' (``mtp_block.layers.<i>``: on the last stage, numbered
    on their own). A TE grouped expert's name comes out as SequentialMLP's (``expert_name``)."""
    name = expert_name(name)
    m = re.match(r"^(decoder|mtp_block)\.layers\.(\d+)\.(.+)$", name)
    if m is None:
        return name
    rest = re.sub(
        r"^(mlp\.(?:moe\.)?experts\.local_experts\.)(\d+)",
        lambda e: f"{e.group(1)}{int(e.group(2)) + expert_offset}",
        m.group(3),
    )
    layer = int(m.group(2)) + (offset if m.group(1) == "decoder" else 0)
    return f"{m.group(1)}.layers.{layer}.{rest}"
