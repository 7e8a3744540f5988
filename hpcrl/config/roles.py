"""Node kinds of the job's roles beyond the training nodes' (``cluster.rollout_node``, ``judge_node``,
``env_node``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hpcrl.config.slurmtime import parse_slurm_time
from hpcrl.core.checks import positive
from hpcrl.errors import ConfigError


@dataclass
class NodeKind:
    """The keys every node kind of its own has: its component's partition, accounting, time and CPUs.
    A key left None is the training nodes' value."""

    KEY: ClassVar[str] = ""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    time: str | None = None
    """The component's wall-clock limit (Slurm syntax); None: ``cluster.slurm.time``."""
    cpus_per_node: int | None = None

    def check(self) -> None:
        if self.cpus_per_node is not None:
            positive(f"{self.KEY}.cpus_per_node", self.cpus_per_node)
        if self.time is not None:
            parse_slurm_time(self.time, f"{self.KEY}.time")


@dataclass
class RolloutNodes(NodeKind):
    """The dedicated rollout nodes' own kind where it differs from the training nodes' (``cluster.rollout_node``,
    a split layout only). Then the job is a Slurm heterogeneous job: one component of rollout nodes, one
    of training nodes, each with its own partition, GPU, time and accounting keys; srun starts one task
    a node over both and Ray spans them. Each node kind has its own GPU count (``gpus_per_node``): the
    plan places that many GPUs of engines on each of its nodes."""

    KEY: ClassVar[str] = "cluster.rollout_node"

    gpu: str | None = None
    """The GPU model of these nodes as plans print it (L40S); None: ``cluster.gpu``. Another model than
    ``cluster.gpu`` needs its memory (``gpu_memory_gb``), which the engines' share is planned on."""
    gpus_per_node: int | None = None
    """GPUs of one of these nodes (the component's ``--gpus-per-node``, the GPUs its Ray node advertises);
    the engines' tensor-parallel size must divide it. None: ``cluster.gpus_per_node``."""
    gpu_memory_gb: float | None = None
    """Usable HBM per rollout GPU: what the engines' ``rollout.gpu_memory_utilization`` is a share of."""

    def check(self) -> None:
        super().check()
        if self.gpus_per_node is not None:
            positive(f"{self.KEY}.gpus_per_node", self.gpus_per_node)
        if self.gpu_memory_gb is not None:
            positive(f"{self.KEY}.gpu_memory_gb", self.gpu_memory_gb)

    def check_gpu(self, cluster_gpu: str) -> None:
        """A GPU model of their own is planned on its own memory, never on the training GPUs'."""
        if self.gpu and self.gpu.lower() != cluster_gpu.lower() and self.gpu_memory_gb is None:
            raise ConfigError(
                f"{self.KEY}.gpu={self.gpu} is another GPU than cluster.gpu={cluster_gpu}: give its memory, "
                f"{self.KEY}.gpu_memory_gb=<GB per GPU>"
            )

    def gpu_label(self, cluster_gpu: str) -> str:
        """The GPU model these nodes hold as the plan shows it: theirs, the training nodes' where they
        share its memory too, else "" (another GPU, known only by its memory)."""
        return self.gpu or (cluster_gpu if self.gpu_memory_gb is None else "")


@dataclass
class JudgeNodes(RolloutNodes):
    """The judge nodes' own kind (``cluster.judge_node``, with ``rewards.judge.nodes`` >= 1): their
    component of the heterogeneous job, the same keys as ``cluster.rollout_node``; the judges' GPUs per
    node and their memory are ``gpus_per_node`` and ``gpu_memory_gb`` here (None: the training nodes')."""

    KEY: ClassVar[str] = "cluster.judge_node"


@dataclass
class EnvNodes(NodeKind):
    """The environment nodes' own kind (``cluster.env_node``, with ``env.nodes`` >= 1): their component of
    the heterogeneous job, without GPUs (the environments' processes need CPUs and memory only)."""

    KEY: ClassVar[str] = "cluster.env_node"

    mem_gb: int | None = None
    """Memory Slurm gives the component on each node (``--mem``, GB); None: the training nodes' setting
    (all of a node's with ``cluster.slurm.exclusive``)."""

    def check(self) -> None:
        super().check()
        if self.mem_gb is not None:
            positive(f"{self.KEY}.mem_gb", self.mem_gb)
