"""KubeRay manifests from the plan (``cluster.scheduler: kuberay``): a RayJob for ``submit``, a RayCluster for
``debug``, as plain dicts written as YAML.

One worker group a role of ``Plan.node_roles()``, in its order, as the sbatch job has one task a node:
``train-rollout`` (colocated) or ``rollout`` and ``train`` (split), then ``judge`` (``rewards.judge.nodes``)
and any role the plan adds; ``replicas`` = the role's nodes, each pod one whole node (every GPU, the
node's CPUs and memory), with the role's Ray resources as ``ray start`` gets them in a Slurm job
(``run.actors.role_resources``). The head is a CPU pod that runs no tasks; the driver is the RayJob's
entrypoint (``hpcrl.launch.kube_entry``: the same loop as on the head node of an sbatch job, joining the
running cluster). Every pod mounts ``cluster.kube.volumes`` (the run directory must live on one), the Ray
token as a file from a Secret (never inline), and GPU workers an in-memory /dev/shm. Every Ray pod has a
preStop hook (``hpcrl.launch.kube_prestop``) that asks the driver to save when the pod is deleted, and a
grace period that covers the step in flight and the save (``grace_seconds``). Validated against
Kubernetes' OpenAPI schema and KubeRay's CRDs in tests/launch/test_kuberay.py.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl.config.cluster import ClusterConfig
from hpcrl.config.kube import KubeSite, KubeVolume
from hpcrl.errors import ConfigError
from hpcrl.plan.components import node_gpus
from hpcrl.plan.planner import Plan
from hpcrl.plan.savetime import save_seconds

TOKEN_DIR = "/etc/hpcrl/ray"
"""Where every pod finds the Ray token (``RAY_AUTH_TOKEN_PATH``), a file from ``cluster.kube.ray_token_secret``."""


def check_kube(plan: Plan, run_dir: Path) -> None:
    """What a RayJob cannot run without, one line each, before anything is created."""
    cluster = plan.cfg.cluster
    if not cluster.container.image:
        raise ConfigError(
            f"cluster '{cluster.name}' runs pods: set cluster.container.image=<image> (or in the site file)"
        )
    mounts = [v.mount.rstrip("/") + "/" for v in cluster.kube.volumes]
    if not any(str(run_dir).startswith(m) for m in mounts):
        raise ConfigError(
            f"run.output_root: the run directory {run_dir} is on none of the pods' volumes "
            f"({', '.join(mounts) or 'none'}); put run.output_root under a cluster.kube.volumes mount "
            "(e.g. run.output_root=/data/runs)"
        )


def pods_run_dir(plan: Plan, run_dir: Path) -> Path:
    """The run directory as the pods see it: ``run.output_root`` (on a shared volume) and the run's name."""
    return Path(plan.cfg.run.output_root) / run_dir.name


def k8s_name(text: str) -> str:
    """An RFC 1123 name (lower case, '-', at most 63 characters) from a run name."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return name[:63].rstrip("-") or "hpcrl"


def rayjob(plan: Plan, run_dir: Path) -> dict[str, Any]:
    """The RayJob that runs this plan with ``run_dir`` (on a shared volume) as its run directory."""
    cfg, cluster = plan.cfg, plan.cfg.cluster
    kube, site = cluster.kube, cluster.slurm
    check_kube(plan, run_dir)
    spec: dict[str, Any] = {
        "entrypoint": f"python -m hpcrl.launch.kube_entry {run_dir}",
        "submissionMode": "K8sJobMode",
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": 3600,
        # the job's limits are the site's, as for Slurm: wall clock and requeues (a Spot preemption retries)
        "activeDeadlineSeconds": site.time_minutes() * 60,
        "backoffLimit": site.max_requeues,
        "rayClusterSpec": ray_cluster_spec(plan, run_dir),
        "submitterPodTemplate": _submitter(cluster),
    }
    if kube.queue:
        spec["suspend"] = True  # Kueue admits it (DWS Flex-Start behind the queue)
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": _metadata(k8s_name(run_dir.name), kube, cfg.run.name),
        "spec": spec,
    }


def raycluster(plan: Plan, name: str, run_dir: Path) -> dict[str, Any]:
    """A RayCluster of the plan's shape for ``hpcrl debug``: the same pods, no driver (the one a user
    starts in the head pod with ``run_dir`` is asked to save as a RayJob's is)."""
    kube = plan.cfg.cluster.kube
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": _metadata(k8s_name(name), kube, plan.cfg.run.name),
        "spec": ray_cluster_spec(plan, run_dir),
    }


