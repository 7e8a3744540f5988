"""The megatron backend's checkpoint layout: this rank's weights and Adam state as pieces of one
layout-free model, so a checkpoint written under one TP/PP/EP/DP layout loads under another.

The layout-free model is Megatron's own names at TP=1 (``weights.to_megatron``'s), with three
changes that make it independent of the layout:
- a tensor whose TP split cuts several parts (fc1's gate and up halves, the Mamba in_proj's
  [z|x|B|C|dt], conv1d's [x|B|C]) is stored part by part (``<name>#part<j>``): each part is then one
  contiguous range per rank, whatever the TP size;
- the vocabulary keeps its real rows only: the padding rows (``padded_vocab`` depends on TP) are
  stored on their own under the TP size that made them (``<name>#pad/tp<n>``) and restored only
  under that size (a resharded resume starts them from the model directory's zeros);
- a tied output layer (its own copy on the last pipeline stage) is stored as the input embedding;
- norms Transformer Engine fuses into linear_qkv / linear_fc1 keep their unfused names.
Each piece of a TP-split tensor is a DTensor over its TP group (Shard(0) or Shard(1), torch.chunk
sizes, which are Megatron's); the rest are plain tensors that DCP de-duplicates over the replicas.
A parameter's Adam state takes the parameter's layout (``optim/exp_avg/<name>``, ``optim/exp_avg_sq/<name>``;
``optim/step/<name>`` a scalar), written by the rank whose optimizer shard holds it (Megatron's distributed
optimizer: any data-parallel rank).
"""

from __future__ import annotations

from typing import Any

import torch

from hpcrl.trainer.megatron.placement import Placement
from hpcrl.trainer.megatron.weights import COLUMN, ROW, is_split

VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
STATE = ("exp_avg", "exp_avg_sq")
UNFUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
"""Transformer Engine's spec keeps these norms inside linear_qkv / linear_fc1 (weights._norm_names)."""


def layout_of(name: str, placement: Placement) -> tuple[int, list[int]] | None:
    """(dim, the parts' global sizes along it) for a TP-split Megatron tensor: the parts it is cut in
    one by one. None: not split along a known dim."""
    parts = placement.parts_of(name)
    if parts:
        return 0, list(parts)
    if name.endswith("linear_fc1.weight") and parts is None:
        return 0, [-2]  # two equal halves (gate, up), sized from the tensor
    if name.endswith(COLUMN):
        return 0, [-1]
    if name.endswith(ROW):
        return 1, [-1]
    return None


class Pieces:
    """Builds the DCP state of one rank: views into its live tensors, so the same dict serves a save
    (DCP copies them) and a load (DCP writes into them)."""

    def __init__(self, placement: Placement, vocab: int, tied: bool) -> None:
        self.placement, self.vocab, self.tied = placement, vocab, tied
        self._meshes: dict[int, Any] = {}

    def key(self, local_name: str) -> str:
        name = self.placement.global_name(local_name)
        for fused, plain in UNFUSED_NORMS.items():  # the same keys with and without Transformer Engine
            name = name.replace(fused, plain)
        return VOCAB[0] if self.tied and name == VOCAB[1] else name

    def of(self, prefix: str, local_name: str, t: torch.Tensor) -> dict[str, Any]:
        """``t`` (this rank's slice of parameter ``local_name``, or a tensor shaped like it) as
        checkpoint pieces under ``prefix``."""
        t = t.detach()
        name, key = self.placement.global_name(local_name), prefix + self.key(local_name)
        tp, rank, group = self.placement.tp_of(local_name)
        if name in VOCAB:
            return self._vocab(key, t, tp, rank, group)
        layout = layout_of(name, self.placement) if is_split(name) else None
        if layout is None:
            return {key: t}
        dim, sizes = layout
        local = self._local_sizes(t.shape[dim], sizes, tp)
        out, start = {}, 0
        for j, n in enumerate(local):  # parts apart at every TP size: the keys do not depend on it
            piece = t.narrow(dim, start, n)
            start += n
            part = key if len(local) == 1 else f"{key}#part{j}"
            out[part] = self._dtensor(piece, dim, n * tp, group) if tp > 1 else piece
        return out

    @staticmethod
    def _local_sizes(width: int, sizes: list[int], tp: int) -> list[int]:
        if sizes[0] < 0:  # equal parts sized from the tensor
            return [width // -sizes[0]] * -sizes[0]
        return [n // tp for n in sizes]

    def _vocab(self, key: str, t: torch.Tensor, tp: int, rank: int, group: Any) -> dict[str, Any]:
        """Real rows as one tensor of ``vocab`` rows (torch.chunk's sizes are Megatron's: ceil(V/tp)
        rows a rank, the last holding the rest); the padding rows apart, per TP size."""
        if tp == 1:
            out = {key: t[: self.vocab]}
            return out | ({f"{key}#pad/tp1": t[self.vocab :]} if t.shape[0] > self.vocab else {})
        rows = t.shape[0]
        real = max(0, min(rows, self.vocab - rank * rows))
        if real < rows and rank < tp - 1:
            raise ValueError(
                f"{key}: padding rows on TP rank {rank} of {tp} (vocab {self.vocab}): not supported"
            )
        out = {key: self._dtensor(t[:real], 0, self.vocab, group)}
        return out | ({f"{key}#pad/tp{tp}": t[real:]} if real < rows else {})

    def _dtensor(self, piece: torch.Tensor, dim: int, global_size: int, group: Any) -> Any:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = self._meshes.get(id(group))
        if mesh is None:
            mesh = self._meshes[id(group)] = DeviceMesh.from_group(group, piece.device.type)
        shape = list(piece.shape)
        shape[dim] = global_size
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(piece, mesh, [Shard(dim)], shape=torch.Size(shape), stride=stride)


def model_pieces(pieces: Pieces, loaded: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, t in loaded:
        out.update(pieces.of("model/", name, t))
    return out


def optimizer_pieces(pieces: Pieces, model: Any, optimizers: list[Any]) -> dict[str, Any]:
    """The Adam state this rank's optimizer shards hold, laid out as their parameters."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, Any] = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                st, name = opt.state[p], names[id(p)]
                for k in STATE:
                    out.update(pieces.of(f"optim/{k}/", name, st[k]))
                out[f"optim/step/{pieces.key(name)}"] = st["step"]
    return out


def restorable(state: dict[str, Any], path: str) -> dict[str, Any]:
    """``state`` less the padding rows the checkpoint has not under this TP size (they stay as the
    model directory had them); any other key it lacks fails here, naming it."""
    have = saved_keys(path)
    missing = [k for k in state if k not in have and "#pad/" not in k]
    if missing:
        raise ValueError(
            f"checkpoint {path} has no {missing[0]} ({len(missing)} tensors missing): it was written "
            "for another model, or by a layout whose pieces this one cannot map"
        )
    return {k: v for k, v in state.items() if k in have}


def saved_keys(path: str) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(path).read_metadata().state_dict_metadata)
