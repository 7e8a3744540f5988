"""The Hugging Face model under FSDP2: which buffers stay out of refits, checkpoint names, the
data-parallel group, and ``fully_shard`` per decoder layer (MoE routers in fp32 where asked)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.config.schema import RunConfig
from hpcrl.trainer.config import Precision
from hpcrl.trainer.fsdp.expert_parallel import check_model, expert_mesh, shard_experts, split_experts
from hpcrl.trainer.process_group import own_group


def frozen_buffers(model: torch.nn.Module, names: list[str]) -> set[str]:
    """State-dict names of the buffers ``trainer.freeze`` names (the match ``freeze`` uses)."""
    return {b for b, _ in model.named_buffers() if any(n in b for n in names)}


def checkpoint_names(model: Any, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weights in the names and layout of the model's checkpoint files, which rollout engines load and
    the megatron backend exports: transformers fuses some tensors in memory (an MoE layer's experts
    into one ``experts.gate_up_proj``); this undoes it (dense models pass unchanged)."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, weights))


def data_parallel_group(world: int, cp: int) -> dist.ProcessGroup | None:
    """The ranks holding the same positions of different rows: one of each CP group (every rank
    creates every group, as torch asks); None where one group trains every row."""
    if world // cp == 1:
        return None
    if cp == 1:
        return dist.group.WORLD
    return own_group([range(c, world, cp) for c in range(cp)])


def shard_model(model: Any, cfg: RunConfig, device: str, world: int, ep: int = 1) -> Any:
    """``model`` under FSDP2 over the ``world`` training ranks, each decoder layer its own unit;
    ``ep`` > 1 splits the experts over an expert-parallel mesh dimension (``expert_parallel.py``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    device_type = "cuda" if device.startswith("cuda") else "cpu"
    mesh = init_device_mesh(device_type, (world,))
    experts = ExpertSplit(expert_mesh(device_type, world, ep), world) if ep > 1 else None
    policy = None
    if device.startswith("cuda") and cfg.trainer.precision is Precision.bfloat16:
        # fp32 sharded master weights and gradient reduction, bf16 compute
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # With one rank there is nothing to free by resharding: it would only re-gather (and re-cast to
    # bf16) every layer's weights again for the backward pass.
    reshard = getattr(cfg.trainer, "reshard_after_forward", True) and world > 1
    return apply_fsdp(
        model,
        mesh,
        policy,
        reshard=reshard,
        router_fp32=cfg.trainer.router_dtype == "fp32",
        compile_layers=device.startswith("cuda") and cfg.trainer.compile_layers(),
        experts=experts,
    )


@dataclass(frozen=True)
class ExpertSplit:
    """Expert parallelism's (edp, ep) mesh over the ``world`` training ranks."""

    mesh: Any
    world: int


def apply_fsdp(
    model: Any,
    mesh: Any,
    policy: Any,
    *,
    reshard: bool,
    router_fp32: bool,
    compile_layers: bool,
    experts: ExpertSplit | None = None,
) -> Any:
    """``fully_shard`` per decoder layer (Nemotron-H: per block, whatever its mixer), then the rest.

    ``router_fp32`` (``trainer.router_dtype=fp32``, the MoE quirk) under a bf16 ``policy``: each MoE
    router is a unit of its own whose weight is gathered in fp32. transformers' Nemotron-H router
    casts its weight and input to fp32 itself, but after a bf16 all-gather the weight has already
    lost its low bits, and expert choice (a top-k over near-equal scores) moves with them.

    ``experts``: each layer's experts split over EP, then sharded over expert data parallel as a unit
    of their own (the layer's unit then leaves their weights out)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    shard: dict[str, Any] = {"mesh": mesh} | ({"mp_policy": policy} if policy is not None else {})
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    if experts is not None:
        for unit in check_model(model, experts.mesh["ep"].size()):
            split_experts(unit, experts.mesh)
            shard_experts(unit, experts.mesh, {**shard, "reshard_after_forward": reshard}, experts.world)
    # the text decoder's layers (inside the language model of a vision-language model too)
    decoder = model.get_decoder()
    for tower in towers(model, decoder):
        # a vision-language model's towers: units of their own, gathered for their forward only
        # (in the root unit they would stay gathered through the whole step)
        fully_shard(tower, reshard_after_forward=reshard, **shard)
    # hpcrl's MTP blocks (trainer/mtp.py) too: in the root unit they would stay gathered all step
    mtp = getattr(model, "mtp", None)
    for layer in [*decoder.layers, *(mtp.units() if mtp is not None else [])]:
        if router_fp32 and policy is not None:
            for router in routers(layer):
                fully_shard(router, reshard_after_forward=reshard, mesh=mesh, mp_policy=fp32)
        if compile_layers:
            layer.compile()  # per decoder layer, before sharding (the torchtitan recipe)
        fully_shard(layer, reshard_after_forward=reshard, **shard)
    fully_shard(model, **shard)
    return model


def towers(model: Any, decoder: Any) -> list[torch.nn.Module]:
    """The decoder's siblings that hold weights in a vision-language model (vision and audio towers,
    their projectors: ``Gemma4Model.vision_tower``, ``Idefics3Model.connector``); none in a causal LM,
    whose base model is the decoder."""
    base = getattr(model, "model", None)
    if base is None or base is decoder:
        return []
    return [m for m in base.children() if m is not decoder and any(True for _ in m.parameters())]


def position_dependent_rope(config: Any) -> str:
    """The model's RoPE type when its frequencies depend on the longest position seen ("dynamic",
    "longrope"); "" otherwise. ``rope_parameters`` is one dict or one per layer type (Gemma)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    kinds = [rope.get("rope_type")] + [v.get("rope_type") for v in rope.values() if isinstance(v, dict)]
    return next((k for k in kinds if k in ("dynamic", "longrope")), "")


def routers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE routers inside ``module``: transformers names their classes ``*Router``
    (``NemotronHTopkRouter``, ``Qwen3MoeTopKRouter``, ``Gemma4TextRouter``)."""
    return [m for m in module.modules() if type(m).__name__.lower().endswith("router")]


def has_recurrent_layers(model: Any) -> bool:
    """Mamba-style layers (Nemotron-H's ``linear_attention`` blocks) carry state across positions."""
    return "linear_attention" in (getattr(model.config, "layer_types", None) or [])
