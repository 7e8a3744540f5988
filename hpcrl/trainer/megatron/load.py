"""This rank's part of a Hugging Face checkpoint, streamed in unit by unit (a layer, or one weight
outside the layers) so that no rank reads the whole checkpoint: only its pipeline stage's layers,
its expert-parallel rank's experts, and of a weight the conversion passes through unchanged only
this rank's tensor-parallel slice.

The name mapping stays in weights.py / weights_hybrid.py: each unit is first converted on meta
tensors (shapes, no data). ``to_megatron`` hands a weight that maps one to one on as the same tensor
object, so identity says which Megatron weights can be sliced straight from the file (the slice
``weights.shard`` would cut, worked out by cutting an index probe); the rest (fused Q/K/V, gate|up,
a padded vocab, Gemma 4's stacked experts) are converted from that layer's whole tensors and cut.
At most one layer's full-width tensors are held beside the rank's model.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from hpcrl.trainer.hf_checkpoint import HFCheckpoint
from hpcrl.trainer.megatron.placement import Placement, fill
from hpcrl.trainer.megatron.weights import ROW, LanguageModel, Shape, is_split, shard

UNIT = re.compile(r"^(.*?\blayers\.\d+)\.")
"""A layer's weights are one unit (``model.layers.3``, ``backbone.layers.3``, ``mtp.layers.0``)."""
HF_EXPERT = re.compile(r"\.experts\.(\d+)\.")
MEG_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


@dataclass(frozen=True)
class Source:
    """The checkpoint being loaded and how its names map: ``lm`` names its text decoder (meta
    tensors), ``mapping`` is weights or weights_hybrid for ``shape``."""

    ckpt: HFCheckpoint
    lm: LanguageModel
    mapping: ModuleType
    shape: Shape
    tied: bool

    def to_megatron(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(self.mapping.to_megatron(hf, self.shape, self.tied))


def stream_checkpoint(source: Source, placement: Placement, models: list[Any]) -> set[str]:
    """Fill ``models`` (this rank's policy and reference: the same placement) from ``source``, a unit
    (layer) at a time. Raises for a parameter left without a weight; returns the whole checkpoint's
    Megatron names (for ``Placement.check_every_weight_used``)."""
    targets = [placement.targets(m) for m in models]
    filled: list[set[str]] = [set() for _ in models]
    every: set[str] = set()
    for unit in units(source.lm.text):
        meta = source.to_megatron({n: source.lm.text[n] for n in unit})
        every |= meta.keys()
        need = [k for k in meta if k in targets[0]]
        if not need:  # another stage's layer, or a weight dropped by name (Nemotron-H's MTP)
            continue
        shards = _read_unit(source, placement, unit, meta, need)
        for t, done in zip(targets, filled, strict=True):
            done |= fill(t, shards)
        del shards  # before the next unit's are read
    for m, done in zip(models, filled, strict=True):
        placement.check_filled(m, done)
    return every


def units(text: dict[str, Any]) -> list[list[str]]:
    """The checkpoint's names by unit: one list per layer, one per weight outside the layers."""
    out: dict[str, list[str]] = defaultdict(list)
    for name in text:
        m = UNIT.match(name)
        out[m.group(1) if m else name].append(name)
    return list(out.values())


def _read_unit(
    source: Source, placement: Placement, unit: list[str], meta: dict[str, torch.Tensor], need: list[str]
) -> dict[str, torch.Tensor]:
    """This rank's slices of the Megatron weights ``need`` of one unit (``meta``: the unit converted on
    meta tensors)."""
    ckpt, lm = source.ckpt, source.lm
    by_id = {id(lm.text[n]): n for n in unit}
    direct = {k: by_id[id(meta[k])] for k in need if id(meta[k]) in by_id}
    out = {k: _read_slice(ckpt, lm.source(n), k, placement) for k, n in direct.items()}
    fused = [k for k in need if k not in direct]
    if fused:
        # the weights passed through stay meta (read above, sliced); of the experts only those whose
        # fused weights this rank holds are read
        passed = {by_id[id(t)] for t in meta.values() if id(t) in by_id}
        experts = {int(m.group(1)) for k in fused if (m := MEG_EXPERT.search(k))}
        inputs = {
            n: lm.text[n] if n in passed else ckpt.get(lm.source(n))
            for n in unit
            if (e := HF_EXPERT.search(n)) is None or int(e.group(1)) in experts
        }
        full = source.to_megatron(inputs)
        for k in fused:
            tp, rank, _ = placement.tp_of(k)
            out[k] = shard(k, full[k], tp, rank, placement.parts_of(k))
    return out


def _read_slice(ckpt: HFCheckpoint, source: str, key: str, placement: Placement) -> torch.Tensor:
    """This rank's slice of Megatron weight ``key``, a one-to-one copy of checkpoint weight ``source``:
    only the rows (or columns) ``weights.shard`` would keep are read."""
    tp, rank, _ = placement.tp_of(key)
    if tp == 1 or not is_split(key):
        return ckpt.get(source)
    parts = placement.parts_of(key)
    dim = 1 if key.endswith(ROW) and not parts else 0
    size = ckpt.shape(source)[dim]
    probe = torch.arange(size).reshape([size if d == dim else 1 for d in range(2)])
    kept = shard(key, probe, tp, rank, parts).flatten().tolist()
    runs, start = [], 0  # the kept indices as contiguous runs (several: one per part)
    for i in range(1, len(kept) + 1):
        if i == len(kept) or kept[i] != kept[i - 1] + 1:
            runs.append(slice(kept[start], kept[i - 1] + 1))
            start = i
    out = torch.cat([ckpt.read(source, r, dim) for r in runs], dim=dim)
    expected = shard(key, ckpt.meta(source), tp, rank, parts).shape
    assert out.shape == expected, f"{key}: read {tuple(out.shape)}, the shard is {tuple(expected)}"
    return out
