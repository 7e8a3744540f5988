"""The components of a heterogeneous Slurm job, in srun's order: the roles whose nodes are of another
kind (``cluster.rollout_node``, ``cluster.judge_node``, ``cluster.env_node``) make the job one, each
role's nodes a component (launch/hetjob.py writes them into the script; ``hpcrl plan`` prints them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpcrl.config.roles import NodeKind
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
    gpus: bool = True
    """Its nodes ask for the training nodes' GPUs (False: none, environment nodes of their own kind)."""

    def line(self) -> str:
        own = {k: v for k, v in vars(self.kind).items() if v is not None} if self.kind else {}
        keys = ", ".join(f"{k} {v}" for k, v in own.items()) or "the training nodes' keys"
        return f"{self.what} ({self.nodes}), {keys}{'' if self.gpus else ', no GPUs'}"


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
    parts = [Component("rollout nodes", topo.rollout_nodes, cluster.rollout_node)] if split else []
    parts.append(
        Component("training nodes" if split else "training and rollout nodes", topo.train_nodes, None)
    )
    if judges:
        parts.append(Component("judge nodes", judges, cluster.judge_node))
    if envs:  # of their own kind: no GPUs; else the training nodes' kind, GPUs and all
        parts.append(Component("environment nodes", envs, cluster.env_node, gpus=cluster.env_node is None))
    return parts