def grace_seconds(plan: Plan) -> int:
    """The pods' ``terminationGracePeriodSeconds``: the step in flight (``cluster.kube.step_margin_s``)
    and then one save (``plan/savetime.py``), counted from the pod's deletion as Kubernetes counts it."""
    return plan.cfg.cluster.kube.step_margin_s + math.ceil(save_seconds(plan))


def role_groups(plan: Plan) -> list[tuple[str, int, int]]:
    """Each role of ``Plan.node_roles()``, its node count and the GPUs of one of its nodes (``node_gpus``:
    the node kinds of their own are Slurm's, so on Kubernetes every role's nodes are the cluster's), in
    node order (node 0's role first)."""
    each = node_gpus(plan)
    groups, first = [], 0
    for role, nodes in itertools.groupby(plan.node_roles()):
        count = len(list(nodes))
        groups.append((role, count, each[first]))
        first += count
    return groups


def _submitter(cluster: ClusterConfig) -> dict[str, Any]:
    """The pod that runs ``ray job submit`` (KubeRay fills in its command): the job server on the head
    takes only token-authenticated clients, so it mounts the token as every Ray pod does."""
    kube = cluster.kube
    container = {
        "name": "ray-job-submitter",
        "image": cluster.container.image,
        "env": _auth_env(),
        "resources": {"requests": {"cpu": "1", "memory": "1G"}, "limits": {"cpu": "1", "memory": "1G"}},
        "volumeMounts": [{"name": "ray-token", "mountPath": TOKEN_DIR, "readOnly": True}],
    }
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": [_token_volume(kube)],
    }
    if kube.service_account:
        pod["serviceAccountName"] = kube.service_account
    return {"spec": pod}


def _auth_env() -> list[dict[str, str]]:
    return [
        {"name": "RAY_AUTH_MODE", "value": "token"},
        {"name": "RAY_AUTH_TOKEN_PATH", "value": f"{TOKEN_DIR}/token"},
    ]


def _token_volume(kube: KubeSite) -> dict[str, Any]:
    return {"name": "ray-token", "secret": {"secretName": kube.ray_token_secret, "defaultMode": 0o400}}


def _metadata(name: str, kube: KubeSite, run: str) -> dict[str, Any]:
    labels = {"app.kubernetes.io/managed-by": "hpcrl", "hpcrl/run": k8s_name(run)}
    if kube.queue:
        labels["kueue.x-k8s.io/queue-name"] = kube.queue
    return {"name": name, "namespace": kube.namespace, "labels": labels}


def ray_cluster_spec(plan: Plan, run_dir: Path) -> dict[str, Any]:
    from hpcrl.run.actors import role_gpus, role_resources

    cluster = plan.cfg.cluster
    kube = cluster.kube
    stop = Stop(run_dir, grace_seconds(plan))
    head = {
        # the head runs no tasks; its job server listens for the submitter pod (token auth guards it)
        "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
        "template": {
            "metadata": {"annotations": _gcsfuse(kube)},
            "spec": _pod(cluster, "ray-head", stop, gpus=0, head=True),
        },
    }
    workers = [
        {
            "groupName": k8s_name(role),
            "replicas": count,
            "minReplicas": count,
            "maxReplicas": count,
            "rayStartParams": {
                "num-gpus": str(gpus),
                # as ray_cluster.start_node: a role's resources, one unit per GPU of the node
                "resources": json.dumps(role_resources(role, gpus)),
            },
            "template": {
                "metadata": {"annotations": {**kube.annotations, **_gcsfuse(kube)}},
                "spec": _pod(cluster, "ray-worker", stop, gpus=gpus),
            },
        }
        for role, count, gpus in ((r, n, role_gpus(r, g)) for r, n, g in role_groups(plan))
    ]
    return {"rayVersion": kube.ray_version, "headGroupSpec": head, "workerGroupSpecs": workers}


