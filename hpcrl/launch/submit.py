"""``hpcrl submit`` on a Slurm cluster: write the run directory, submit through submitit, return at once."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from hpcrl.config.cluster import Scheduler
from hpcrl.errors import HpcrlError
from hpcrl.hub.check import pin_inputs
from hpcrl.launch.doctor import expect_from_plan
from hpcrl.launch.job import NodeTask
from hpcrl.launch.kube_entry import DRIVER_LOG
from hpcrl.launch.mounts import check_mounts
from hpcrl.launch.ray_cluster import make_token
from hpcrl.launch.sbatch import SUBMITIT_DIR, container_args, make_executor, render_sbatch
from hpcrl.plan.planner import Plan
from hpcrl.run.rundir import atomic_write_text, new_run_dir, write_resolved_config

JOBS_INDEX = ".jobs"
"""``<output_root>/.jobs/<job id>`` holds the run directory of each submitted job."""


@dataclass(frozen=True)
class Submitted:
    job_id: str
    run_dir: Path

    @property
    def logs(self) -> list[Path]:
        if json.loads((self.run_dir / "job.json").read_text()).get("scheduler") == "kuberay":
            return [self.run_dir / DRIVER_LOG]  # the RayJob's driver
        return [self.run_dir / SUBMITIT_DIR / f"{self.job_id}_{i}_log.out" for i in range(self.nodes)]

    @property
    def nodes(self) -> int:
        return int(json.loads((self.run_dir / "job.json").read_text())["nodes"])


def submit(
    plan: Plan, hold_s: float = 0.0, smoke: bool = False, *, debug: bool = False, suffix: str = ""
) -> Submitted:
    """``debug``: a held session (placement check, then Ray stays up until the time limit or cancel).
    ``suffix``: appended to the run directory's name (sweep points submitted in the same second)."""
    cfg = plan.cfg
    if cfg.cluster.scheduler is Scheduler.kuberay:
        from hpcrl.launch import kube_jobs

        if hold_s or smoke or suffix:
            raise HpcrlError(
                "--hold, --smoke and sweeps (-m) are Slurm's; on Kubernetes submit the run alone"
            )
        return kube_jobs.submit(plan, debug=debug)
    run_dir = new_run_dir(cfg).resolve()
    if suffix:
        run_dir = run_dir.with_name(f"{run_dir.name}-{suffix}")
    # checks before any file of the run is written
    check_mounts(plan, run_dir)  # paths the job's container would not see
    pin_inputs(cfg)  # the commit the cache holds now, absolute paths: what the job resolves
    run_dir.mkdir(parents=True, exist_ok=True)
    write_resolved_config(cfg, run_dir)
    make_token(run_dir)  # 0600, on the shared filesystem: the job's nodes and `hpcrl run` read it
    atomic_write_text(run_dir / "sbatch.sh", render_sbatch(plan, run_dir))
    task = NodeTask(
        str(run_dir),
        plan.topology.node_roles(),
        None if smoke or debug else plan,
        hold_s=math.inf if debug else hold_s,
        bootstrap=cfg.cluster.bootstrap,
        expect=expect_from_plan(plan, run_dir=str(run_dir)),
    )
    job_id = submit_task(plan, run_dir, task, kept=f" Run dir kept: {run_dir}")
    roles = plan.topology.node_roles()
    return record_job(plan, job_id, run_dir, roles, cfg.run.name, debug=debug)


def submit_task(plan: Plan, run_dir: Path, task: object, *, kept: str = "", **slurm: object) -> str:
    """Queue ``task`` with the plan's executor (``slurm``: parameters over the plan's, e.g. fewer
    nodes); its job id. A refused submission is one line with sbatch's own words."""
    try:
        executor = make_executor(plan, run_dir)
        if slurm:
            executor.update_parameters(**slurm)
        return str(executor.submit(task).job_id)
    except Exception as exc:  # submitit raises RuntimeError/FailedSubmissionError with sbatch's own words
        reason = " ".join(str(exc).split())[:400]
        raise HpcrlError(
            f"submission to Slurm failed ({reason}); check that sbatch works here "
            f"(SLURM_CONF, partition/account in cluster.slurm.*).{kept}"
        ) from None


def record_job(
    plan: Plan,
    job_id: str,
    run_dir: Path,
    roles: list[str],
    name: str,
    *,
    debug: bool = False,
    here: bool = False,
    extra: dict[str, str] | None = None,
) -> Submitted:
    """``job.json`` in the run directory and the ``.jobs`` index entry: what status/logs/cancel read.
    ``here``: a ``debug --here`` session, one step of an allocation the user holds (``launch/here.py``).
    ``extra``: more keys (a Kubernetes job's scheduler, namespace and kind: ``launch/kube_jobs.py``)."""
    cfg = plan.cfg
    meta = {
        "job_id": job_id,
        "nodes": len(roles),
        "submitted": time.time(),
        "roles": roles,
        "cluster": cfg.cluster.name,
        "name": name,
        "debug": debug,
        "here": here,
        "gpus_per_node": cfg.cluster.gpus_per_node,
        "python": cfg.cluster.python,
        "container_args": container_args(cfg.cluster, run_dir),
        **(extra or {}),
    }
    atomic_write_text(run_dir / "job.json", json.dumps(meta, indent=1))
    index = Path(cfg.run.output_root) / JOBS_INDEX
    index.mkdir(parents=True, exist_ok=True)
    atomic_write_text(index / job_id, str(run_dir))
    return Submitted(job_id, run_dir)
