"""Where each actor of a run sits: the Ray scheduling options of every trainer rank and rollout engine.

Fractional GPU requests alone do not say *which* GPU: Ray packs them, so on a node of several GPUs two
colocated trainer ranks (half a GPU each) would share one GPU while an engine sat alone on another, and
the CUDA-IPC refit (each rank hands its buckets to the engines on its own GPU) would cross devices.
Wherever actors share GPUs the run reserves one placement-group bundle per GPU and places each actor in
its bundle: trainer rank ``r`` and engines ``r * k .. r * k + k - 1`` (``k`` = ``rollout.engines_per_gpu``)
on GPU ``r`` when colocated; engine ``g * k + j`` on rollout GPU ``g`` when split. Engines that share a
GPU start one wave at a time (``waves``): vLLM sizes its KV cache from the memory it sees free while it
profiles, which another engine starting on the same GPU would skew.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hpcrl.core.parallel import TrainParallel
from hpcrl.plan.topology import Placement, Topology
from hpcrl.run.actors import ROLLOUT_RESOURCE, TRAIN_RESOURCE

PG_READY_S = 300.0
"""How long the run waits for Ray to reserve the GPUs (every node joined long before on a healthy job)."""


def fraction(whole: float, parts: int) -> float:
    """``whole / parts`` rounded down to Ray's resource precision (1e-4), so ``parts`` of them fit."""
    return math.floor(whole / parts * 10_000) / 10_000


@dataclass(frozen=True)
class Slots:
    trainers: list[dict[str, Any]]
    """``.options(...)`` of each trainer rank."""
    engines: list[dict[str, Any]]
    """``.options(...)`` of each engine (without ``max_concurrency``, the caller's)."""
    waves: list[list[int]] = field(default_factory=list)
    """Engine indices that start together; each wave waits for the one before."""
    bundles: list[dict[str, float]] = field(default_factory=list)
    """The placement group's bundles, one per GPU (empty: none needed)."""


def plan_slots(topo: Topology, train: TrainParallel, *, gpu_resources: bool) -> Slots:
    """The options for ``train.world`` trainer ranks and the topology's engines (one of each when
    ``gpu_resources`` is false: a local run on the CPU asks Ray for no GPU)."""
    ro = topo.rollout
    if not gpu_resources:
        trainer = {"num_cpus": 0, "num_gpus": 0, "resources": {TRAIN_RESOURCE: 1}}
        engine = {"num_cpus": 0, "num_gpus": 0, "resources": {ROLLOUT_RESOURCE: ro.tp}}
        return Slots([trainer] * train.world, [engine], [[0]])
    k = ro.per_gpu
    colocated = topo.placement is Placement.COLOCATED
    if ro.tp > 1 or (not colocated and k == 1):
        # whole GPUs (split), or engines of several GPUs: nothing shares a GPU Ray could mix up
        share = 0.5 if colocated else 1.0
        trainer = {"num_cpus": 0, "num_gpus": share, "resources": {TRAIN_RESOURCE: 1}}
        engine = {"num_cpus": 0, "num_gpus": ro.tp * share, "resources": {ROLLOUT_RESOURCE: ro.tp}}
        return Slots([trainer] * train.world, [engine] * ro.engines, [list(range(ro.engines))])
    if colocated:
        bundle = {"GPU": 1.0, TRAIN_RESOURCE: 1.0, ROLLOUT_RESOURCE: 1.0}
        gpus, engine_gpu = train.world, 0.5
        trainers = [
            {"num_cpus": 0, "num_gpus": 0.5, "resources": {TRAIN_RESOURCE: 1}, "bundle": r}
            for r in range(train.world)
        ]
    else:
        bundle = {"GPU": 1.0, ROLLOUT_RESOURCE: 1.0}
        gpus, engine_gpu = ro.gpus, 1.0
        trainers = [{"num_cpus": 0, "num_gpus": 1.0, "resources": {TRAIN_RESOURCE: 1}}] * train.world
    engines = [
        {
            "num_cpus": 0,
            "num_gpus": fraction(engine_gpu, k),
            "resources": {ROLLOUT_RESOURCE: fraction(1.0, k)},
            "bundle": g,
        }
        for g in range(gpus)
        for _ in range(k)
    ]
    waves = [[g * k + j for g in range(gpus)] for j in range(k)]
    return Slots(trainers, engines, waves, [dict(bundle) for _ in range(gpus)])


def place(slots: Slots) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The trainers' and engines' ``.options(...)``: where the slots have bundles, a placement group
    reserves them (packed onto as few nodes as they fit) and each actor is scheduled into its own."""
    if not slots.bundles:
        return slots.trainers, slots.engines
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group(slots.bundles, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=PG_READY_S)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(
            f"Ray could not reserve {len(slots.bundles)} GPU bundle(s) like {slots.bundles[0]} in "
            f"{PG_READY_S:.0f} s; the cluster has {ray.cluster_resources()}: are all nodes up with their GPUs?"
        ) from None

    def options(slot: dict[str, Any]) -> dict[str, Any]:
        out = {key: value for key, value in slot.items() if key != "bundle"}
        if "bundle" in slot:
            out["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=slot["bundle"]
            )
        return out

    return [options(s) for s in slots.trainers], [options(s) for s in slots.engines]
