"""A Hugging Face checkpoint loaded straight into FSDP2-sharded models: each rank reads only the rows
of the parameters it holds (``HFCheckpoint.read(name, rows)``), never the whole model.

The model is built on the meta device (``meta_model``), sharded with ``fully_shard`` while still
empty, then ``load_sharded`` gives it storage and fills every parameter's local shard:

* a checkpoint tensor the model keeps as it is (a rename at most) is read for the local rows only;
* a tensor transformers converts on load (an MoE layer's per-expert projections fused into
  ``experts.gate_up_proj``) is built by transformers' own ``WeightConverter`` from that one layer's
  checkpoint tensors, narrowed to the local rows, copied, and freed before the next one.

Names go checkpoint -> memory through transformers' ``get_model_conversion_mapping`` and
``rename_source_key``, as ``from_pretrained`` does (``revert_weight_conversion`` is the opposite
way, which ``fsdp.checkpoint_names`` uses). Buffers the checkpoint lacks (rotary ``inv_freq``,
Gemma's ``embed_scale``) are then computed by the model's own ``initialize_weights``, which — as in
``from_pretrained`` — skips every tensor flagged as loaded.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hpcrl.trainer.hf_checkpoint import HFCheckpoint


def meta_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> Any:
    """The causal LM of ``model_dir``'s config, every parameter and buffer on the meta device (no
    storage); tied embeddings are tied already.

    Its ``_weight_conversions`` hold transformers' whole checkpoint mapping until ``load_sharded``
    keeps the transforms that matched (as ``from_pretrained`` does): taken now, since the lookup goes
    by class name and ``fully_shard`` renames the class (``FSDPQwen3MoeForCausalLM``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(model_dir)
    # vision-language models without a causal-LM entry (Idefics3, Qwen2-VL) have an image-text one
    # (Gemma 3 and 4 have both, the same class)
    auto = (
        AutoModelForCausalLM
        if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        else AutoModelForImageTextToText
    )
    with torch.device("meta"):
        model = auto.from_config(config, dtype=dtype)
    model._weight_conversions = get_model_conversion_mapping(model)
    return model


@dataclass
class Target:
    """One in-memory tensor group and how it comes out of the checkpoint: ``sources`` (checkpoint
    name, the converter's source pattern) and, for a converted tensor, a fresh ``converter``."""

    name: str
    sources: list[tuple[str, str]] = field(default_factory=list)
    converter: Any = None


def plan_targets(model: Any, names: list[str]) -> tuple[list[Target], list[Any], list[str]]:
    """(targets in checkpoint order — one layer after the other —, the transforms that matched, the
    checkpoint names the model has no place for), the way ``convert_and_load_state_dict_in_model``
    renames and groups them; ``model`` comes from ``meta_model``."""
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    mapping = model._weight_conversions
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    known = dict.fromkeys(model.state_dict(), True)  # names only: the model is on the meta device
    prefix = model.base_model_prefix
    targets: dict[str, Target] = {}
    unused = []
    for key in sorted(names, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, prefix, known)
        if name not in known and key in known:  # not to be renamed after all (the prefix at most)
            name, pattern = rename_source_key(key, [], [], prefix, known)
        if name not in known:
            unused.append(key)
            continue
        target = targets.setdefault(name, Target(name))
        if pattern is not None and target.converter is None:
            target.converter = copy.deepcopy(by_pattern[pattern])
        target.sources.append((key, pattern or key))
    return list(targets.values()), [m for m in mapping if m.was_used()], unused


def local_rows(tensor: torch.Tensor) -> slice | None:
    """The rows of ``tensor`` this rank holds: an FSDP2 parameter is a DTensor sharded on dim 0
    (``torch.chunk`` over the mesh; expert parallel's experts: over EP, then each EP rank's block
    over expert data parallel, contiguous rows still); None for a plain tensor (held whole)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(tensor, DTensor) or tensor.ndim == 0:
        return None
    if any(not isinstance(p, Shard | _StridedShard) or p.dim != 0 for p in tensor.placements):
        raise ValueError(f"hf_load: a parameter sharded as {tensor.placements}; FSDP2 shards dim 0")
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return slice(offset[0], offset[0] + shape[0])


def local_view(tensor: torch.Tensor) -> torch.Tensor:
    """The storage this rank writes: a DTensor's local shard, a plain tensor itself."""
    return getattr(tensor, "_local_tensor", tensor)


def _copy(models: list[Any], name: str, read: Callable[[slice | None], torch.Tensor]) -> None:
    """``read(rows)`` into ``name`` of each model that has it (same shapes and sharding: read once;
    the first has every name: a reference policy leaves out the MTP layers, ``trainer/mtp.py``)."""
    dst = [local_view(m.get_parameter_or_buffer(name)) for m in models if _has(m, name)]
    rows = local_rows(models[0].get_parameter_or_buffer(name))
    if rows is not None and rows.stop <= rows.start:
        return  # more ranks than rows: this one holds none
    value = read(rows)
    for d in dst:
        d.copy_(value.reshape(d.shape))


def _has(model: Any, name: str) -> bool:
    try:
        model.get_parameter_or_buffer(name)
    except AttributeError:
        return False
    return True


def _converted(model: Any, ckpt: HFCheckpoint, target: Target) -> dict[str, torch.Tensor]:
    """The target's tensors built from its (whole) checkpoint tensors by transformers' converter."""
    conv = target.converter
    for key, pattern in target.sources:
        conv.add_tensor(target.name, key, pattern, partial(ckpt.get, key))  # read when converted
    out = conv.convert(target.name, model=model, config=model.config)
    return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}


