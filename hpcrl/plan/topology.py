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
    rollout_node_gpus: int | None = None
    """GPUs of one dedicated rollout node where its kind has its own (``cluster.rollout_node.gpus_per_node``,
    a split layout only); None: ``gpus_per_node``, the training nodes'."""

    def __post_init__(self) -> None:
        if self.placement is Placement.COLOCATED and self.rollout_nodes:
            raise ConfigError(
                "a colocated topology has no dedicated rollout nodes (layout.rollout_nodes must be 0)"
            )
        if self.placement is Placement.SPLIT and not self.rollout_nodes:
            raise ConfigError("a split topology needs layout.rollout_nodes >= 1")
        if self.placement is Placement.COLOCATED and self.rollout_node_gpus is not None:
            raise ConfigError(ROLLOUT_GPUS_COLOCATED)
        check_engine_fits_node(
            self.rollout.tp, self.rollout_gpus_per_node, self.rollout_node_gpus is not None
        )
        if self.train.world != self.train_nodes * self.gpus_per_node:
            raise ConfigError("internal: training world does not match train_nodes x gpus_per_node")

    @property
    def nodes(self) -> int:
        return self.train_nodes + self.rollout_nodes

    @property
    def rollout_gpus_per_node(self) -> int:
        """GPUs of a node that generates: a dedicated rollout node's own count, else a training node's."""
        return self.gpus_per_node if self.rollout_node_gpus is None else self.rollout_node_gpus

    @property
    def total_gpus(self) -> int:
        return self.train_nodes * self.gpus_per_node + self.rollout_nodes * self.rollout_gpus_per_node

    def node_gpus(self) -> list[int]:
        """GPUs of each node by index, as ``node_roles`` orders them."""
        return [self.rollout_gpus_per_node] * self.rollout_nodes + [self.gpus_per_node] * self.train_nodes

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


ROLLOUT_GPUS_COLOCATED = (
    "cluster.rollout_node.gpus_per_node describes dedicated rollout nodes, but this layout is colocated "
    "(the engines share the training nodes' GPUs); set layout.rollout_nodes>=1 (split) or remove it"
)


def check_rollout_nodes(cluster: ClusterConfig, *, split: bool) -> None:
    """``cluster.rollout_node`` (a heterogeneous job) describes dedicated rollout nodes: a split layout."""
    node = cluster.rollout_node
    if node is None or split:
        return
    if node.gpus_per_node is not None:
        raise ConfigError(ROLLOUT_GPUS_COLOCATED)
    raise ConfigError(
        "cluster.rollout_node describes dedicated rollout nodes, but this layout is colocated; "
        "set layout.rollout_nodes>=1 (split) or remove cluster.rollout_node"
    )


def check_engine_fits_node(rollout_tp: int, gpus_per_node: int, own: bool = False) -> None:
    """An engine stays within one node of ``gpus_per_node`` GPUs; ``own``: a rollout node's own count
    (``cluster.rollout_node.gpus_per_node``), which the refusal names."""
    node = "a rollout node" if own else "a node"
    key = ", cluster.rollout_node.gpus_per_node" if own else ""
    if rollout_tp > gpus_per_node:
        raise ConfigError(
            f"rollout.tp={rollout_tp} is larger than {node} ({gpus_per_node} GPUs{key}); "
            f"use rollout.tp <= {gpus_per_node} and more engines"
        )
    if gpus_per_node % rollout_tp:
        raise ConfigError(
            f"rollout.tp={rollout_tp} must divide the {gpus_per_node} GPUs of {node}{key} "
            "so that no engine spans two nodes"
        )


def build_topology(
    *,
    gpus_per_node: int,
    train: TrainParallel,
    rollout_nodes: int,
    rollout_tp: int,
    engines_per_gpu: int = 1,
    rollout_node_gpus: int | None = None,
) -> Topology:
    """The plan's topology: training as ``train`` (the one record of its degrees, over whole nodes of
    ``gpus_per_node``: its world says how many), generation on ``rollout_nodes`` dedicated nodes (0:
    colocated, on the training nodes) of ``rollout_node_gpus`` GPUs each (None: ``gpus_per_node``) in
    engines of ``rollout_tp`` GPUs."""
    placement = Placement.SPLIT if rollout_nodes else Placement.COLOCATED
    if rollout_node_gpus is not None and not rollout_nodes:
        raise ConfigError(ROLLOUT_GPUS_COLOCATED)
    generating = gpus_per_node if rollout_node_gpus is None else rollout_node_gpus
    check_engine_fits_node(rollout_tp, generating, rollout_node_gpus is not None)
    train_nodes = train.world // gpus_per_node  # a world of part nodes is refused by Topology
    rollout_gpus = rollout_nodes * generating if rollout_nodes else train_nodes * gpus_per_node
    return Topology(
        placement=placement,
        gpus_per_node=gpus_per_node,
        train_nodes=train_nodes,
        rollout_nodes=rollout_nodes,
        train=train,
        rollout=RolloutParallel(gpus=rollout_gpus, tp=rollout_tp, per_gpu=engines_per_gpu),
        rollout_node_gpus=rollout_node_gpus,
    )
