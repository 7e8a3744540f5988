"""Heterogeneous Slurm jobs: rollout nodes of another kind (``cluster.rollout_node``) as a component of their own.

submitit writes one block of ``#SBATCH`` options for the whole job; when the rollout nodes differ from the
training nodes (partition, GPU, time ...), ``het_sbatch`` splits that block into components separated by
``#SBATCH hetjob``: the job-wide options (name, output, signal, requeue) stay first, then the rollout
component's per-node options, then the training component's. srun starts one task a node over both
components (``--het-group``), rollout nodes first, so node 0 (the Ray head and the driver) is a rollout
node exactly as in a homogeneous split job, and each task finds its role by ``SLURM_NODEID`` as before.
Tried on the namespace test cluster: in such a step every task sees the leader's ``SLURM_JOB_ID`` (so
submitit finds its pickles), a global ``SLURM_PROCID`` and ``SLURM_NODEID`` in component order.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.config.roles import RolloutNodes
from hpcrl.config.slurmtime import parse_slurm_time
from hpcrl.plan.planner import Plan
from hpcrl.plan.topology import Placement

PER_COMPONENT = (
    "account",
    "constraint",
    "cpus-per-task",
    "exclusive",
    "gpus-per-node",
    "mem",
    "nodes",
    "ntasks-per-node",
    "partition",
    "qos",
    "time",
)
"""The sbatch options each component carries for itself; the others (job name, output files, signal,
requeue) are the job's and go before the first component."""


@dataclass(frozen=True)
class Components:
    """The job's components in srun's order: the rollout nodes' options, then the training nodes'."""

    rollout_nodes: int
    train_nodes: int
    rollout: RolloutNodes


def components(plan: Plan) -> Components | None:
    """The components of a heterogeneous job, or None when every node is of one kind."""
    node, topo = plan.cfg.cluster.rollout_node, plan.topology
    if node is None or topo.placement is not Placement.SPLIT:
        return None
    return Components(topo.rollout_nodes, topo.train_nodes, node)


def srun_het_groups(parts: Components | None) -> list[str]:
    """srun's flag that starts the step on every component (none for a homogeneous job)."""
    return [] if parts is None else ["--het-group=0,1"]


def het_sbatch(text: str, parts: Components) -> str:
    """submitit's script ``text`` with its per-node options split into the two components."""
    lines = text.splitlines()
    options = [i for i, line in enumerate(lines) if line.startswith("#SBATCH --")]
    own = {_name(lines[i]): lines[i] for i in options if _name(lines[i]) in PER_COMPONENT}
    train = dict(own, nodes=f"#SBATCH --nodes={parts.train_nodes}")
    rollout = dict(own, nodes=f"#SBATCH --nodes={parts.rollout_nodes}")
    rollout.update(_rollout_overrides(parts.rollout))
    job = [lines[i] for i in options if _name(lines[i]) not in PER_COMPONENT]
    block = [
        *job,
        "# component 0: the rollout nodes (node 0 is the Ray head)",
        *(rollout[k] for k in sorted(rollout)),
        "#SBATCH hetjob",
        "# component 1: the training nodes",
        *(train[k] for k in sorted(train)),
    ]
    first, last = options[0], options[-1]
    return "\n".join([*lines[:first], *block, *lines[last + 1 :]]) + ("\n" if text.endswith("\n") else "")


def _name(line: str) -> str:
    return line[len("#SBATCH --") :].split("=", 1)[0]


def _rollout_overrides(node: RolloutNodes) -> dict[str, str]:
    values = {
        "partition": node.partition,
        "account": node.account,
        "qos": node.qos,
        "constraint": node.constraint,
        "cpus-per-task": node.cpus_per_node,
        "time": None if node.time is None else parse_slurm_time(node.time, "cluster.rollout_node.time"),
    }
    return {k: f"#SBATCH --{k}={v}" for k, v in values.items() if v is not None}
