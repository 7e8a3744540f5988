"""``hpcrl submit``/``status``/``logs``/``cancel``/``ls``/``debug`` on Kubernetes (``cluster.scheduler:
kuberay``): the same run directory, ``job.json`` and ``.jobs`` index as a Slurm job, a RayJob instead of
an sbatch job. The job id is the RayJob's name (the run directory's name as a Kubernetes name).

The run directory is on the pods' shared volume (``check_kube``) and the submitting machine writes it
at the same path, as a login node writes a Slurm run's: mount that volume here (Filestore, GCS FUSE)
or submit from a pod that has it. The driver (``kube_entry``) reads the plan from it and writes its
log there (``driver.log``); ``logs`` reads that file, or the submitter pod's log through the API where
the run directory is not visible.
"""

from __future__ import annotations

import pickle
from functools import lru_cache
from pathlib import Path
from typing import Any

from hpcrl.errors import HpcrlError
from hpcrl.hub.check import pin_inputs
from hpcrl.launch.jobrecord import Submitted, record_job
from hpcrl.launch.kube_api import Kube
from hpcrl.launch.kube_entry import DRIVER_LOG, PLAN_FILE, RESULT_FILE
from hpcrl.launch.kuberay import k8s_name, manifest_yaml, pods_run_dir, raycluster, rayjob
from hpcrl.plan.planner import Plan
from hpcrl.run.rundir import atomic_write_text, new_run_dir, write_resolved_config

SCHEDULER = "kuberay"

ENDED = {"Complete", "Failed", "ValidationFailed"}
WAITING = {
    "": "PENDING",  # just created: KubeRay has not looked at it yet
    "New": "PENDING",
    "Suspended": "PENDING",  # Kueue holds it until the queue admits it (DWS Flex-Start: capacity found)
    "Suspending": "PENDING",
    "Waiting": "PENDING",
    "Initializing": "CONFIGURING",  # the RayCluster's pods are starting (Slurm: nodes booting)
    "Retrying": "REQUEUED",  # a failed attempt (a Spot preemption) retried under backoffLimit
}


def rayjob_state(status: dict[str, Any]) -> str:
    """A RayJob's ``status`` (jobDeploymentStatus, jobStatus, reason) in Slurm's words."""
    deploy, job = status.get("jobDeploymentStatus", ""), status.get("jobStatus", "")
    if deploy in ENDED:
        if job == "SUCCEEDED":
            return "COMPLETED"
        if job == "STOPPED":
            return "CANCELLED"
        return "TIMEOUT" if status.get("reason") == "DeadlineExceeded" else "FAILED"
    if deploy == "Running":  # the cluster is up; the driver is submitted (PENDING) or running
        return "RUNNING" if job == "RUNNING" else "CONFIGURING"
    return WAITING.get(deploy, f"UNKNOWN ({deploy})")


def raycluster_state(status: dict[str, Any]) -> str:
    """A debug RayCluster's ``status.state``: ready is RUNNING, anything before it CONFIGURING."""
    state = status.get("state", "")
    return "RUNNING" if state == "ready" else "FAILED" if state == "failed" else "CONFIGURING"


@lru_cache(maxsize=8)
def _kube(namespace: str) -> Kube:
    return Kube(namespace)  # one client a namespace (``ls`` asks about many jobs)


def require_root(plan: Plan) -> Path:
    root = Path(plan.cfg.run.output_root)
    if not root.is_dir():
        raise HpcrlError(
            f"run.output_root={root} does not exist here: hpcrl writes the run directory there for the pods; "
            "mount their shared volume at the same path here, or submit from a pod that mounts it"
        )
    return root


