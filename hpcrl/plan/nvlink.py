"""Which nodes each tensor-parallel and expert-parallel group lands on, and whether it stays in one
NVLink domain (a GB200 NVL72 rack: ``cluster.nvlink_domain_nodes``).

Ranks map to nodes as the job places them: rollout nodes first, then the training nodes, each node's
GPUs consecutive ranks. Megatron orders dense ranks tp-cp-dp-pp and expert ranks etp-ep-edp-pp
(its ``RankGenerator`` default), so a TP group is ``tp`` consecutive ranks and an expert group
(EP x expert TP) ``ep x expert_tp`` consecutive ranks, each aligned at a multiple of its size.
Slurm keeps each consecutive block of ``--segment`` nodes of the job in one topology block (rack);
without a segment no two nodes are promised the same rack. A group is safe when all its nodes lie in
one segment; a group larger than one domain can never be.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.plan.topology import Topology


@dataclass(frozen=True)
class Group:
    """One kind of communication group: ``size`` consecutive training ranks, ``keys`` as typed."""

    kind: str
    size: int
    keys: str


@dataclass(frozen=True)
class NvlinkCheck:
    problems: tuple[str, ...] = ()
    """Groups that cannot stay inside one NVLink domain as placed: the plan is refused."""
    warnings: tuple[str, ...] = ()
    """Groups that stay inside a domain only if Slurm happens to place them so."""


def groups(tp: int, ep: int, expert_tp: int) -> list[Group]:
    found = [Group("tensor-parallel", tp, f"trainer.tp={tp}")]
    if ep * expert_tp > 1:
        found.append(
            Group(
                "expert-parallel",
                ep * expert_tp,
                f"trainer.ep={ep} x trainer.expert_tp={expert_tp} = {ep * expert_tp} GPUs",
            )
        )
    return found


def group_nodes(topo: Topology, size: int, index: int) -> tuple[int, int]:
    """First and last job node (0-based) of training group ``index`` of ``size`` ranks."""
    gpn, first_rank = topo.gpus_per_node, index * size
    return (
        topo.rollout_nodes + first_rank // gpn,
        topo.rollout_nodes + (first_rank + size - 1) // gpn,
    )


def check_nvlink(topo: Topology, domain_nodes: int, segment: int | None) -> NvlinkCheck:
    """Refuse TP / expert groups that cross a domain or a segment; warn where only luck keeps them in one.

    Clusters whose domain is one node (HGX: NVLink inside the node only) are told about TP groups
    that leave a node; expert groups crossing nodes there are the normal case (all-to-all over IB)."""
    tr = topo.train
    problems: list[str] = []
    warnings: list[str] = []
    for group in groups(tr.tp, tr.ep, tr.expert_tp):
        span = -(-group.size // topo.gpus_per_node)  # nodes one group covers
        if span <= 1:
            continue
        what = f"each {group.kind} group ({group.keys}) spans {span} nodes"
        if domain_nodes <= 1:
            if group.kind == "tensor-parallel":
                warnings.append(
                    f"{what}: its all-reduces leave the node's NVLink; use trainer.tp <= {topo.gpus_per_node}"
                )
            continue
        if span > domain_nodes:
            problems.append(
                f"{what}, more than one NVLink domain ({domain_nodes} nodes, cluster.nvlink_domain_nodes); "
                f"make it at most {domain_nodes * topo.gpus_per_node} GPUs"
            )
        elif segment is None:
            warnings.append(
                f"{what} but cluster.slurm.segment is unset, so Slurm may split one across racks; "
                f"set cluster.slurm.segment to a divisor of the job's {topo.nodes} nodes of at most "
                f"{domain_nodes}, a multiple of {span}"
            )
        elif crossing := first_crossing(topo, group.size, segment):
            index, first, last = crossing
            problems.append(
                f"{what}: group {index} lies on nodes {first}-{last}, across two "
                f"cluster.slurm.segment={segment} blocks (two racks); use a segment that is a multiple "
                f"of {span} nodes and lines up with the {topo.rollout_nodes} rollout node(s) in front"
            )
    return NvlinkCheck(tuple(problems), tuple(warnings))


def first_crossing(topo: Topology, size: int, segment: int) -> tuple[int, int, int] | None:
    """(index, first node, last node) of the first training group that crosses a segment, if any.

    Groups repeat with a period of lcm(size, segment x gpus) ranks, but their count is at most a few
    thousand even on a 1,152-node job, so they are simply walked."""
    for index in range(topo.train.world // size):
        first, last = group_nodes(topo, size, index)
        if first // segment != last // segment:
            return index, first, last
    return None


def segment_for(topo: Topology, domain_nodes: int) -> int | None:
    """The largest segment (<= one domain, dividing the job's nodes) that keeps every group in one
    block; None where there is none. The whole job when it fits in one domain."""
    for segment in range(min(domain_nodes, topo.nodes), 0, -1):
        if topo.nodes % segment == 0 and not check_nvlink(topo, domain_nodes, segment).problems:
            return segment
    return None
