"""``hpcrl submit -m``: Hydra multirun syntax, one job per point: a Slurm job, or a RayJob on a Kubernetes
cluster (``cluster.scheduler: kuberay``), each with its own run directory and job record.

``algo.lr=1e-6,3e-6 algo.kl_coef=0,0.01`` is four points (the cartesian product). Every point is
composed and planned before the first job goes out: one bad point submits nothing.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl.config.cluster import Scheduler
from hpcrl.errors import HpcrlError
from hpcrl.plan.planner import Plan, plan_from_overrides

SWEEPS_DIR = "sweeps"


def expand(overrides: list[str]) -> list[list[str]]:
    """Hydra override lines -> one override list per point (sweeps: ``a=1,2``, ``range(..)``, ``choice(..)``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    axes: list[list[str]] = []
    for o in OverridesParser.create().parse_overrides(overrides):
        if o.is_sweep_override():
            axes.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
        else:
            axes.append([o.input_line or ""])
    return [list(point) for point in itertools.product(*axes)]


@dataclass(frozen=True)
class Point:
    index: int
    overrides: list[str]
    """Only the overrides that vary between points (what the table shows)."""
    plan: Plan


def varying(points: list[list[str]]) -> list[int]:
    """The positions of the overrides that differ between points (what the tables show)."""
    return [i for i in range(len(points[0])) if len({p[i] for p in points}) > 1]


def checked_plan(point: list[str]) -> Plan:
    """One point's plan with every check ``hpcrl submit`` makes before a job goes out, Slurm's own
    (``sbatch --test-only``, one a point) included: a point Slurm refuses is named before any is
    submitted or written (``submit_sweep`` does not ask again)."""
    from hpcrl.launch.gate import require_submittable

    plan = plan_from_overrides(point)
    require_submittable(plan, ask_slurm=True)
    return plan


def plan_points(overrides: list[str]) -> list[Point]:
    points = expand(overrides)
    varying_at = varying(points)
    planned = []
    for n, point in enumerate(points):
        try:
            plan = checked_plan(point)
        except HpcrlError as exc:
            shown = " ".join(point[i] for i in varying_at)
            raise HpcrlError(f"sweep point {n} ({shown}): {exc}; nothing was submitted") from None
        planned.append(Point(n, [point[i] for i in varying_at], plan))
    return planned


def preview_multirun(overrides: list[str]) -> int:
    """``hpcrl render -m`` / ``hpcrl submit -m --dry-run``: every point planned, its config and sbatch
    file (a Slurm cluster) or RayJob manifest (Kubernetes) written under a preview directory, one line a
    point with its verdict; nothing submitted. Exit 1 when a point would be refused (``submit -m`` would
    submit none)."""
    from hpcrl.run.rundir import write_resolved_config

    points = expand(overrides)
    varying_at = varying(points)
    out: Path | None = None
    refused = 0
    print(f"{'point':>5}  {'overrides':40s}  verdict")
    for n, point in enumerate(points):
        shown = " ".join(point[i] for i in varying_at)
        try:
            plan = checked_plan(point)
        except HpcrlError as exc:
            refused += 1
            print(f"{n:>5}  {shown:40s}  refused: {exc}")
            continue
        cfg = plan.cfg
        out = (
            out
            or Path(cfg.run.output_root)
            / SWEEPS_DIR
            / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}-preview"
        )
        where = out / f"p{n}"
        where.mkdir(parents=True, exist_ok=True)
        write_resolved_config(cfg, where)
        _write_job_file(plan, where)
        peak = f"peak {plan.memory.train_gpu_peak:.0f} of {plan.memory.capacity:.0f} GB per GPU"
        print(f"{n:>5}  {shown:40s}  fits ({plan.topology.nodes} node(s), {peak})  {where}")
    verdict = f"{refused} of {len(points)} point(s) would be refused" if refused else "every point fits"
    print(f"{verdict}; nothing was submitted" + (f" (files: {out})" if out else ""))
    return 1 if refused else 0


def _write_job_file(plan: Plan, where: Path) -> None:
    """What ``submit`` would hand the scheduler for this point: the sbatch script or the RayJob."""
    if plan.cfg.cluster.scheduler is Scheduler.slurm:
        from hpcrl.launch.sbatch import render_sbatch

        (where / "sbatch.sh").write_text(render_sbatch(plan, where.resolve()))
    elif plan.cfg.cluster.scheduler is Scheduler.kuberay:
        from hpcrl.launch.kuberay import manifest_yaml, rayjob

        # under run.output_root as the pods see it (on their volume): the path a submitted point gets
        (where / "rayjob.yaml").write_text(manifest_yaml(rayjob(plan, where)))


