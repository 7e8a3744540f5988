"""Whether a plan may be submitted, decided in one place: ``hpcrl plan``, ``render``, ``submit`` (one
run, or every point of a sweep) and ``hpcrl run`` ask this, so that what plan and render accept submit
takes, and what submit refuses they refuse with the same line."""

from __future__ import annotations

from pathlib import Path

from hpcrl.config.cluster import Scheduler
from hpcrl.config.preflight import check_context
from hpcrl.hub.check import check_inputs
from hpcrl.launch.mounts import check_mounts
from hpcrl.plan.planner import Plan
from hpcrl.run.rundir import new_run_dir


def require_submittable(plan: Plan, run_dir: Path | None = None) -> None:
    """Raise the first refusal, one ConfigError line naming the key and the fix: the backend cannot
    build the model (first: refused whatever else it needs), the memory does not fit, the sequences
    outgrow the model's positions, the cache lacks an input or holds a data set without the fields the
    run reads, or on Slurm a path the job opens is outside its container's mounts. ``run_dir``: where
    the run's files go; None: where submit would put them (only its place matters, nothing is written)."""
    plan.require_buildable()
    plan.require_fit()
    check_context(plan.cfg)
    check_inputs(plan.cfg)
    if plan.cfg.cluster.scheduler is Scheduler.slurm:
        check_mounts(plan, (run_dir or new_run_dir(plan.cfg)).resolve())
