"""Which part of the whole model this rank holds, and moving weights between the two: its pipeline
stage's layers (a layer offset), its expert-parallel rank's experts (an expert offset) and its
tensor-parallel slices (the dense TP group, or expert TP for an expert's weights).

``Placement.load`` fills a rank's model from full Megatron-named weights (the model directory's
checkpoint streams in through load.py instead, already cut, into ``fill``); ``gather_tp`` gathers a
stage's parameters (or gradients) back over TP under global names, and ``gather_to_rank0`` collects
every rank's part on global rank 0.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.core.parallel import TrainParallel
from hpcrl.trainer.megatron.weights import expert_name, is_expert, is_split, relocate, shard, unshard


@dataclass(frozen=True)
class Placement:
    par: TrainParallel
    layer_offset: int
    """Global index of this pipeline stage's first layer."""
    expert_offset: int
    """Global index of this expert-parallel rank's first expert."""
    buffers: tuple[str, ...]
    """The family's checkpoint buffers (Gemma 4's ``layer_scalar``), loaded beside the parameters."""
    parts: dict[str, tuple[int, ...]]
    """Name suffix -> the parts its TP split cuts one by one (weights.shard; Nemotron-H's in_proj)."""

    @classmethod
    def of_this_rank(
        cls,
        par: TrainParallel,
        layers: int,
        experts: int,
        buffers: tuple[str, ...],
        parts: dict[str, tuple[int, ...]] | None = None,
    ) -> Placement:
        from megatron.core import parallel_state as ps

        layer_offset = layers // par.pp * ps.get_pipeline_model_parallel_rank()
        expert_offset = experts // par.ep * ps.get_expert_model_parallel_rank() if experts else 0
        return cls(par, layer_offset, expert_offset, buffers, parts or {})

    def parts_of(self, name: str) -> tuple[int, ...] | None:
        name = expert_name(name)  # a TE grouped expert's weight cuts as SequentialMLP's
        return next((p for suffix, p in self.parts.items() if name.endswith(suffix)), None)

    def global_name(self, name: str) -> str:
        return relocate(name, self.layer_offset, self.expert_offset)

    def tp_of(self, name: str) -> tuple[int, int, Any]:
        """(size, this rank's index, group) of the tensor-parallel group ``name`` is split over: expert
        TP for an expert's weights, the dense TP group for the rest."""
        from megatron.core import parallel_state as ps

        if is_expert(name):
            return (
                self.par.expert_tp,
                ps.get_expert_tensor_parallel_rank(),
                ps.get_expert_tensor_parallel_group(check_initialized=False),
            )
        return self.par.tp, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()

    def loaded(self, model: Any) -> list[tuple[str, torch.Tensor]]:
        """What the checkpoint fills: the parameters and the family's checkpoint buffers."""
        buffers = [(n, b) for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in self.buffers]
        return [*model.named_parameters(), *buffers]

    def targets(self, model: Any) -> dict[str, torch.Tensor]:
        """What the checkpoint fills, by global Megatron name."""
        return {self.global_name(name): t for name, t in self.loaded(model)}

    def load(self, model: Any, full: dict[str, torch.Tensor]) -> None:
        """Every parameter from ``full``; the checkpoint buffers too where ``full`` has them (a training
        checkpoint holds the trained weights only: the buffers stay as the model directory had them)."""
        targets, filled = self.targets(model), set()
        for key in targets.keys() & full.keys():  # one at a time: a cut may be a copy (fc1's halves)
            tp, rank, _ = self.tp_of(key)
            filled |= fill(targets, {key: shard(key, full[key], tp, rank, self.parts_of(key))})
        self.check_filled(model, filled)

    def check_filled(self, model: Any, filled: set[str]) -> None:
        """Raise for a parameter that got no weight (a buffer keeps its value)."""
        for key, param in self.targets(model).items():
            if key not in filled and isinstance(param, torch.nn.Parameter):
                raise KeyError(f"checkpoint has no weight for Megatron parameter {key}")

    def check_every_weight_used(
        self, model: Any, names: Collection[str], tied: bool, model_type: str
    ) -> None:
        """Every checkpoint weight (``names``: the whole checkpoint's, in Megatron names) must land in
        some rank's model: one left over means the layer spec lacks a part of the architecture (a Q/K
        norm, say) and the model would silently differ."""
        used = set(self.targets(model))
        every: list[Any] = [used]
        if dist.get_world_size() > 1:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, used)
        left = set(names) - set().union(*every) - ({"output_layer.weight"} if tied else set())
        if left:
            raise ValueError(
                f"trainer=megatron built a {model_type} model with no place for {len(left)} "
                f"checkpoint weights, e.g. {sorted(left)[:3]}: its layer spec does not match "
                "the architecture; use trainer=fsdp for this model"
            )

    def gather_tp(self, model: Any, grads: bool = False) -> dict[str, torch.Tensor]:
        """This stage's parameters (or their gradients), gathered over tensor parallel (expert TP for
        experts), under global Megatron names, on the CPU."""
        out = {}
        for name, param in model.named_parameters():
            if grads and param.grad is None:
                continue
            data = param.grad.detach() if grads else param.detach()
            tp, _, group = self.tp_of(name)
            if tp > 1 and is_split(name):
                parts = [torch.empty_like(data) for _ in range(tp)]
                dist.all_gather(parts, data.contiguous(), group=group)
            else:
                parts = [data]
            out[self.global_name(name)] = unshard(name, parts, self.parts_of(name)).cpu()
        return out


def fill(targets: dict[str, torch.Tensor], shards: dict[str, torch.Tensor]) -> set[str]:
    """Copy this rank's slices (global Megatron name -> the slice, cut already) into ``targets``
    (``Placement.targets``); the names filled."""
    filled = set()
    with torch.no_grad():
        for key, t in shards.items():
            if key in targets:
                targets[key].copy_(t.to(targets[key].dtype))
                filled.add(key)
    return filled


def gather_to_rank0(local: Any) -> list[Any]:
    """Every rank's ``local`` on global rank 0 (in rank order); an empty list elsewhere."""
    if dist.get_world_size() == 1:
        return [local]
    objs: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, objs, dst=0)
    return objs or []