def fill(models: list[Any], ckpt: HFCheckpoint, targets: list[Target]) -> set[str]:
    """Each target's local rows into every model, one target at a time; the names filled."""
    done: set[str] = set()
    for target in targets:
        if target.converter is None:
            ((key, _),) = target.sources
            _copy(models, target.name, partial(ckpt.read, key))
            done.add(target.name)
        else:
            done |= _fill_converted(models, ckpt, target)
    return done


def _narrow(full: torch.Tensor, rows: slice | None) -> torch.Tensor:
    return full if rows is None else full[rows]


def _fill_converted(models: list[Any], ckpt: HFCheckpoint, target: Target) -> set[str]:
    """A converted target: its full tensors live only in this call (one layer's worth)."""
    converted = _converted(models[0], ckpt, target)
    for name, full in converted.items():
        _copy(models, name, partial(_narrow, full))
    return set(converted)


def _state_tensors(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


def load_sharded(models: list[Any], model_dir: Path, device: torch.device | str) -> None:
    """Storage on ``device`` for ``models`` (built by ``meta_model`` from ``model_dir``, then
    ``fully_shard``-ed alike), each rank's shard of every checkpoint tensor read into all of them in
    one pass, then what the checkpoint lacks computed as ``from_pretrained`` would.

    A parameter the checkpoint has no tensor for is an error (``from_pretrained`` would initialise it
    at random and only warn); tied parameters are one tensor and filled once."""
    with torch.no_grad():
        for model in models:
            model.to_empty(device=device)
        with HFCheckpoint(model_dir) as ckpt:
            targets, used, _ = plan_targets(models[0], ckpt.names())
            done = fill(models, ckpt, targets)
        for model in models:
            _finish(model, done, used)


def _finish(model: Any, done: set[str], used: list[Any]) -> None:
    missing = [n for n, p in model.named_parameters() if n not in done]
    if missing:
        raise KeyError(f"hf_load: no checkpoint tensor for parameters {missing[:8]}")
    for name, tensor in _state_tensors(model):
        if name in done:
            setattr(tensor, "_is_hf_initialized", True)  # noqa: B010 (initialize_weights skips it)
    model.initialize_weights()  # the buffers the checkpoint lacks (non-persistent ones: all of them)
    model._weight_conversions = used  # what revert_weight_conversion undoes, as after from_pretrained
    model.eval()  # as from_pretrained returns it
