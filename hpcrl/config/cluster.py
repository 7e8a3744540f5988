"""Cluster schema: the hardware of one node kind and the site keys needed to submit to it.

Site keys (partition, account, qos, time, container, reservation, segment, exclusive) are typed
fields; the sbatch text is built from them by ``hpcrl.launch.sbatch``, never by gluing strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hpcrl.config.checks import MISSING, non_negative, positive
from hpcrl.errors import ConfigError


class Scheduler(StrEnum):
    local = "local"  # no Slurm: the whole loop runs on this machine
    slurm = "slurm"


@dataclass
class SlurmSite:
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "04:00:00"
    """Wall-clock limit, Slurm syntax: MM, HH:MM:SS or D-HH:MM:SS."""
    reservation: str | None = None
    segment: int | None = None
    """Keep every ``segment`` nodes in one topology block (GB200 NVL72 racks); must divide the node count."""
    exclusive: bool = True
    constraint: str | None = None
    signal_delay_s: int = 120
    """Seconds between the USR2 warning and the kill: time left to write a checkpoint."""
    max_requeues: int = 3
    required: list[str] = field(default_factory=list)
    """Site keys this cluster cannot submit without, as dotted names under ``cluster.``."""

    def time_minutes(self) -> int:
        return parse_slurm_time(self.time)


@dataclass
class ContainerConfig:
    image: str | None = None
    """pyxis/enroot image (a squashfs path or an image reference); None runs on the bare node."""
    mounts: list[str] = field(default_factory=list)
    """``src:dst`` bind mounts, the shared filesystem at least."""
    workdir: str | None = None


@dataclass
class ImexConfig:
    """GB200 multi-node NVLink: IMEX channel and the NCCL settings that go with it."""

    enabled: bool = False
    channel: int | None = None
    """Fixed ``/dev/nvidia-caps-imex-channels/channelN``; None lets Slurm's switch/nvidia_imex assign one."""


@dataclass
class BootstrapConfig:
    """Deadlines of the start-up inside the job (``hpcrl/launch/job.py``): a node that waits longer for
    a step fails the job with a line naming the step, so no allocation idles on a hang. Raise them on
    sites with slow shared filesystems or many nodes."""

    shared_dir_s: float = 30.0
    """How long every node waits to see node 0's file in the run directory (the shared filesystem)."""
    ray_head_s: float = 90.0
    """How long the other nodes wait for node 0 to publish the Ray head's address."""
    ray_nodes_s: float = 120.0
    """How long node 0 waits for every node and GPU of the job to join the Ray cluster."""

    def check(self) -> None:
        for key in ("shared_dir_s", "ray_head_s", "ray_nodes_s"):
            positive(f"cluster.bootstrap.{key}", getattr(self, key))


