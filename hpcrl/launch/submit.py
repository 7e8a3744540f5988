"""``hpcrl submit`` on a Slurm cluster: write the run directory, submit through submitit, return at once. A
Kubernetes cluster (``cluster.scheduler: kuberay``) goes to ``launch/kube_jobs.py``."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from hpcrl.config.cluster import Scheduler
from hpcrl.errors import HpcrlError
from hpcrl.hub.check import pin_inputs
from hpcrl.launch.doctor import expect_from_plan
from hpcrl.launch.job import NodeTask
from hpcrl.launch.jobrecord import Submitted, record_job
from hpcrl.launch.mounts import check_mounts
from hpcrl.launch.ray_cluster import make_token
from hpcrl.launch.sbatch import make_executor, render_sbatch
from hpcrl.launch.slurm_checks import kill_wait_s, kill_wait_warning, require_accepted
from hpcrl.plan.planner import Plan
from hpcrl.run.rundir import atomic_write_text, new_run_dir, write_resolved_config


def submit(
    plan: Plan,
    hold_s: float = 0.0,
    smoke: bool = False,
    *,
    debug: bool = False,
    suffix: str = "",
    asked: bool = False,
) -> Submitted:
    """``debug``: a held session (placement check, then Ray stays up until the time limit or cancel).
    ``suffix``: appended to the run directory's name (sweep points submitted in the same second).
    ``asked``: Slurm's ``sbatch --test-only`` was asked of this plan already (a sweep asks every point
    before the first goes out): not again."""
    cfg = plan.cfg
    if cfg.cluster.scheduler is Scheduler.kuberay:
        from hpcrl.launch import kube_jobs

        if hold_s or smoke:
            raise HpcrlError("--hold and --smoke are Slurm's; on Kubernetes submit the run alone")
        return kube_jobs.submit(plan, debug=debug, suffix=suffix)
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
    if not (smoke or debug) and (line := kill_wait_warning(plan, kill_wait_s())):
        print(f"hpcrl: warning: {line}", file=sys.stderr)
    if not asked:  # Slurm's refusal as one line, before anything is queued
        require_accepted(plan, run_dir / "sbatch.sh")
    task = NodeTask(
        str(run_dir),
        plan.node_roles(),
        None if smoke or debug else plan,
        hold_s=math.inf if debug else hold_s,
        bootstrap=cfg.cluster.bootstrap,
        expect=expect_from_plan(plan, run_dir=str(run_dir)),
    )
    job_id = submit_task(plan, run_dir, task, kept=f" Run dir kept: {run_dir}")
    roles = plan.node_roles()
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