def submit_sweep(points: list[Point], into: Path | None = None) -> tuple[Path, list[dict[str, Any]]]:
    """One job per point, recorded in ``sweep.json`` as each goes out, so a sweep stopped half-way (a
    refused ``sbatch``, a lost login) leaves a directory ``ls --sweep`` reads; ``into`` (that directory)
    submits only the points it does not hold yet."""
    from hpcrl.launch.submit import submit

    first = points[0].plan.cfg
    stamp = time.strftime("%Y%m%d-%H%M%S")
    sweep_dir = into or Path(first.run.output_root) / SWEEPS_DIR / f"{first.run.name}-{stamp}"
    sweep_dir.mkdir(parents=True, exist_ok=True)
    path = sweep_dir / "sweep.json"
    rows: list[dict[str, Any]] = json.loads(path.read_text())["points"] if path.exists() else []
    held = {(r["point"], tuple(r["overrides"])) for r in rows}
    if into is not None and not rows:
        raise HpcrlError(f"{into} holds no sweep.json: --into resumes a sweep `hpcrl submit -m` started")
    for p in points:
        if (p.index, tuple(p.overrides)) in held:
            continue
        try:
            done = submit(p.plan, suffix=f"p{p.index}", asked=True)  # plan_points asked Slurm
        except HpcrlError as exc:
            raise HpcrlError(
                f"sweep stopped at point {p.index} ({' '.join(p.overrides)}): {exc}; {len(rows)} job(s) went "
                f"out ({sweep_dir}); the same command with --into {sweep_dir} submits the rest"
            ) from None
        rows.append(
            {"point": p.index, "overrides": p.overrides, "job_id": done.job_id, "run_dir": str(done.run_dir)}
        )
        path.write_text(json.dumps({"points": rows}, indent=1))
    return sweep_dir, rows


def latest_metric(run_dir: Path) -> str:
    from hpcrl.run.metrics import read_metrics

    rows = read_metrics(run_dir)
    for key in ("val/accuracy", "train/reward"):
        hits = [r for r in rows if key in r]
        if hits:
            return f"{key}={hits[-1][key]:.3f} @ step {hits[-1]['step']}"
    return "-"


def summary(sweep_dir: Path) -> list[dict[str, Any]]:
    from hpcrl.launch.lifecycle import any_state

    path = sweep_dir / "sweep.json"
    if not path.exists():
        raise HpcrlError(f"{sweep_dir} is not a sweep directory (no sweep.json); `hpcrl submit -m` prints it")
    rows = json.loads(path.read_text())["points"]
    for row in rows:
        row["state"] = any_state(row["job_id"], Path(row["run_dir"]))  # Slurm's, or the RayJob's
        row["metric"] = latest_metric(Path(row["run_dir"]))
    return rows


def submit_multirun(overrides: list[str], into: Path | None = None) -> int:
    """``hpcrl submit -m``: validate every point, submit one job each (``into``: the points a stopped
    sweep has not submitted), print the table."""
    points = plan_points(overrides)  # every point validated before the first job goes out
    if points[0].plan.cfg.cluster.scheduler is Scheduler.local:
        raise HpcrlError(
            "submit -m submits one job per point; choose a Slurm or Kubernetes cluster (cluster=...)"
        )
    sweep_dir, rows = submit_sweep(points, into)
    print(f"sweep   {sweep_dir}  ({len(rows)} jobs)")
    print(f"{'point':>5}  {'job':>8}  {'overrides':40s}  run dir")
    for row in rows:
        print(f"{row['point']:>5}  {row['job_id']:>8}  {' '.join(row['overrides']):40s}  {row['run_dir']}")
    print(f"follow with: hpcrl ls --sweep {sweep_dir}")
    return 0


def print_summary(sweep_dir: Path) -> None:
    """``hpcrl ls --sweep DIR``: one line a point."""
    print(f"{'point':>5}  {'job':>8}  {'state':<12} {'overrides':40s}  latest")
    for row in summary(sweep_dir):
        overrides = " ".join(row["overrides"])
        print(f"{row['point']:>5}  {row['job_id']:>8}  {row['state']:<12} {overrides:40s}  {row['metric']}")
