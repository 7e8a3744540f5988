"""The components of a heterogeneous Slurm job, in srun's order: the roles whose nodes are of another
kind (``cluster.rollout_node``, ``cluster.judge_node``, ``cluster.env_node``) make the job one, each
role's nodes a component (launch/hetjob.py writes them into the script; ``hpcrl plan`` prints them).
Each component asks for its own nodes' GPUs (``gpus_per_node`` of its kind, else the training nodes')."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpcrl.config.roles import NodeKind
from hpcrl.plan.judge import judge_memory_gb, judge_node_gpus
from hpcrl.plan.topology import Placement

if TYPE_CHECKING:
    from hpcrl.plan.planner import Plan


@dataclass(frozen=True)
class Component:
    what: str
    """The nodes it holds, as the script's comment and ``hpcrl plan`` say it."""
    nodes: int
    kind: NodeKind | None
    """Its own keys (partition, time ...); None: the training nodes'."""
    gpus: int
    """GPUs each of its nodes asks for (``--gpus-per-node``; 0: none, environment nodes of their own kind)."""

    def line(self) -> str:
        own = {k: v for k, v in vars(self.kind).items() if v is not None} if self.kind else {}
        own.pop("gpus_per_node", None)  # said below, whoever set it
        keys = ", ".join(f"{k} {v}" for k, v in own.items()) or "the training nodes' keys"
        return f"{self.what} ({self.nodes}), {keys}, {f'{self.gpus} GPUs each' if self.gpus else 'no GPUs'}"


def node_gpus(plan: Plan) -> list[int]:
    """The GPUs Slurm gives each node of the job, by node index (``Plan.node_roles``' order): the rollout
    nodes' and judge nodes' own count where their kind has one, none on environment nodes of their own."""
    cluster, judges = plan.cfg.cluster, plan.judge.nodes if plan.judge is not None else 0
    env = 0 if cluster.env_node is not None else cluster.gpus_per_node
    return plan.topology.node_gpus() + [judge_node_gpus(plan.cfg)] * judges + [env] * plan.cfg.env.nodes


def components(plan: Plan) -> list[Component] | None:
    """The job's components in node order (node 0, the Ray head, in the first), or None when every
    node is of one kind: rollout nodes (a split layout), training nodes, judge nodes (``rewards.judge.nodes``),
    environment nodes (``env.nodes``)."""
    cluster, topo = plan.cfg.cluster, plan.topology
    split = topo.placement is Placement.SPLIT
    judges = plan.judge.nodes if plan.judge is not None else 0
    envs = plan.cfg.env.nodes
    own = ((cluster.rollout_node, split), (cluster.judge_node, judges), (cluster.env_node, envs))
    if not any(kind is not None and count for kind, count in own):
        return None
    gpn = topo.gpus_per_node
    parts = []
    if split:
        parts.append(
            Component("rollout nodes", topo.rollout_nodes, cluster.rollout_node, topo.rollout_gpus_per_node)
        )
    parts.append(
        Component("training nodes" if split else "training and rollout nodes", topo.train_nodes, None, gpn)
    )
    if judges:
        parts.append(Component("judge nodes", judges, cluster.judge_node, judge_node_gpus(plan.cfg)))
    if envs:  # of their own kind: no GPUs; else the training nodes' kind, GPUs and all
        parts.append(Component("environment nodes", envs, cluster.env_node, 0 if cluster.env_node else gpn))
    return parts


@dataclass(frozen=True)
class RoleGpu:
    """The GPUs one role's nodes hold, as ``hpcrl plan``'s memory table names them."""

    role: str
    gpu: str
    """The GPU model ("": another than the training nodes', known by its memory only)."""
    memory_gb: float
    """What its per-GPU figures are of (the engines' share, the training peak)."""

    def label(self) -> str:
        return f"{self.role} {self.gpu + ' ' if self.gpu else ''}of {self.memory_gb:.0f}"


def gpu_roles(plan: Plan) -> list[RoleGpu]:
    """Each GPU role's GPU model and memory: the training nodes' (the engines' too when colocated), the
    dedicated rollout nodes' (``cluster.rollout_node``), the judge nodes' (``cluster.judge_node``)."""
    cluster = plan.cfg.cluster
    split = plan.topology.placement is Placement.SPLIT
    kinds = [RoleGpu("train" if split else "train+rollout", cluster.gpu, cluster.gpu_memory_gb)]
    if split:
        node = cluster.rollout_node
        gpu = node.gpu_label(cluster.gpu) if node is not None else cluster.gpu
        kinds.append(RoleGpu("rollout", gpu, cluster.rollout_memory_gb(split)))
    if plan.judge is not None and plan.judge.gpus:
        judge = cluster.judge_node
        gpu = judge.gpu_label(cluster.gpu) if judge is not None else cluster.gpu
        kinds.append(RoleGpu("judge", gpu, judge_memory_gb(plan.cfg)))
    return kinds


def one_gpu_kind(plan: Plan) -> bool:
    """Whether every GPU role's nodes hold the same GPU (model and memory): ``hpcrl plan`` then speaks of
    "the GPU", else of each role's."""
    return len({(k.gpu, k.memory_gb) for k in gpu_roles(plan)}) == 1
