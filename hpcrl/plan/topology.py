"""The topology plan: which GPUs train, which generate, and how each side is parallelised.

``Topology`` is a frozen value object that validates itself on construction; trainer and
rollout parallelism are separate types, and every world size is derived, never configured.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from hpcrl.config.cluster import ClusterConfig
from hpcrl.core.parallel import RolloutParallel, TrainParallel
from hpcrl.errors import ConfigError


class Placement(StrEnum):
    COLOCATED = "colocated"  # rollout engines and trainer share every GPU, taking turns
    SPLIT = "split"  # dedicated rollout nodes; weights are broadcast trainer -> engines


@dataclass(frozen=True)
class Topology:
    placement: Placement
    gpus_per_node: int
    train_nodes: int
    rollout_nodes: int
    train: TrainParallel
    rollout: RolloutParallel

    def __post_init__(self) -> None:
        if self.placement is Placement.COLOCATED and self.rollout_nodes:
            raise ConfigError(
                "a colocated topology has no dedicated rollout nodes (layout.rollout_nodes must be 0)"
            )
        if self.placement is Placement.SPLIT and not self.rollout_nodes:
            raise ConfigError("a split topology needs layout.rollout_nodes >= 1")
        check_engine_fits_node(self.rollout.tp, self.gpus_per_node)
        if self.train.world != self.train_nodes * self.gpus_per_node:
            raise ConfigError("internal: training world does not match train_nodes x gpus_per_node")

    @property
    def nodes(self) -> int:
        return self.train_nodes + self.rollout_nodes

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_roles(self) -> list[str]:
        """Role of each node by index (rank 0 first): rollout nodes lead in a split layout."""
        if self.placement is Placement.COLOCATED:
            return ["train+rollout"] * self.train_nodes
        return ["rollout"] * self.rollout_nodes + ["train"] * self.train_nodes


def on_gpus(cluster: ClusterConfig) -> bool:
    """Whether the run's devices are GPUs, as the cluster says: ``cluster.gpu`` names a GPU model, or
    ``cpu`` (the namespace test cluster); ``auto`` (cluster=local) is resolved first to this machine's
    GPU or ``cpu`` (``plan/local_gpu.py``)."""
    from hpcrl.plan.local_gpu import resolve_local_gpu

    resolve_local_gpu(cluster)
    return cluster.gpu.strip().lower() != "cpu"


def check_engine_fits_node(rollout_tp: int, gpus_per_node: int) -> None:
    if rollout_tp > gpus_per_node:
        raise ConfigError(
            f"rollout.tp={rollout_tp} is larger than a node ({gpus_per_node} GPUs); "
            f"use rollout.tp <= {gpus_per_node} and more engines"
        )
    if gpus_per_node % rollout_tp:
        raise ConfigError(
            f"rollout.tp={rollout_tp} must divide the {gpus_per_node} GPUs of a node "
            "so that no engine spans two nodes"
        )


def build_topology(
    *,
    gpus_per_node: int,
    train: TrainParallel,
    rollout_nodes: int,
    rollout_tp: int,
    engines_per_gpu: int = 1,
) -> Topology:
    """The plan's topology: training as ``train`` (the one record of its degrees, over whole nodes of
    ``gpus_per_node``: its world says how many), generation on ``rollout_nodes`` dedicated nodes (0:
    colocated, on the training nodes) in engines of ``rollout_tp`` GPUs."""
    placement = Placement.SPLIT if rollout_nodes else Placement.COLOCATED
    check_engine_fits_node(rollout_tp, gpus_per_node)
    train_nodes = train.world // gpus_per_node  # a world of part nodes is refused by Topology
    rollout_gpus = (rollout_nodes if rollout_nodes else train_nodes) * gpus_per_node
    return Topology(
        placement=placement,
        gpus_per_node=gpus_per_node,
        train_nodes=train_nodes,
        rollout_nodes=rollout_nodes,
        train=train,
        rollout=RolloutParallel(gpus=rollout_gpus, tp=rollout_tp, per_gpu=engines_per_gpu),
    )
