"""Megatron weights to the rollout engines, one tensor at a time (``Trainer.stream_weights``).

Who sends what: each pipeline stage's dense tensors come from the stage's first rank (data-,
context- and tensor-parallel rank 0); each expert-parallel rank's experts from the first rank that
holds them (expert-data- and expert-tensor-parallel rank 0). A tensor split over tensor parallel is
gathered to its sender alone (``dist.gather``: the other ranks of its group only send their slice),
in the engines' dtype, when its turn comes; converted to Hugging Face names (``weights.to_hf``) as
views where it can; and freed once the sink copied it. Ranks whose group sends nothing skip it.

Names and shapes (``metas``) come from the same conversion run on meta tensors of the gathered
shapes: nothing is gathered to agree on them. The MTP layers' copy of the input embedding on the
last pipeline stage (megatron/mtp.py) is not sent: the first stage's is the same weight.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.sync.packer import let_go
from hpcrl.trainer.base import WeightSink, numel_of
from hpcrl.trainer.megatron.weights import is_expert, is_split, unshard

STACKED = re.compile(r"^(decoder\.layers\.\d+)\.mlp\.moe\.experts\.local_experts\.\d+\.")
"""Gemma 4's experts: Hugging Face stacks a layer's experts into one tensor, so they convert together."""
EMBEDDING = "embedding.word_embeddings.weight"


class WeightStream:
    def __init__(self, trainer: Any) -> None:
        self.t = trainer
        ps = trainer.ps
        self.dense_root = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
        self.expert_root = self._has_experts() and ps.get_expert_data_parallel_rank() == 0
        # A tied output layer is the embedding; with one stage the embedding's unit names it (to_hf),
        # with several the last stage holds (and sends) its own copy.
        self.tie = trainer.tied and trainer.par.pp == 1
        # the input embedding is the first stage's to send: a later stage's is the MTP layers' copy
        self.copy = None if ps.is_pipeline_first_stage() else EMBEDDING

    def _has_experts(self) -> bool:
        return any(is_expert(n) for n, _ in self.t.model.named_parameters())

    def units(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """This rank's parameters that its group sends, in conversion units (one tensor, or a
        Gemma 4 layer's experts), in order."""
        unit: list[tuple[str, torch.Tensor]] = []
        key: str | None = None
        for name, param in self.t.model.named_parameters():
            if not (self.expert_root if is_expert(name) else self.dense_root) or name == self.copy:
                continue
            m = STACKED.match(self.t.placement.global_name(name))
            k = m.group(1) if m else name
            if unit and k != key:
                yield unit
                unit = []
            unit.append((name, param))
            key = k
        if unit:
            yield unit

    def _sends(self, name: str) -> bool:
        _, tp_rank, _ = self.t.placement.tp_of(name)
        return tp_rank == 0

    def _convert(self, gathered: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        t = self.t
        if any(STACKED.match(n) for n in gathered) and t.par.ep > 1:
            raise ValueError(
                "streaming Gemma 4's stacked experts under trainer.ep > 1 is not supported yet: set trainer.ep=1"
            )
        hf = t.weights.to_hf(gathered, t.shape, self.tie, contiguous=False)
        return t.lm.named(hf)

    def metas(self) -> list[tuple[str, tuple[int, ...]]]:
        out: list[tuple[str, tuple[int, ...]]] = []
        for unit in self.units():
            if not self._sends(unit[0][0]):
                continue
            shaped = {}
            for name, p in unit:
                parts = [torch.empty(p.shape, device="meta")] * self._width(name)
                shaped[self.t.placement.global_name(name)] = unshard(
                    name, parts, self.t.placement.parts_of(name)
                )
            out += [(k, tuple(v.shape)) for k, v in self._convert(shaped).items()]
        return out

    def stream(self, sink: WeightSink | None, dtype: torch.dtype) -> None:
        for unit in self.units():
            sender = self._sends(unit[0][0])
            n = sum(numel_of(p.shape) * self._width(name) for name, p in unit)
            # the gathered parts, then their concatenation
            with sink.scratch(2 * n) if sink and sender else nullcontext():
                gathered = {
                    self.t.placement.global_name(name): self._gather(name, p, dtype, sender)
                    for name, p in unit
                }
                if sink and sender:
                    self._put(sink, gathered)
                del gathered  # freed before the next is gathered (no name of it outlives this block)

    def _put(self, sink: WeightSink, gathered: dict[str, torch.Tensor]) -> None:
        for hf_name, tensor in self._convert(gathered).items():
            sink.put(hf_name, tensor)

    def _width(self, name: str) -> int:
        tp, _, _ = self.t.placement.tp_of(name)
        return tp if tp > 1 and is_split(name) else 1

    def _gather(self, name: str, param: torch.Tensor, dtype: torch.dtype, sender: bool) -> torch.Tensor:
        """The whole tensor on its sender (the TP group's rank 0); an empty one elsewhere."""
        tp, _, group = self.t.placement.tp_of(name)
        if tp == 1 or not is_split(name):
            return param.detach().to(dtype) if sender else param[:0]
        local = param.detach().to(dtype).contiguous()
        root = dist.get_global_rank(group, 0)
        # the sender's own slice is its slot of the gather: n elements in all, then n for their join
        parts = [local] + [torch.empty_like(local) for _ in range(tp - 1)] if sender else None
        dist.gather(local, parts, dst=root, group=group)
        let_go(local, *(parts or ()))  # gloo's worker drops them a moment later: freed when freed
        if not sender:
            return local[:0]
        assert parts is not None
        full = unshard(name, parts, self.t.placement.parts_of(name))
        del parts
        return full