def submit(plan: Plan, *, debug: bool = False, suffix: str = "") -> Submitted:
    """Write the run directory (config, plan, manifest), make sure the Ray token's Secret exists, create
    the RayJob (``debug``: a RayCluster without a driver) and record the job as a Slurm one is.
    ``suffix``: appended to the run directory's name, and so to the RayJob's (a sweep's point)."""
    cfg, kube = plan.cfg, plan.cfg.cluster.kube
    require_root(plan)
    run_dir = new_run_dir(cfg).resolve()
    if suffix:
        run_dir = run_dir.with_name(f"{run_dir.name}-{suffix}")
    pin_inputs(cfg)
    api = _kube(kube.namespace)  # credentials before any file of the run is written
    name = k8s_name(run_dir.name)
    if debug:
        plural, manifest = "rayclusters", raycluster(plan, name, pods_run_dir(plan, run_dir))
    else:
        plural, manifest = "rayjobs", rayjob(plan, pods_run_dir(plan, run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    write_resolved_config(cfg, run_dir)
    (run_dir / PLAN_FILE).write_bytes(pickle.dumps(plan))
    atomic_write_text(run_dir / f"{plural[:-1]}.yaml", manifest_yaml(manifest))
    api.ensure_token_secret(kube.ray_token_secret)
    api.create(plural, manifest)
    roles = plan.topology.node_roles()
    extra = {"scheduler": SCHEDULER, "namespace": kube.namespace, "plural": plural}
    return record_job(plan, name, run_dir, roles, cfg.run.name, debug=debug, extra=extra)


def state(meta: dict[str, Any], run_dir: Path) -> str:
    obj = _kube(meta["namespace"]).get(meta["plural"], meta["job_id"])
    if obj is None:  # deleted (cancel) or removed by ttlSecondsAfterFinished: judge by the run directory
        return "ENDED (results present)" if (run_dir / RESULT_FILE).exists() else "ENDED (no result)"
    status = obj.get("status") or {}
    return rayjob_state(status) if meta["plural"] == "rayjobs" else raycluster_state(status)


def logs(meta: dict[str, Any], run_dir: Path) -> list[tuple[str, str]]:
    """The driver's log in the run directory where it is visible, else the submitter pod's log."""
    path = run_dir / DRIVER_LOG
    if path.exists():
        return [(str(path), path.read_text())]
    where = f"RayJob {meta['job_id']} submitter pod (namespace {meta['namespace']})"
    text = _kube(meta["namespace"]).submitter_log(meta["job_id"]) if meta["plural"] == "rayjobs" else None
    return [(where, "(not written yet)" if text is None else text)]


def cancel(meta: dict[str, Any]) -> str:
    """Delete the RayJob (or debug RayCluster): KubeRay removes its cluster and pods. Deleted, not
    suspended: under Kueue, ``suspend`` is the queue's own switch (it would admit the job again), and a
    deleted job frees its GPUs and quota at once; its checkpoints stay in the run directory."""
    kind = "RayJob" if meta["plural"] == "rayjobs" else "RayCluster"
    _kube(meta["namespace"]).delete(meta["plural"], meta["job_id"])
    return f"{kind} {meta['job_id']} (deleted with its pods)"


def debug_session(plan: Plan, *, here: bool) -> int:
    """``hpcrl debug`` on Kubernetes: a RayCluster of the plan's shape, no driver, until cancelled."""
    from hpcrl.launch.gate import require_submittable

    if here:
        raise HpcrlError("debug --here joins a Slurm allocation; on Kubernetes drop --here (a RayCluster)")
    require_submittable(plan)
    done = submit(plan, debug=True)
    ns, name = plan.cfg.cluster.kube.namespace, done.job_id
    head = f"$(kubectl get pod -n {ns} -l ray.io/cluster={name},ray.io/node-type=head -o name)"
    print(
        f"job     {name}  (debug RayCluster, {plan.topology.nodes} worker pod(s) on {plan.cfg.cluster.name})"
    )
    print(f"run dir {done.run_dir}")
    print(f"attach  kubectl exec -it -n {ns} {head} -- bash")
    print(f"run     python -m hpcrl.launch.kube_entry {done.run_dir}        (in the head pod: this plan)")
    print(f"stop    hpcrl cancel {name} --root {plan.cfg.run.output_root}")
    return 0
