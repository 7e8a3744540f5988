"""Heterogeneous Slurm jobs: rollout nodes (``cluster.rollout_node``), judge nodes (``cluster.judge_node``)
or environment nodes (``cluster.env_node``) of another kind, each role's nodes a component of their own
(``plan/components.py`` says which).

submitit writes one block of ``#SBATCH`` options for the whole job; when some nodes differ from the
training nodes (partition, GPUs per node, time ...), ``het_sbatch`` splits that block into components separated by
``#SBATCH hetjob``: the job-wide options (name, output, signal, requeue) stay first, then each
component's per-node options in node order: rollout nodes (a split layout), training nodes, judge nodes,
environment nodes; each with its own ``--gpus-per-node`` (none on environment nodes: they hold none).
srun starts one task a node over all of them (``--het-group``), so node 0 (the Ray head and the driver)
is the node it is in a homogeneous job, and each task finds its role by ``SLURM_NODEID`` as before.
Tried on the namespace test cluster: in such a step every task sees the leader's ``SLURM_JOB_ID`` (so
submitit finds its pickles), a global ``SLURM_PROCID`` and ``SLURM_NODEID`` in component order.
"""

from __future__ import annotations

from hpcrl.config.roles import EnvNodes, NodeKind
from hpcrl.config.slurmtime import parse_slurm_time
from hpcrl.plan.components import Component, components

__all__ = ["components", "het_sbatch", "srun_het_groups"]

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


def srun_het_groups(parts: list[Component] | None) -> list[str]:
    """srun's flag that starts the step on every component (none for a homogeneous job)."""
    return [] if parts is None else [f"--het-group={','.join(str(i) for i in range(len(parts)))}"]


def het_sbatch(text: str, parts: list[Component]) -> str:
    """submitit's script ``text`` with its per-node options split into the components."""
    lines = text.splitlines()
    options = [i for i, line in enumerate(lines) if line.startswith("#SBATCH --")]
    own = {_name(lines[i]): lines[i] for i in options if _name(lines[i]) in PER_COMPONENT}
    job = [lines[i] for i in options if _name(lines[i]) not in PER_COMPONENT]
    block = list(job)
    for i, part in enumerate(parts):
        keys = dict(own, nodes=f"#SBATCH --nodes={part.nodes}")
        keys.update(_overrides(part.kind) if part.kind is not None else {})
        if part.gpus:  # the component's own nodes' GPUs (a rollout node of 4 beside training nodes of 8)
            keys["gpus-per-node"] = f"#SBATCH --gpus-per-node={part.gpus}"
        else:
            keys.pop("gpus-per-node", None)
        head = " (node 0 is the Ray head)" if i == 0 else ""
        block += ["#SBATCH hetjob"] if i else []
        block += [f"# component {i}: the {part.what}{head}", *(keys[k] for k in sorted(keys))]
    first, last = options[0], options[-1]
    return "\n".join([*lines[:first], *block, *lines[last + 1 :]]) + ("\n" if text.endswith("\n") else "")


def _name(line: str) -> str:
    return line[len("#SBATCH --") :].split("=", 1)[0]


def _overrides(node: NodeKind) -> dict[str, str]:
    values = {
        "partition": node.partition,
        "account": node.account,
        "qos": node.qos,
        "constraint": node.constraint,
        "cpus-per-task": node.cpus_per_node,
        "time": None if node.time is None else parse_slurm_time(node.time, f"{node.KEY}.time"),
        "mem": f"{node.mem_gb}G" if isinstance(node, EnvNodes) and node.mem_gb is not None else None,
    }
    return {k: f"#SBATCH --{k}={v}" for k, v in values.items() if v is not None}