@dataclass(frozen=True)
class Stop:
    """What a Ray pod does when deleted: its preStop hook asks the driver of ``run_dir`` to save and waits
    for its exit, within ``grace_s`` (``terminationGracePeriodSeconds``, which includes the hook)."""

    run_dir: Path
    grace_s: int

    def lifecycle(self) -> dict[str, Any]:
        hook = ["python", "-m", "hpcrl.launch.kube_prestop", str(self.run_dir), "--wait", str(self.grace_s)]
        return {"preStop": {"exec": {"command": hook}}}


def _pod(cluster: ClusterConfig, name: str, stop: Stop, *, gpus: int, head: bool = False) -> dict[str, Any]:
    kube = cluster.kube
    env = [{"name": k, "value": str(v)} for k, v in sorted(cluster.env.items())]
    env += [*_auth_env(), {"name": "RAY_USAGE_STATS_ENABLED", "value": "0"}]
    if head:
        resources = {"cpu": str(kube.head_cpus), "memory": f"{kube.head_memory_gb}G"}
    else:
        resources = {"cpu": str(cluster.cpus_per_node)}
        if gpus:  # an environment pod asks for none
            resources["nvidia.com/gpu"] = str(gpus)
        if cluster.host_memory_gb:
            resources["memory"] = f"{int(cluster.host_memory_gb)}G"
    # the head (a CPU node) gets the shared storage, not the GPU nodes' host paths
    own = [v for v in kube.volumes if not (head and v.host_path)]
    mounts = [_mount(v) for v in own] + [{"name": "ray-token", "mountPath": TOKEN_DIR, "readOnly": True}]
    volumes = [_volume(v) for v in own]
    volumes.append(_token_volume(kube))
    if not head:
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{kube.shm_gb}Gi"}})
    container: dict[str, Any] = {
        "name": name,
        "image": cluster.container.image,
        "env": env,
        "resources": {"requests": resources, "limits": dict(resources)},
        "volumeMounts": mounts,
        "lifecycle": stop.lifecycle(),
    }
    if kube.worker_setup and not head:
        # KubeRay passes its `ray start` as the arguments: run the site's line, then exactly that
        container["command"] = ["/bin/bash", "-c", f'{kube.worker_setup} && eval "$*"', "--"]
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": stop.grace_s,
        "containers": [container],
        "volumes": volumes,
    }
    if kube.service_account:
        pod["serviceAccountName"] = kube.service_account
    if not head:
        pod["nodeSelector"] = dict(kube.node_selector)
        pod["tolerations"] = [t.as_dict() for t in kube.tolerations]
    return pod


def _gcsfuse(kube: KubeSite) -> dict[str, str]:
    """GKE's Cloud Storage FUSE driver serves only pods that ask for its sidecar."""
    return {"gke-gcsfuse/volumes": "true"} if any(v.gcs_bucket for v in kube.volumes) else {}


def _mount(vol: KubeVolume) -> dict[str, Any]:
    return {"name": vol.name, "mountPath": vol.mount, "readOnly": vol.read_only}


def _volume(vol: KubeVolume) -> dict[str, Any]:
    if vol.pvc:
        return {"name": vol.name, "persistentVolumeClaim": {"claimName": vol.pvc, "readOnly": vol.read_only}}
    if vol.gcs_bucket:
        attributes = {"bucketName": vol.gcs_bucket, "gcsfuseMetadataPrefetchOnMount": "true"}
        return {
            "name": vol.name,
            "csi": {"driver": "gcsfuse.csi.storage.gke.io", "volumeAttributes": attributes},
        }
    return {"name": vol.name, "hostPath": {"path": vol.host_path}}


def manifest_yaml(manifest: dict[str, Any]) -> str:
    import yaml

    return str(yaml.safe_dump(manifest, sort_keys=False, width=120))
