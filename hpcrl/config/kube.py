"""Kubernetes site keys (``cluster.kube``): what a KubeRay RayJob needs beyond the node kind.

Read by ``hpcrl.launch.kuberay`` when ``cluster.scheduler`` is ``kuberay``; the GKE catalog clusters
(``conf/cluster/gke_*.yaml``) fill them as seed 000's manifests do (node selectors and tolerations of a
ComputeClass, the gIB NCCL environment, a Cloud Storage FUSE volume, an in-memory /dev/shm).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hpcrl.core.checks import positive
from hpcrl.errors import ConfigError

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
"""A Kubernetes object name (RFC 1123 label)."""


@dataclass
class KubeVolume:
    """Shared storage mounted into every pod at ``mount``: exactly one of ``pvc`` (a PersistentVolumeClaim,
    Filestore's CSI included), ``gcs_bucket`` (Cloud Storage FUSE CSI) or ``host_path``."""

    name: str
    mount: str
    pvc: str | None = None
    gcs_bucket: str | None = None
    host_path: str | None = None
    read_only: bool = False

    def check(self, at: str) -> None:
        if not _NAME.match(self.name):
            raise ConfigError(
                f"{at}.name='{self.name}' is not a Kubernetes name; use lower-case letters, digits, '-'"
            )
        if not self.mount.startswith("/"):
            raise ConfigError(f"{at}.mount='{self.mount}' must be an absolute path in the pods")
        sources = [k for k in ("pvc", "gcs_bucket", "host_path") if getattr(self, k)]
        if len(sources) != 1:
            raise ConfigError(
                f"{at}: set exactly one of pvc, gcs_bucket, host_path (got {sources or 'none'})"
            )


@dataclass
class Toleration:
    """One toleration of the GPU workers, as Kubernetes writes it."""

    key: str
    operator: str = "Equal"
    value: str | None = None
    effect: str | None = None

    def as_dict(self) -> dict[str, str]:
        return {k: v for k, v in vars(self).items() if v is not None}


@dataclass
class KubeSite:
    namespace: str = "default"
    service_account: str | None = None
    """The pods' Kubernetes service account (on GKE, the one Workload Identity binds to the bucket)."""
    node_selector: dict[str, str] = field(default_factory=dict)
    """The GPU workers' node selector (``cloud.google.com/compute-class``, ``cloud.google.com/gke-accelerator``)."""
    tolerations: list[Toleration] = field(default_factory=list)
    """The GPU workers' tolerations (key, operator, value, effect)."""
    annotations: dict[str, str] = field(default_factory=dict)
    """The GPU workers' pod annotations (GKE multi-network interfaces, gcsfuse sidecar limits)."""
    volumes: list[KubeVolume] = field(default_factory=list)
    shm_gb: int = 64
    """Size of the in-memory /dev/shm of a GPU worker (NCCL and vLLM use it)."""
    queue: str | None = None
    """A Kueue LocalQueue: the RayJob is created suspended with its queue label and Kueue admits it
    (DWS Flex-Start through a ProvisioningRequest behind the queue)."""
    ray_token_secret: str = "hpcrl-ray-token"
    """The Secret (key ``token``) that holds the Ray cluster's auth token: mounted as a file, never inline."""
    ray_version: str = "2.60.0"
    head_cpus: int = 8
    head_memory_gb: int = 32
    step_margin_s: int = 120
    """Seconds a deleted pod's step in flight may take to end before the driver saves: the pods'
    ``terminationGracePeriodSeconds`` is this plus the plan's save estimate (``plan/savetime.py``). 120 s:
    Slurm's warning time (``cluster.slurm.signal_delay_s``) for the same step; raise it when a step takes
    longer (``hpcrl logs`` shows steps' seconds)."""
    worker_setup: str | None = None
    """A shell line every GPU worker runs before Ray starts (gIB: ``source /usr/local/gib/scripts/set_nccl_env.sh``)."""

    def check(self) -> None:
        for key in ("namespace", "ray_token_secret"):
            value = getattr(self, key)
            if not _NAME.match(value):
                raise ConfigError(
                    f"cluster.kube.{key}='{value}' is not a Kubernetes name; use lower-case letters, digits, '-'"
                )
        positive("cluster.kube.shm_gb", self.shm_gb)
        positive("cluster.kube.head_cpus", self.head_cpus)
        positive("cluster.kube.head_memory_gb", self.head_memory_gb)
        positive("cluster.kube.step_margin_s", self.step_margin_s)
        for i, vol in enumerate(self.volumes):
            vol.check(f"cluster.kube.volumes[{i}]")
        names = [v.name for v in self.volumes]
        if len(set(names)) != len(names):
            raise ConfigError(f"cluster.kube.volumes: names must differ (got {names})")
        for i, tol in enumerate(self.tolerations):
            if tol.operator not in ("Equal", "Exists"):
                raise ConfigError(
                    f"cluster.kube.tolerations[{i}].operator='{tol.operator}': use Equal or Exists"
                )