@dataclass
class ClusterConfig:
    name: str = MISSING
    scheduler: Scheduler = Scheduler.slurm
    gpu: str = MISSING
    """Accelerator model as printed in plans (GB200, B200, H200, H100, cpu)."""
    gpus_per_node: int = MISSING
    gpu_memory_gb: float = MISSING
    """Usable HBM per GPU in GB (1e9 bytes), as the vendor tools report it."""
    gpu_bf16_tflops: float = 0.0
    """Dense bf16 peak per GPU, for MFU figures."""
    cpus_per_node: int = 1
    arch: str = "x86_64"
    nvlink_domain_nodes: int = 1
    """Nodes in one NVLink domain (18 on a GB200 NVL72 rack)."""
    max_nodes: int | None = None
    python: str | None = "python3"
    """Interpreter that runs the job on the nodes (inside the container when there is one);
    None: the interpreter running hpcrl (clusters that share this machine's filesystem and venv)."""
    slurm: SlurmSite = field(default_factory=SlurmSite)
    container: ContainerConfig = field(default_factory=ContainerConfig)
    imex: ImexConfig = field(default_factory=ImexConfig)
    bootstrap: BootstrapConfig = field(default_factory=BootstrapConfig)
    env: dict[str, str] = field(default_factory=dict)
    """Environment for every task (NCCL settings and the like). Never put secrets here."""

    def check(self) -> None:
        positive("cluster.gpus_per_node", self.gpus_per_node)
        positive("cluster.gpu_memory_gb", self.gpu_memory_gb)
        positive("cluster.cpus_per_node", self.cpus_per_node)
        non_negative("cluster.gpu_bf16_tflops", self.gpu_bf16_tflops)
        positive("cluster.nvlink_domain_nodes", self.nvlink_domain_nodes)
        if self.max_nodes is not None:
            positive("cluster.max_nodes", self.max_nodes)
        if self.slurm.segment is not None:
            positive("cluster.slurm.segment", self.slurm.segment)
        positive("cluster.slurm.signal_delay_s", self.slurm.signal_delay_s)
        non_negative("cluster.slurm.max_requeues", self.slurm.max_requeues)
        self.slurm.time_minutes()
        self.bootstrap.check()
        for mount in self.container.mounts:
            if ":" not in mount:
                raise ConfigError(f"cluster.container.mounts entry '{mount}' must be 'src:dst'")
        for name in self.env:
            if looks_secret(name):
                raise ConfigError(
                    f"cluster.env.{name} looks like a secret; export it in your shell instead "
                    "(hpcrl forwards it to the job without writing it anywhere)"
                )
        if self.scheduler is Scheduler.slurm:
            self.check_required_site_keys()

    def check_required_site_keys(self) -> None:
        missing = [key for key in self.slurm.required if self.site_value(key) in (None, "", [])]
        if missing:
            from hpcrl.config.paths import site_file

            fixes = " ".join(f"cluster.{key}=<value>" for key in missing)
            raise ConfigError(
                f"cluster '{self.name}' requires {', '.join('cluster.' + k for k in missing)}; "
                f"add {fixes} to the command line, run `hpcrl init`, or add to {site_file()}: "
                f"{site_snippet(self.name, missing)}"
            )

    def site_value(self, dotted: str) -> object:
        node: object = self
        for part in dotted.split("."):
            if not hasattr(node, part):
                raise ConfigError(
                    f"cluster.slurm.required names unknown key 'cluster.{dotted}'; "
                    "use keys under cluster.slurm or cluster.container"
                )
            node = getattr(node, part)
        return node


def site_snippet(cluster: str, keys: list[str]) -> str:
    """The site.yaml entry that sets dotted ``keys`` (below ``cluster.``) for ``cluster``, with
    placeholders, as one line of YAML (flow style: the error stays one line, and it pastes as is)."""
    tree: dict[str, Any] = {}
    for key in sorted(keys):
        *sections, leaf = key.split(".")
        node = tree
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = f"<{leaf}>"

    def flow(value: Any) -> str:
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k}: {flow(v)}" for k, v in value.items()) + "}"
        return str(value)

    return f"clusters: {{{cluster}: {flow(tree)}}}"


SECRET_PATTERN = re.compile(r"(TOKEN|SECRET|PASSWORD|API_KEY|APIKEY|CREDENTIAL)", re.IGNORECASE)


def looks_secret(name: str) -> bool:
    return bool(SECRET_PATTERN.search(name))


_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_slurm_time(text: str) -> int:
    """Slurm time string to whole minutes (rounded up); raises ConfigError on anything else."""
    match = _TIME.match(text.strip())
    if not match:
        raise ConfigError(f"cluster.slurm.time='{text}' is not a Slurm time; use MM, HH:MM:SS or D-HH:MM:SS")
    days, a, b, c = match.groups()
    if days is not None or c is not None:  # D-HH[:MM[:SS]] or HH:MM:SS
        hours, minutes, seconds = int(a), int(b or 0), int(c or 0)
    elif b is not None:  # MM:SS
        hours, minutes, seconds = 0, int(a), int(b)
    else:  # MM
        hours, minutes, seconds = 0, int(a), 0
    total = int(days or 0) * 1440 + hours * 60 + minutes + (1 if seconds else 0)
    if total <= 0:
        raise ConfigError(f"cluster.slurm.time='{text}' must be longer than zero")
    return total
